"""Re-running rank 0's scheduler from its log (DESIGN §7): a fresh
`Scheduler` with the recorded config, over a real `SlotAllocator` and
`RadixCache`, is fed the recorded arrivals, terminals and aborts in the
recorded order, and every recorded `schedule()` call is repeated; each
decision must come out with the recorded digest, each empty call empty."""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from ringserve import logs
from ringserve.cache.allocator import SlotAllocator
from ringserve.cache.tiers import prefix_cache
from ringserve.params import SamplingParams
from ringserve.replay.report import Finding, RerunSummary
from ringserve.replay.trace import Event, Trace
from ringserve.ring.messages import Output, Void
from ringserve.sched.request import Request, sampling_spec
from ringserve.sched.scheduler import Scheduler, SchedulerConfig

INPUTS = (
    "request.arrival",
    "decision.made",
    "decision.none",
    "pass.output",
    "pass.void",
    "request.abort",
    "spec.offer",
)


class _Rerun:
    """Invariant: `scheduler` has seen exactly the inputs replayed so far,
    and `summary` counts them."""

    def __init__(self, config: Event) -> None:
        allocator = SlotAllocator(int(config["kv_capacity"]))
        sched_config = msgspec.convert(config["config"], SchedulerConfig)
        cache = prefix_cache(allocator, int(config.get("host_kv_capacity", 0)))
        self.scheduler = Scheduler(sched_config, allocator, cache)
        self.eos_ids = frozenset(config.get("eos_ids", ()))
        self.summary = RerunSummary()
        self.steps: dict[str, Callable[[Event], str | None]] = {
            "request.arrival": self._arrival,
            "decision.made": self._made,
            "decision.none": self._none,
            "pass.output": self._output,
            "pass.void": self._void,
            "request.abort": self._abort,
            "spec.offer": self._offer,
        }

    def _arrival(self, e: Event) -> None:
        params = msgspec.convert(e["params"], SamplingParams, str_keys=True)
        spec = sampling_spec(params, len(e["prompt"]), self.eos_ids, list(e["prompt"]))
        spec = msgspec.structs.replace(spec, seed=e["seed"])
        req = Request(e["req_id"], list(e["prompt"]), params, spec, self.eos_ids)
        self.scheduler.add(req)
        self.summary.arrivals += 1

    def _made(self, e: Event) -> str | None:
        p = e["pass_id"]
        decision = self.scheduler.schedule()
        self.summary.decisions += 1
        if decision is None:
            return f"pass {p}: rank 0 decided it, the re-run decided nothing"
        if decision.digest() != e.get("digest"):
            where = _first_difference(msgspec.to_builtins(decision), e.get("decision"))
            return (
                f"pass {p}: the re-run decided differently (digest {decision.digest()}, "
                f"recorded {e.get('digest')}); first difference at {where}"
            )
        return None

    def _none(self, e: Event) -> str | None:
        decision = self.scheduler.schedule()
        self.summary.empty_schedules += 1
        if decision is not None:
            return (
                f"the re-run decided pass {decision.pass_id} where rank 0 decided nothing "
                f"(next pass was {e.get('next_pass_id')})"
            )
        return None

    def _output(self, e: Event) -> None:
        out = Output(
            e["pass_id"],
            list(e["tokens"]),
            fallbacks=e.get("fallbacks", 0),
            accepted=e.get("accepted"),
        )
        self.scheduler.on_output(out)
        self.summary.terminals += 1

    def _void(self, e: Event) -> None:
        self.scheduler.on_void(Void(e["pass_id"], e["void_rank"], e["reason"]))
        self.summary.terminals += 1

    def _offer(self, e: Event) -> None:
        self.scheduler.speculation.offer(e["req_id"], e["at"], list(e["tokens"]))

    def _abort(self, e: Event) -> None:
        self.scheduler.abort(e["req_id"], e["reason"])
        self.summary.aborts += 1


def rerun_scheduler(trace: Trace) -> tuple[RerunSummary, list[Finding]]:
    """Replay rank 0's recorded inputs into a fresh scheduler; stops at the
    first difference (the states have diverged past it)."""
    config = trace.first(0, "scheduler.config")
    if config is None:
        message = "rank 0's log has no scheduler.config: nothing to re-run"
        return RerunSummary(), [Finding("rerun", "rerun.no_config", message, rank=0)]
    with logs.silenced():  # the re-run's own events are not the run's
        return _replay_inputs(_Rerun(config), trace.events(0, *INPUTS))


def _replay_inputs(run: _Rerun, inputs: list[Event]) -> tuple[RerunSummary, list[Finding]]:
    for e in inputs:
        try:
            problem = run.steps[e["event"]](e)
        except (KeyError, ValueError, TypeError, msgspec.ValidationError) as exc:
            problem = f"replaying {e['event']} failed: {type(exc).__name__}: {exc}"
            return run.summary, [Finding("rerun", "rerun.error", problem, 0, e.get("pass_id"))]
        if problem is not None:
            return run.summary, [Finding("rerun", "rerun.differs", problem, 0, e.get("pass_id"))]
    run.summary.reproduced = True
    return run.summary, []


def _first_difference(ours: object, recorded: object, at: str = "decision") -> str:
    """The path of the first field where two decisions (as builtins) differ."""
    if recorded is None:
        return f"{at} (not recorded)"
    if isinstance(ours, dict) and isinstance(recorded, dict):
        for key in [*ours, *(k for k in recorded if k not in ours)]:
            if ours.get(key) != recorded.get(key):
                return _first_difference(ours.get(key), recorded.get(key), f"{at}.{key}")
    if isinstance(ours, list) and isinstance(recorded, list) and len(ours) == len(recorded):
        for i, (a, b) in enumerate(zip(ours, recorded, strict=True)):
            if a != b:
                return _first_difference(a, b, f"{at}[{i}]")
    return f"{at}: re-run {_short(ours)}, recorded {_short(recorded)}"


def _short(value: object, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
