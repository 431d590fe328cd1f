"""Injected faults, for tests and drills: `RINGSERVE_FAULTS` holds
comma-separated rules, each `action:key=value:...`:

* `void:rank=R:every=K`   rank R declares every K-th pass void (pass ids
  K-1, 2K-1, ... since ids count from 0), as if its forward had failed;
* `drop:rank=R:kind=hidden:pass=P`   rank R does not send that message
  (`kind` is a message tag: decision, hidden, output, void, control);
* `crash:rank=R:pass=P`   rank R exits abruptly (os._exit) at pass P;
* `fail:rank=R:req=N`   rank R cannot run any pass that carries request N
  (request ids count from 0 on rank 0), as if that request's own input broke
  the forward;
* `slow:rank=R:ms=M`   rank R sleeps M ms per forward;
* `slow:rank=R:ms_per_layer=M`   rank R sleeps M ms per layer it holds per
  forward, so it looks M ms per layer slower (the planner's speeds).

Every rule is validated when parsed, whichever rank it names, so a typo fails
every rank at start-up instead of silently injecting nothing. Faults are
wrapped around a rank's parts, never written into its loops: `drop` around
its send link (`FaultPlan.wrap`, `FaultySend`), the others around its stage
(`engine/stage.FaultyStage`). A rank with no rules runs the bare parts.
"""

from __future__ import annotations

import os
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import structlog
import torch

from ringserve import logs
from ringserve.ring.messages import MESSAGE_TYPES, Message
from ringserve.ring.send_link import SendLink

log = structlog.get_logger(__name__)

ENV_VAR = "RINGSERVE_FAULTS"

_KEYS: dict[str, tuple[str, ...]] = {
    "void": ("rank", "every"),
    "drop": ("rank", "kind", "pass"),
    "crash": ("rank", "pass"),
    "slow": ("rank", "ms", "ms_per_layer"),
    "fail": ("rank", "req"),
}
_ONE_OF = {"slow": ("ms", "ms_per_layer")}  # exactly one of these, not all
_MINIMUM = {"rank": 0, "every": 1, "pass": 0, "ms": 0, "ms_per_layer": 0, "req": 0}
_KINDS: dict[str, type[Message]] = {t.__struct_config__.tag: t for t in MESSAGE_TYPES}


@dataclass(frozen=True, slots=True)
class FaultRule:
    """One parsed rule; `fields` holds its integer keys (all but `kind`)."""

    action: str
    rank: int
    fields: Mapping[str, int]
    kind: type[Message] | None = None


def parse_rules(spec: str) -> tuple[FaultRule, ...]:
    """Every rule of a `RINGSERVE_FAULTS` value; ValueError naming the rule
    and what is wrong with it."""
    return tuple(_parse_rule(text.strip()) for text in spec.split(",") if text.strip())


def never_fire(spec: str, world: int) -> list[str]:
    """Why each rule of `spec` (already valid) can never act on a ring of
    `world` ranks: a rank that is not there, or a message its rank never
    sends (a drill that would silently inject nothing)."""
    said = []
    for text in (t.strip() for t in spec.split(",")):
        if not text:
            continue
        rule = _parse_rule(text)
        if rule.rank >= world:
            said.append(f"{text}: a ring of {world} ranks has no rank {rule.rank}")
        elif rule.kind is not None:
            tag = rule.kind.__struct_config__.tag
            sent = _SENT_BY_LAST if rule.rank == world - 1 else _SENT_BEFORE_LAST
            if world == 1:
                said.append(f"{text}: a ring of one rank sends no messages")
            elif tag not in sent:
                where = "the last rank" if rule.rank == world - 1 else f"rank {rule.rank}"
                said.append(f"{text}: {where} sends no {tag} (it sends {', '.join(sent)})")
    return said


_SENT_BY_LAST = ("output", "void", "control")  # terminals to rank 0, controls on round
_SENT_BEFORE_LAST = ("decision", "hidden", "control")


def _parse_rule(text: str) -> FaultRule:
    action, *pairs = text.split(":")
    if action not in _KEYS:
        raise ValueError(
            f"fault rule {text!r}: unknown action {action!r} (one of {', '.join(_KEYS)})"
        )
    values: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in _KEYS[action] or key in values:
            allowed = ", ".join(_KEYS[action])
            raise ValueError(
                f"fault rule {text!r}: bad field {pair!r} (a {action} rule takes {allowed}, once each)"
            )
        values[key] = value
    either = _ONE_OF.get(action, ())
    missing = [key for key in _KEYS[action] if key not in values and key not in either]
    if either and sum(key in values for key in either) != 1:
        missing.append(" or ".join(either))
    if missing:
        raise ValueError(f"fault rule {text!r}: missing {', '.join(missing)}")
    kind = None
    if "kind" in values:
        kind = _KINDS.get(values.pop("kind"))
        if kind is None:
            raise ValueError(f"fault rule {text!r}: kind must be one of {', '.join(_KINDS)}")
    ints = {key: _integer(text, key, value) for key, value in values.items()}
    rank = ints.pop("rank")
    return FaultRule(action, rank, types.MappingProxyType(ints), kind)


def _integer(text: str, key: str, value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"fault rule {text!r}: {key} must be an integer, got {value!r}") from None
    if number < _MINIMUM[key]:
        raise ValueError(
            f"fault rule {text!r}: {key} must be at least {_MINIMUM[key]}, got {number}"
        )
    return number


@dataclass(frozen=True, slots=True)
class FaultPlan:
    """The faults one rank injects. Invariant: built only from validated
    rules; an empty plan injects nothing."""

    rank: int
    void_every: frozenset[int] = field(default_factory=frozenset)
    drops: frozenset[tuple[type[Message], int]] = field(default_factory=frozenset)
    crash_passes: frozenset[int] = field(default_factory=frozenset)
    fail_requests: frozenset[int] = field(default_factory=frozenset)
    slow_ms: int = 0
    slow_ms_per_layer: int = 0
    # Some rank of the ring drops messages: then no link announces tensors
    # ahead (ring/announce.py), so a dropped Hidden leaves its receiver
    # waiting, the wedge the drill is for, on every rank alike.
    ring_drops: bool = False

    @classmethod
    def parse(cls, spec: str, rank: int) -> FaultPlan:
        """The plan of `rank` from a `RINGSERVE_FAULTS` value."""
        rules = parse_rules(spec)
        mine = [rule for rule in rules if rule.rank == rank]
        slow = [rule.fields for rule in mine if rule.action == "slow"]
        if len(slow) > 1:
            raise ValueError(f"fault rules give rank {rank} {len(slow)} slow rules; give it one")
        return cls(
            rank=rank,
            void_every=frozenset(r.fields["every"] for r in mine if r.action == "void"),
            drops=frozenset((r.kind, r.fields["pass"]) for r in mine if r.action == "drop"),
            crash_passes=frozenset(r.fields["pass"] for r in mine if r.action == "crash"),
            fail_requests=frozenset(r.fields["req"] for r in mine if r.action == "fail"),
            slow_ms=slow[0].get("ms", 0) if slow else 0,
            slow_ms_per_layer=slow[0].get("ms_per_layer", 0) if slow else 0,
            ring_drops=any(r.action == "drop" for r in rules),
        )

    @classmethod
    def from_env(cls, rank: int, environ: Mapping[str, str] | None = None) -> FaultPlan:
        env = os.environ if environ is None else environ
        return cls.parse(env.get(ENV_VAR, ""), rank)

    @property
    def empty(self) -> bool:
        return not (self.drops or self.touches_stage)

    @property
    def touches_stage(self) -> bool:
        """Whether any rule acts on the stage (all but drops, which act on the link)."""
        slow = self.slow_ms or self.slow_ms_per_layer
        return bool(self.void_every or self.crash_passes or self.fail_requests or slow)

    def slow_s(self, layers: int) -> float:
        """Seconds a forward over `layers` layers sleeps (0: no slow rule)."""
        return (self.slow_ms + self.slow_ms_per_layer * layers) / 1e3

    def should_void(self, pass_id: int) -> bool:
        return any((pass_id + 1) % every == 0 for every in self.void_every)

    def should_drop(self, kind: type[Message], pass_id: int) -> bool:
        return (kind, pass_id) in self.drops

    def should_crash(self, pass_id: int) -> bool:
        return pass_id in self.crash_passes

    def crash_now(self, pass_id: int) -> None:
        """End the process abruptly at `pass_id` if a crash rule says so, with
        the log flushed first (what a killed rank would leave behind)."""
        if pass_id in self.crash_passes:
            log.error("fault.crash", rank=self.rank, pass_id=pass_id)
            logs.flush()
            os._exit(17)

    def wrap(self, send: SendLink) -> SendLink | FaultySend:
        """`send` with this plan's drops applied, or `send` itself if none."""
        return FaultySend(send, self) if self.drops else send


class FaultySend:
    """A send link that silently loses the messages a `drop` rule names and
    passes every other call through to the real link."""

    def __init__(self, link: SendLink, plan: FaultPlan) -> None:
        self.link, self.plan = link, plan

    async def send(
        self, msg: Message, tensors: Sequence[torch.Tensor] = (), *, hold: bool = False
    ) -> None:
        pass_id = getattr(msg, "pass_id", None)
        if pass_id is not None and self.plan.should_drop(type(msg), pass_id):
            log.warning("fault.drop", rank=self.plan.rank, pass_id=pass_id, kind=type(msg).__name__)
            return
        await self.link.send(msg, tensors, hold=hold)

    def __getattr__(self, name: str):  # close, flush, in_flight, error, peer
        return getattr(self.link, name)
