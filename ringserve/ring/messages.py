"""Typed messages of the ring. Every message is a tagged `msgspec.Struct`.

Decisions flow 0 -> 1 -> ... -> last, each followed by exactly one `Hidden`
per pass from every rank to its successor; the last rank answers rank 0 with
exactly one terminal per pass, `Output` or `Void`. Tensors travel beside the
payload (see `ring/codec.py`), never inside it, and nothing is pickled.
"""

from __future__ import annotations

import enum
import hashlib

import msgspec


class SamplingSpec(msgspec.Struct, frozen=True, kw_only=True):
    """The sampling parameters the last rank needs for one request."""

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    logprobs: int | None = None
    # Logits processing (engine/logits.py); the defaults change nothing.
    # `prompt_len` tells the output apart from the prompt in a row's tokens;
    # `min_tokens_banned` are the ids (EOS, stop ids) banned while fewer than
    # `min_tokens` tokens were generated.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: list[tuple[int, float]] | None = None
    min_tokens: int = 0
    min_tokens_banned: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[list[int]] | None = None
    prompt_len: int = 0
    # Prompt logprobs (engine/prompt_logprobs.py): the top `prompt_logprobs`
    # of every prompt position, and the prompt they are judged against.
    prompt_logprobs: int | None = None
    prompt_token_ids: list[int] | None = None

    @property
    def needs_history(self) -> bool:
        """Whether the sampling rank needs the row's tokens, not just its length."""
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
            or self.bad_words is not None
        )


class NewRequest(msgspec.Struct, frozen=True):
    """A request entering the replicated request table (or re-entering it
    after a retraction: an upsert). `history` is given when the sampling
    needs the row's tokens: those of the reused prefix, which its entries do
    not carry (later entries extend it as they extend the slots)."""

    req_id: int
    sampling: SamplingSpec
    history: list[int] | None = None


class Entry(msgspec.Struct, frozen=True):
    """One request's share of a pass: it extends its context from `start`
    by `tokens`, written at `slots`.

    Self-describing so a replica never has to remember a rolled-back pass:
    when `reuse` is given the row becomes `reuse` (a cached prefix, `start`
    slots long), otherwise the row is cut to `start` slots; then `slots` are
    appended. `sample` says whether the last token's logits are sampled;
    `masked` that they are sampled under a grammar mask, which rank 0 fills
    and the pass's Hidden carries beside the hidden states (one packed row
    per masked entry, in entry order).

    A verification row ends in `draft` speculative tokens (`tokens` is then
    [last token, p1..pk] for a decode step): the last `draft + 1` positions
    are all sampled, and the Output says how many tokens the row yields. A
    masked row never carries speculative tokens."""

    req_id: int
    start: int
    tokens: list[int]
    slots: list[int]
    sample: bool
    reuse: list[int] | None = None
    masked: bool = False
    draft: int = 0


class TierCopy(msgspec.Struct, frozen=True):
    """KV of one radix node copied between a rank's tiers: its rows at slots
    `src` to slots `dst` (device to host for a spill, host to device for a
    load), on every layer the rank holds."""

    src: list[int]
    dst: list[int]


class Decision(msgspec.Struct, frozen=True, tag="decision", omit_defaults=True):
    """One pass. Every rank copies `spills` (device to host), then `loads`
    (host to device), in list order, before the pass's forward: a spill's
    device slots may be written by the same pass, and a load reads host
    slots no spill of the pass writes. Fields with defaults are left off
    the wire when empty, so a pass without them keeps its digest."""

    pass_id: int
    mb_slot: int
    new_requests: list[NewRequest]
    entries: list[Entry]
    dropped: list[int]
    spills: list[TierCopy] = []
    loads: list[TierCopy] = []

    def digest(self) -> str:
        """A stable fingerprint, so logs of different ranks can be compared."""
        return hashlib.blake2b(msgspec.msgpack.encode(self), digest_size=8).hexdigest()


class Hidden(msgspec.Struct, frozen=True, tag="hidden"):
    """Hidden states of one pass (one tensor beside the payload), or, when
    `void` is set, the marker that the pass ran nowhere past `void_rank`."""

    pass_id: int
    void: str | None = None
    void_rank: int | None = None


class TopLogprobs(msgspec.Struct, frozen=True):
    token_ids: list[int]
    logprobs: list[float]


class PromptLogprobs(msgspec.Struct, frozen=True):
    """One entry's prompt logprobs: for prompt tokens `start`, `start + 1`,
    ... the logprob of the token itself (`logprobs`) and of the most likely
    ones at its position (`top`), judged on the logits of the position
    before it."""

    req_id: int
    start: int
    logprobs: list[float]
    top: list[TopLogprobs]


class Output(msgspec.Struct, frozen=True, tag="output"):
    """Sampled tokens of one pass, in entry order: one per sampled entry, or,
    when `accepted` is given, `accepted[i]` tokens for the i-th sampled entry
    (the verified prefix of its speculative tokens and one more token);
    `logprobs` and `top_logprobs` follow `tokens`. `prompt_logprobs` holds
    one record per entry that asks for them and computed prompt positions,
    in entry order."""

    pass_id: int
    tokens: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[TopLogprobs] | None = None
    fallbacks: int = 0
    accepted: list[int] | None = None
    prompt_logprobs: list[PromptLogprobs] | None = None


class Void(msgspec.Struct, frozen=True, tag="void"):
    """Terminal of a pass that could not run on `rank`."""

    pass_id: int
    rank: int
    reason: str


class ControlKind(enum.StrEnum):
    SHUTDOWN = "shutdown"
    HEARTBEAT = "heartbeat"
    READY = "ready"
    FAILED = "failed"  # a rank found the ring out of step: goes on to rank 0 (`RingFailed`)


class RankStats(msgspec.Struct, frozen=True):
    """One rank's running totals since it started, for rank 0's /metrics:
    passes it computed, seconds spent in them, bytes it sent on its link."""

    rank: int
    forwards: int = 0
    forward_s: float = 0.0
    sent_bytes: int = 0


class Control(msgspec.Struct, frozen=True, tag="control"):
    kind: ControlKind
    seq: int = 0
    rank: int = 0
    reason: str = ""
    stats: list[RankStats] = []  # a heartbeat gathers each rank's as it goes round


Message = Decision | Hidden | Output | Void | Control
MESSAGE_TYPES: tuple[type, ...] = (Decision, Hidden, Output, Void, Control)
# The one terminal of a pass (DESIGN §3.4). Both kinds share one inbox lane,
# because the last rank sends them in pass order on one FIFO link.
Terminal = Output | Void
TERMINAL_TYPES: tuple[type, ...] = (Output, Void)
