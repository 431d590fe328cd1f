"""Counters and histograms of rank 0, rendered as Prometheus text."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass(slots=True)
class Histogram:
    """Cumulative-bucket histogram. Invariant: counts[i] counts observations
    <= buckets[i]; the last count is the +Inf bucket."""

    buckets: tuple[float, ...] = LATENCY_BUCKETS_S
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def render(self, name: str, help_text: str) -> list[str]:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        running = 0
        for bound, count in zip(self.buckets, self.counts, strict=False):
            running += count
            lines.append(f'{name}_bucket{{le="{bound}"}} {running}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.n}')
        lines += [f"{name}_sum {self.total}", f"{name}_count {self.n}"]
        return lines


@dataclass(slots=True)
class Metrics:
    requests_total: int = 0
    requests_failed: int = 0
    requests_rejected: int = 0
    requests_timed_out: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cache_hit_tokens: int = 0
    passes: int = 0
    ttft: Histogram = field(default_factory=Histogram)
    tpot: Histogram = field(default_factory=Histogram)

    def render(
        self,
        gauges: dict[str, tuple[float, str]],
        owned: dict[str, tuple[float, str]] | None = None,
    ) -> str:
        """Prometheus text; `gauges` are point-in-time figures and `owned`
        counters kept by their owners (name -> (value, help))."""
        counters = {
            "requests_total": (self.requests_total, "requests received"),
            "requests_failed_total": (self.requests_failed, "requests that ended in an error"),
            "requests_rejected_total": (
                self.requests_rejected,
                "requests refused because the waiting queue was full",
            ),
            "requests_timed_out_total": (
                self.requests_timed_out,
                "requests failed after waiting longer than the queue timeout",
            ),
            "prompt_tokens_total": (self.prompt_tokens, "prompt tokens received"),
            "generation_tokens_total": (self.generation_tokens, "tokens generated"),
            "cache_hit_tokens_total": (
                self.cache_hit_tokens,
                "prompt tokens served from the prefix cache",
            ),
            "passes_total": (self.passes, "passes completed"),
            **(owned or {}),
        }
        lines: list[str] = []
        for name, (value, text) in counters.items():
            base = name.split("{", 1)[0]  # a labelled sample: its family is described once
            if f"# TYPE ringserve_{base} counter" not in lines:
                lines += [f"# HELP ringserve_{base} {text}", f"# TYPE ringserve_{base} counter"]
            lines.append(f"ringserve_{name} {value}")
        for name, (value, text) in gauges.items():
            lines += [f"# HELP ringserve_{name} {text}", f"# TYPE ringserve_{name} gauge"]
            lines.append(f"ringserve_{name} {value}")
        lines += self.ttft.render("ringserve_time_to_first_token_seconds", "time to first token")
        lines += self.tpot.render(
            "ringserve_time_per_output_token_seconds", "time between output tokens"
        )
        return "\n".join(lines) + "\n"
