"""The ring codec: msgpack payloads of every message type and the frame
(head with the payload inline or an overflow payload, tensors) a link
sends, read back the way a reader does."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ringserve.ring import codec
from ringserve.ring.codec import FrameError
from ringserve.ring.messages import (
    Control,
    ControlKind,
    Decision,
    Entry,
    Hidden,
    NewRequest,
    Output,
    SamplingSpec,
    TopLogprobs,
    Void,
)

MESSAGES = [
    Decision(
        pass_id=812,
        mb_slot=1,
        new_requests=[NewRequest(5, SamplingSpec(temperature=0.7, top_k=40, seed=11))],
        entries=[Entry(5, 0, [1, 2, 3], [9, 10, 11], True, reuse=[4, 6])],
        dropped=[2],
    ),
    Hidden(812),
    Hidden(813, void="forward raised: out of memory", void_rank=2),
    Output(
        812, [17, 42], logprobs=[-0.5, -1.25], top_logprobs=[TopLogprobs([17, 3], [-0.5, -2.0])]
    ),
    Void(813, rank=2, reason="RuntimeError: out of memory"),
    Control(ControlKind.HEARTBEAT, seq=7, rank=1, reason="idle"),
]


def receive(fr: codec.Frame) -> tuple[object, tuple[torch.Tensor, ...]]:
    """Read a frame into fresh buffers sized from its head, as a reader does."""
    head = codec.empty_head()
    head.copy_(fr.head)
    announced = codec.unpack_header(head)
    rest = fr.buffers[1:]
    if announced.overflow:
        payload = torch.empty(announced.payload_len, dtype=torch.uint8)
        payload.copy_(rest.pop(0))
        msg = codec.decode(memoryview(payload.numpy()))
    else:
        msg = codec.decode(codec.inline_payload(head, announced))
    tensors = tuple(spec.empty() for spec in announced.tensors)
    for dst, src in zip(tensors, rest, strict=True):
        dst.copy_(src)
    return msg, tensors


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_type_round_trips(msg) -> None:
    decoded = codec.decode(codec.encode(msg))
    assert type(decoded) is type(msg) and decoded == msg


def test_payload_is_plain_tagged_msgpack() -> None:
    raw = msgspec.msgpack.decode(codec.encode(Hidden(3, void="x", void_rank=1)))
    assert raw == {"type": "hidden", "pass_id": 3, "void": "x", "void_rank": 1}


@pytest.mark.parametrize(
    "payload",
    [b"\x80\x04\x95garbage", msgspec.msgpack.encode({"type": "nope", "pass_id": 1})],
    ids=["pickle-like bytes", "unknown kind"],
)
def test_decode_rejects_what_is_not_a_ring_message(payload: bytes) -> None:
    with pytest.raises(FrameError, match="not a ring message"):
        codec.decode(payload)


@pytest.mark.parametrize("dtype", list(codec.DTYPE_CODES), ids=str)
def test_frame_carries_each_dtype_bit_exact(dtype: torch.dtype) -> None:
    values = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1)) * 100
    t = values.to(dtype) if dtype.is_floating_point else values.to(torch.int64).to(dtype)
    msg, (back,) = receive(codec.frame(Hidden(1), (t,)))
    assert msg == Hidden(1)
    assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)


def test_frame_makes_views_contiguous_and_keeps_order() -> None:
    view = torch.arange(12.0).reshape(3, 4).t()
    extra = torch.arange(5, dtype=torch.int32)
    fr = codec.frame(Hidden(2), (view, extra))
    assert len(fr.buffers) == 3 and all(b.is_contiguous() for b in fr.buffers)
    _, (a, b) = receive(fr)
    assert torch.equal(a, view) and torch.equal(b, extra)


def test_head_has_a_fixed_size_whatever_the_frame_carries() -> None:
    small = codec.frame(Control(ControlKind.HEARTBEAT)).head
    full = codec.frame(Hidden(1), [torch.zeros(1, 2, 3, 4)] * codec.MAX_TENSORS).head
    big = codec.frame(long_decision(4000)).head
    assert small.shape == full.shape == big.shape == (codec.HEAD_BYTES,)
    assert small.dtype == full.dtype == big.dtype == torch.uint8


def long_decision(tokens: int) -> Decision:
    entry = Entry(1, 0, list(range(100_000, 100_000 + tokens)), list(range(tokens)), True)
    return Decision(9, 0, [], [entry], [])


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_a_small_message_is_one_send_with_its_payload_inline(msg) -> None:
    fr = codec.frame(msg)
    assert fr.payload is None and fr.buffers == [fr.head]
    assert not codec.unpack_header(fr.head).overflow
    assert receive(fr) == (msg, ())


def test_a_payload_beyond_the_head_overflows_into_its_own_send() -> None:
    msg = long_decision(2000)
    assert len(codec.encode(msg)) > codec.INLINE_BYTES
    fr = codec.frame(msg, (torch.arange(3.0),))
    announced = codec.unpack_header(fr.head)
    assert announced.overflow and announced.payload_len == len(codec.encode(msg))
    assert fr.payload is not None and bytes(fr.payload.numpy()) == codec.encode(msg)
    got, (t,) = receive(fr)
    assert got == msg and t.tolist() == [0.0, 1.0, 2.0]


def test_an_inline_payload_that_fills_the_head_exactly_stays_inline() -> None:
    tokens = 1
    while len(codec.encode(long_decision(tokens + 1))) <= codec.INLINE_BYTES:
        tokens += 1
    fits, spills = long_decision(tokens), long_decision(tokens + 1)
    assert not codec.unpack_header(codec.frame(fits).head).overflow
    assert codec.unpack_header(codec.frame(spills).head).overflow
    assert receive(codec.frame(fits))[0] == fits


def test_only_a_shutdown_frame_is_final() -> None:
    shutdown = codec.frame(Control(ControlKind.SHUTDOWN, rank=2)).head
    assert codec.unpack_header(shutdown).final
    for msg in MESSAGES + [Control(ControlKind.HEARTBEAT)]:
        assert not codec.unpack_header(codec.frame(msg).head).final
    with pytest.raises(FrameError, match="final frame"):
        codec.frame(Control(ControlKind.SHUTDOWN), (torch.zeros(1),))


def test_scalar_and_empty_tensors_round_trip() -> None:
    _, (scalar, empty) = receive(codec.frame(Hidden(1), (torch.tensor(2.5), torch.empty(0, 4))))
    assert scalar.shape == () and scalar.item() == 2.5
    assert empty.shape == (0, 4)


@pytest.mark.parametrize(
    ("tensors", "match"),
    [
        ([torch.zeros(1)] * (codec.MAX_TENSORS + 1), "at most 4 tensors"),
        ([torch.zeros(1, 1, 1, 1, 1)], "at most 4 dims"),
        ([torch.zeros(2, dtype=torch.float64)], "cannot travel"),
        ([torch.zeros(2, device="meta")], "travel from the CPU"),
    ],
    ids=["too many tensors", "too many dims", "float64", "not on the CPU"],
)
def test_frame_refuses_what_the_header_cannot_describe(tensors, match: str) -> None:
    with pytest.raises(FrameError, match=match):
        codec.frame(Hidden(1), tensors)


def field_set(head: torch.Tensor, index: int, value: int) -> torch.Tensor:
    """A copy of `head` with int64 header field `index` set to `value`."""
    changed = head.clone()
    changed[8 * index : 8 * index + 8] = torch.tensor([value]).view(torch.uint8)
    return changed


def test_header_out_of_step_is_refused() -> None:
    head = codec.frame(Hidden(1), (torch.zeros(2),)).head
    with pytest.raises(FrameError, match="out of step"):
        codec.unpack_header(field_set(head, 0, 12345))
    with pytest.raises(FrameError, match="out of step"):  # a tensor where a head is owed
        codec.unpack_header(
            torch.arange(codec.HEAD_BYTES // 4, dtype=torch.float32).view(torch.uint8)
        )
    with pytest.raises(FrameError, match="dtype code 99"):
        codec.unpack_header(field_set(head, 4, 99))  # the first tensor's dtype code


@pytest.mark.parametrize(
    ("index", "value", "match"),
    [
        (1, codec.OVERFLOW, "-byte payload with flags"),
        (2, codec.INLINE_BYTES + 1, "-byte payload with flags"),
        (1, codec.PLACEHOLDER, "not a frame's"),
        (1, 64, "not a frame's"),
    ],
    ids=[
        "overflow flag, inline size",
        "inline flag, overflow size",
        "placeholder alone",
        "unknown",
    ],
)
def test_header_whose_flags_disagree_with_its_sizes_is_refused(index, value, match) -> None:
    head = codec.frame(Hidden(1)).head
    with pytest.raises(FrameError, match=match):
        codec.unpack_header(field_set(head, index, value))


@settings(max_examples=40, deadline=None)
@given(
    shapes=st.lists(
        st.lists(st.integers(0, 5), max_size=codec.MAX_DIMS), max_size=codec.MAX_TENSORS
    ),
    dtype_index=st.integers(0, len(codec.DTYPE_CODES) - 1),
    pass_id=st.integers(0, 2**40),
)
def test_any_describable_frame_round_trips(shapes, dtype_index: int, pass_id: int) -> None:
    dtype = list(codec.DTYPE_CODES)[dtype_index]
    tensors = tuple(torch.arange(math.prod(s)).reshape(s).to(dtype) for s in shapes)
    msg, back = receive(codec.frame(Hidden(pass_id), tensors))
    assert msg == Hidden(pass_id)
    assert [(b.dtype, b.shape) for b in back] == [(t.dtype, t.shape) for t in tensors]
    assert all(torch.equal(b, t) for b, t in zip(back, tensors, strict=True))


def receive_bundle(fr: codec.Frame) -> tuple[list[object], tuple[torch.Tensor, ...]]:
    """`receive` for a frame that may be a bundle: its messages in order."""
    head = codec.empty_head()
    head.copy_(fr.head)
    announced = codec.unpack_header(head)
    rest = fr.buffers[1:]
    if announced.overflow:
        payload = memoryview(rest.pop(0).numpy())
    else:
        payload = codec.inline_payload(head, announced)
    msgs = codec.decode_bundle(payload) if announced.bundle else [codec.decode(payload)]
    tensors = tuple(spec.empty() for spec in announced.tensors)
    for dst, src in zip(tensors, rest, strict=True):
        dst.copy_(src)
    return msgs, tensors


def test_messages_sent_ahead_share_their_frame_and_its_tensors_are_the_last_ones() -> None:
    ahead = [MESSAGES[0], Control(ControlKind.HEARTBEAT, seq=3)]
    t = torch.arange(6.0).reshape(2, 3)
    fr = codec.frame(Hidden(812), (t,), codec.PREPOSTED, ahead)
    announced = codec.unpack_header(fr.head)
    assert announced.bundle and announced.preposted and not announced.overflow
    assert len(fr.buffers) == 2  # one head and the tensor: one gloo message for three
    msgs, (back,) = receive_bundle(fr)
    assert msgs == [*ahead, Hidden(812)] and torch.equal(back, t)
    alone = codec.frame(Hidden(812), (t,))
    assert not codec.unpack_header(alone.head).bundle


def test_a_bundle_too_long_for_the_head_overflows_whole() -> None:
    big = Decision(1, 0, [], [Entry(1, 0, list(range(3000)), list(range(3000)), True)], [])
    fr = codec.frame(Control(ControlKind.HEARTBEAT, seq=1), (), 0, [big, big])
    announced = codec.unpack_header(fr.head)
    assert announced.bundle and announced.overflow
    assert receive_bundle(fr)[0] == [big, big, Control(ControlKind.HEARTBEAT, seq=1)]


def test_nothing_rides_after_the_final_message_and_bundles_are_arrays() -> None:
    shutdown = Control(ControlKind.SHUTDOWN, rank=0)
    assert codec.unpack_header(codec.frame(shutdown, (), 0, [MESSAGES[0]]).head).final
    with pytest.raises(FrameError, match="final"):
        codec.frame(Hidden(1), (), 0, [shutdown])
    with pytest.raises(FrameError, match="array of ring messages"):
        codec.decode_bundle(codec.encode(Hidden(1)))
    with pytest.raises(FrameError, match="no message"):
        codec.decode_bundle(msgspec.msgpack.encode([]))
