"""The one codec of the ring: msgpack payloads plus raw tensors, never pickle.

A message travels on its link as a FRAME of gloo sends, in this order:

1. head: `HEAD_BYTES` bytes as a uint8 tensor, always that size. It opens
   with the header, `HEADER_LEN` little-endian int64 fields
   `[MAGIC, flags, payload_len, tensor_count, (dtype_code, ndim, d0, d1, d2, d3) * MAX_TENSORS]`
   (unused tensor and dim fields are 0), and, when the payload fits in the
   `INLINE_BYTES` after it, carries the msgpack payload inline;
2. payload: only with flag `OVERFLOW`, the `payload_len` msgpack bytes that
   did not fit, as a uint8 tensor on the head's tag;
3. tensors: each tensor as a contiguous CPU tensor of its own dtype and
   shape; on the head's tag, or with flag `PREPOSTED` on the link's tensor
   tag, into receives posted before the head arrived (see `ring/link.py`).

Flag `FINAL` marks the last frame of a link, the one carrying
`Control(SHUTDOWN)`; `PLACEHOLDER` marks preposted tensors that carry no
data (a void `Hidden` fills the receives its decision announced). Flag
`BUNDLE` marks a frame whose payload is a msgpack array of messages: the
ones sent ahead, which carry no tensors, then the frame's own message, to
which the tensors and the other flags belong (a message held back to ride
with the next one costs no gloo message of its own: see `SendLink.send`).

The head has a fixed size so the receiver can always post it first, and
most messages are that one gloo message: a small frame costs one round trip,
not two. The header tells the receiver what follows and whether another frame
will (so it can post that frame's head at once). `MAGIC` makes a
desynchronised stream fail loudly instead of decoding garbage.
"""

from __future__ import annotations

import struct
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec
import torch

from ringserve.ring.messages import Control, ControlKind, Message

MAGIC = 0x52494E47  # "RING"
MAX_TENSORS = 4
MAX_DIMS = 4
FINAL = 1
OVERFLOW = 2
PREPOSTED = 4
PLACEHOLDER = 8
BUNDLE = 16
_FLAGS = FINAL | OVERFLOW | PREPOSTED | PLACEHOLDER | BUNDLE
_FIXED_FIELDS = 4
_FIELDS_PER_TENSOR = 2 + MAX_DIMS
HEADER_LEN = _FIXED_FIELDS + MAX_TENSORS * _FIELDS_PER_TENSOR
HEADER_BYTES = 8 * HEADER_LEN
# A decision of a few hundred decode rows, or a 512-token prefill chunk,
# fits inline; a longer one overflows and pays one more round trip.
HEAD_BYTES = 8192
INLINE_BYTES = HEAD_BYTES - HEADER_BYTES
_HEADER = struct.Struct(f"<{HEADER_LEN}q")

# Code 0 marks an unused tensor field; codes are part of the wire format.
DTYPE_CODES: Mapping[torch.dtype, int] = types.MappingProxyType(
    {
        torch.float32: 1,
        torch.bfloat16: 2,
        torch.float16: 3,
        torch.int64: 4,
        torch.int32: 5,
        torch.uint8: 6,
    }
)
_DTYPES_BY_CODE: Mapping[int, torch.dtype] = types.MappingProxyType(
    {code: dt for dt, code in DTYPE_CODES.items()}
)

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Message)
_BUNDLE_DECODER = msgspec.msgpack.Decoder(list[Message])


class FrameError(ValueError):
    """A frame that cannot be built or read: bad header, unknown dtype, too
    many tensors or dimensions, or a payload that is not a ring message."""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Dtype and shape of one tensor announced by a header."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorSpec:
        return cls(t.dtype, tuple(t.shape))

    def empty(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype)


@dataclass(frozen=True, slots=True)
class FrameHeader:
    """What a received header announces."""

    flags: int
    payload_len: int
    tensors: tuple[TensorSpec, ...]

    @property
    def final(self) -> bool:
        return bool(self.flags & FINAL)

    @property
    def overflow(self) -> bool:
        return bool(self.flags & OVERFLOW)

    @property
    def preposted(self) -> bool:
        return bool(self.flags & PREPOSTED)

    @property
    def placeholder(self) -> bool:
        return bool(self.flags & PLACEHOLDER)

    @property
    def bundle(self) -> bool:
        return bool(self.flags & BUNDLE)


@dataclass(frozen=True, slots=True)
class Frame:
    """The buffers of one frame: `head`, then `payload` when it overflowed,
    then `tensors` (on the tensor tag when the frame is preposted)."""

    head: torch.Tensor
    payload: torch.Tensor | None
    tensors: tuple[torch.Tensor, ...]
    flags: int

    @property
    def buffers(self) -> list[torch.Tensor]:
        extra = [] if self.payload is None else [self.payload]
        return [self.head, *extra, *self.tensors]


def is_final(msg: Message) -> bool:
    """Whether `msg` ends its link: nothing may be sent on a link after it."""
    return isinstance(msg, Control) and msg.kind is ControlKind.SHUTDOWN


def encode(msg: Message) -> bytes:
    """msgpack bytes of one ring message (its `kind` tag included)."""
    return _ENCODER.encode(msg)


def decode(payload: bytes | bytearray | memoryview) -> Message:
    """The ring message in `payload`; FrameError if it is not one."""
    try:
        return _DECODER.decode(payload)
    except msgspec.DecodeError as exc:
        raise FrameError(f"payload is not a ring message: {exc}") from exc


def decode_bundle(payload: bytes | bytearray | memoryview) -> list[Message]:
    """The messages of a `BUNDLE` frame's payload, in the order they were
    sent; FrameError if it is not a non-empty array of ring messages."""
    try:
        msgs = _BUNDLE_DECODER.decode(payload)
    except msgspec.DecodeError as exc:
        raise FrameError(f"payload is not an array of ring messages: {exc}") from exc
    if not msgs:
        raise FrameError("a bundle frame carries no message")
    return msgs


def frame(
    msg: Message,
    tensors: Sequence[torch.Tensor] = (),
    flags: int = 0,
    ahead: Sequence[Message] = (),
) -> Frame:
    """The frame of `msg` and its `tensors` (each made contiguous), with the
    messages `ahead` (tensorless, none final) travelling before it in the
    same payload; `flags` may add `PREPOSTED` and `PLACEHOLDER`, the rest
    follow from the messages. The caller must keep every buffer alive until
    its send has completed."""
    if flags & ~(PREPOSTED | PLACEHOLDER):
        raise ValueError(f"frame flags {flags:#x} are not the caller's to set")
    body = tuple(_checked(t) for t in tensors)
    if body and is_final(msg):
        raise FrameError("the final frame of a link carries no tensors")
    if any(is_final(m) for m in ahead):
        raise FrameError("nothing travels after the final message of a link")
    if len(body) > MAX_TENSORS:
        raise FrameError(f"a frame carries at most {MAX_TENSORS} tensors, got {len(body)}")
    raw = bytearray(HEAD_BYTES)
    if ahead:
        _ENCODER.encode_into([*ahead, msg], raw, HEADER_BYTES)  # truncates raw
        flags |= BUNDLE
    else:
        _ENCODER.encode_into(msg, raw, HEADER_BYTES)  # truncates raw to the payload's end
    payload_len = len(raw) - HEADER_BYTES
    payload = None
    if payload_len > INLINE_BYTES:
        payload = torch.frombuffer(raw[HEADER_BYTES:], dtype=torch.uint8)
        raw, flags = bytearray(HEAD_BYTES), flags | OVERFLOW
    else:
        raw.extend(bytes(HEAD_BYTES - len(raw)))
    flags |= FINAL if is_final(msg) else 0
    _HEADER.pack_into(raw, 0, *_header_fields(flags, payload_len, body))
    return Frame(torch.frombuffer(raw, dtype=torch.uint8), payload, body, flags)


def _header_fields(flags: int, payload_len: int, tensors: Sequence[torch.Tensor]) -> list[int]:
    fields = [MAGIC, flags, payload_len, len(tensors)]
    for t in tensors:
        fields += [DTYPE_CODES[t.dtype], t.dim(), *t.shape]
        fields += [0] * (MAX_DIMS - t.dim())
    fields += [0] * (HEADER_LEN - len(fields))
    return fields


def empty_head() -> torch.Tensor:
    """A buffer to receive one head into."""
    return torch.empty(HEAD_BYTES, dtype=torch.uint8)


def head_view(head: torch.Tensor) -> memoryview:
    """The bytes of a head buffer, for `unpack_header` and `inline_payload`
    (a reader makes one per buffer, once)."""
    return memoryview(head.numpy())


def unpack_header(head: torch.Tensor | memoryview) -> FrameHeader:
    """What a received head (or its `head_view`) announces; FrameError if it
    is not a head."""
    view = head if isinstance(head, memoryview) else head_view(head)
    fields = _HEADER.unpack_from(view)
    magic, flags, payload_len, count = fields[:_FIXED_FIELDS]
    if magic != MAGIC:
        raise FrameError(f"header magic {magic:#x} is not {MAGIC:#x}: the stream is out of step")
    if flags & ~_FLAGS or (flags & PLACEHOLDER and not flags & PREPOSTED):
        raise FrameError(f"header flags {flags:#x} are not a frame's")
    if not 0 <= count <= MAX_TENSORS or payload_len <= 0:
        raise FrameError(f"header announces {count} tensors and a {payload_len}-byte payload")
    if (payload_len > INLINE_BYTES) != bool(flags & OVERFLOW):
        raise FrameError(f"a {payload_len}-byte payload with flags {flags:#x}")
    specs = []
    for i in range(count):
        at = _FIXED_FIELDS + i * _FIELDS_PER_TENSOR
        code, ndim = fields[at], fields[at + 1]
        if code not in _DTYPES_BY_CODE or not 0 <= ndim <= MAX_DIMS:
            raise FrameError(f"header tensor {i} has dtype code {code} and {ndim} dims")
        specs.append(TensorSpec(_DTYPES_BY_CODE[code], fields[at + 2 : at + 2 + ndim]))
    return FrameHeader(flags, payload_len, tuple(specs))


def inline_payload(head: torch.Tensor | memoryview, announced: FrameHeader) -> memoryview:
    """The payload a head (or its `head_view`) carries inline (not for an
    overflowed frame)."""
    view = head if isinstance(head, memoryview) else head_view(head)
    return view[HEADER_BYTES : HEADER_BYTES + announced.payload_len]


def _checked(t: torch.Tensor) -> torch.Tensor:
    if t.dtype not in DTYPE_CODES:
        names = ", ".join(str(dt) for dt in DTYPE_CODES)
        raise FrameError(f"dtype {t.dtype} cannot travel on the ring (supported: {names})")
    if t.dim() > MAX_DIMS:
        raise FrameError(f"a ring tensor has at most {MAX_DIMS} dims, got shape {tuple(t.shape)}")
    if t.device.type != "cpu":
        raise FrameError(f"ring tensors travel from the CPU; move this {t.device} tensor first")
    if t.is_contiguous() and not t.requires_grad:
        return t  # as the usual hidden state is: no op to run
    return t.detach().contiguous()
