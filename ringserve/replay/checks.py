"""The consistency checks over a run's logs (DESIGN §7): every rank applied
every pass in order with rank 0's digest, every message sent on a link was
received on it, and every pass has exactly one terminal."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import msgspec

from ringserve.replay.report import Finding
from ringserve.replay.trace import Event, Trace
from ringserve.ring.messages import Decision

MessageKey = tuple[str, int | None, str | None, int | None]
TERMINAL_KINDS = ("output", "void")


@dataclass(frozen=True, slots=True)
class Terminals:
    """Terminals rank 0 received, by pass: what the other checks lean on."""

    made: dict[int, str]  # pass id -> digest rank 0 recorded
    received: dict[int, list[str]]  # pass id -> kinds of its terminals

    @property
    def finished(self) -> set[int]:
        return {p for p, kinds in self.received.items() if kinds}


def terminals(trace: Trace) -> Terminals:
    made = {e["pass_id"]: e.get("digest", "") for e in trace.events(0, "decision.made")}
    received: dict[int, list[str]] = {}
    if trace.world > 1:
        for e in trace.events(0, "msg.received"):
            if e.get("kind") in TERMINAL_KINDS and e.get("peer") == trace.last_rank:
                received.setdefault(e["pass_id"], []).append(e["kind"])
    else:  # one rank: the terminal is applied where it is made
        for e in trace.events(0, "pass.output", "pass.void"):
            received.setdefault(e["pass_id"], []).append(e["event"].removeprefix("pass."))
    return Terminals(made, received)


def check_terminals(t: Terminals) -> list[Finding]:
    found = []
    for p in sorted(t.made):
        kinds = t.received.get(p, [])
        if not kinds:
            found.append(_terminal("terminal.missing", f"pass {p} has no terminal", p))
        elif len(kinds) > 1:
            message = f"pass {p} has {len(kinds)} terminals ({', '.join(kinds)})"
            found.append(_terminal("terminal.extra", message, p))
    for p in sorted(set(t.received) - set(t.made)):
        found.append(_terminal("terminal.stray", f"a terminal came for pass {p}, never made", p))
    return found


def _terminal(kind: str, message: str, p: int) -> Finding:
    return Finding("terminals", kind, message, rank=0, pass_id=p)


def check_decisions(trace: Trace, t: Terminals) -> list[Finding]:
    found = _check_made(trace)
    for rank in range(trace.world):
        if rank in trace.ranks:
            found += _check_applied(rank, trace.events(rank, "decision.applied"), t)
    return found


def _check_made(trace: Trace) -> list[Finding]:
    """Rank 0's own record: consecutive pass ids, content matching digest."""
    found = []
    for i, e in enumerate(trace.events(0, "decision.made")):
        p = e["pass_id"]
        if p != i:
            message = f"rank 0 made pass {p} as its decision number {i}"
            found.append(Finding("decisions", "decision.bad_sequence", message, 0, p))
        content = e.get("decision")
        if content is not None and _digest(content) != e.get("digest"):
            message = f"rank 0's record of pass {p} does not match its digest"
            found.append(Finding("decisions", "decision.content_mismatch", message, 0, p))
    return found


def _digest(content: object) -> str | None:
    try:
        return msgspec.convert(content, Decision).digest()
    except msgspec.ValidationError:
        return None


def _check_applied(rank: int, applied: list[Event], t: Terminals) -> list[Finding]:
    found, previous = [], -1
    for e in applied:
        p = e["pass_id"]
        if p not in t.made:
            message = f"rank {rank} applied pass {p}, which rank 0 never made"
            found.append(Finding("decisions", "decision.unknown_pass", message, rank, p))
            continue
        if p <= previous:
            message = f"rank {rank} applied pass {p} after pass {previous}"
            found.append(Finding("decisions", "decision.out_of_order", message, rank, p))
        if e.get("digest") != t.made[p]:
            message = (
                f"rank {rank} applied pass {p} with digest {e.get('digest')}, "
                f"rank 0 made {t.made[p]}"
            )
            found.append(Finding("decisions", "decision.digest_mismatch", message, rank, p))
        previous = max(previous, p)
    seen = {e["pass_id"] for e in applied}
    for p in sorted((t.finished & set(t.made)) - seen):  # unfinished: the wedge explains
        message = f"rank {rank} never applied pass {p}, which finished"
        found.append(Finding("decisions", "decision.not_applied", message, rank, p))
    return found


def message_key(e: Event) -> MessageKey:
    return (e.get("kind", "?"), e.get("pass_id"), e.get("control"), e.get("seq"))


def describe_key(key: MessageKey) -> str:
    kind, p, control, seq = key
    if control is not None:
        return f"control {control}" + (f" #{seq}" if seq else "")
    return f"{kind} of pass {p}"


def check_messages(trace: Trace) -> tuple[list[Finding], int]:
    """Findings for every link of the ring, and the number of sends seen."""
    found, total = [], 0
    if trace.world < 2:
        return found, total
    for src in range(trace.world):
        dst = (src + 1) % trace.world
        sent = [e for e in trace.events(src, "msg.sent") if e.get("peer") == dst]
        got = [e for e in trace.events(dst, "msg.received") if e.get("peer") == src]
        total += len(sent)
        found += _check_link(src, dst, sent, got)
    return found, total


def _check_link(src: int, dst: int, sent: list[Event], got: list[Event]) -> list[Finding]:
    s_keys, g_keys = [message_key(e) for e in sent], [message_key(e) for e in got]
    s_count, g_count = Counter(s_keys), Counter(g_keys)
    found = []
    for key, n in sorted((s_count - g_count).items(), key=_order):
        message = f"rank {src} sent {describe_key(key)} to rank {dst}, never received"
        found += [Finding("messages", "message.unmatched_send", message, src, key[1])] * n
    for key, n in sorted((g_count - s_count).items(), key=_order):
        message = f"rank {dst} received {describe_key(key)} from rank {src}, never sent"
        found += [Finding("messages", "message.unmatched_receive", message, dst, key[1])] * n
    both = s_count & g_count
    s_seq, g_seq = _only(s_keys, both), _only(g_keys, both)
    at = next((i for i, (a, b) in enumerate(zip(s_seq, g_seq, strict=True)) if a != b), None)
    if at is not None:
        message = (
            f"link {src}->{dst} is out of order: message {at} sent was {describe_key(s_seq[at])}, "
            f"received was {describe_key(g_seq[at])}"
        )
        found.append(Finding("messages", "message.out_of_order", message, dst, s_seq[at][1]))
    return found + _check_bytes(src, dst, sent, got)


def _only(keys: list[MessageKey], allowed: Counter[MessageKey]) -> list[MessageKey]:
    left, kept = Counter(allowed), []
    for key in keys:
        if left[key] > 0:
            left[key] -= 1
            kept.append(key)
    return kept


def _check_bytes(src: int, dst: int, sent: list[Event], got: list[Event]) -> list[Finding]:
    sizes = {message_key(e): e.get("bytes") for e in sent}
    found = []
    for e in got:
        key = message_key(e)
        if key in sizes and sizes[key] != e.get("bytes"):
            message = (
                f"{describe_key(key)} left rank {src} as {sizes[key]} bytes and reached "
                f"rank {dst} as {e.get('bytes')}"
            )
            found.append(Finding("messages", "message.bytes_mismatch", message, dst, key[1]))
    return found


def _order(item: tuple[MessageKey, int]) -> tuple[int, str]:
    key = item[0]
    return (key[1] if key[1] is not None else -1, str(key))
