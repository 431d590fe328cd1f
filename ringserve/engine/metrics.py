"""What rank 0 counts for /metrics, counted where the events happen: the
desk's request and token counts and latency histograms (`Metrics`), and the
running totals every rank reports round the ring in heartbeats
(`RankReports`). Plain numbers, cheap to bump on the hot path; the HTTP
layer exports them through prometheus-client (`http/prometheus.py`), which
is where a new metric is named.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from dataclasses import dataclass, field

from ringserve.ring.messages import RankStats

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
REQUEST_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TOKEN_BUCKETS = tuple(m * 10**k for k in range(6) for m in (1, 2, 5))  # vLLM's 1, 2, 5 series


@dataclass(slots=True)
class Histogram:
    """Bucketed observations. Invariant: counts[i] counts observations
    <= buckets[i] (and > buckets[i-1]); the last count is beyond the last
    bucket."""

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

    def cumulative(self) -> list[tuple[str, int]]:
        """(upper bound, observations <= it) per bucket, `+Inf` last: the
        shape Prometheus histograms are exposed in."""
        out, running = [], 0
        for bound, count in zip(self.buckets, self.counts, strict=False):
            running += count
            out.append((repr(float(bound)), running))
        return [*out, ("+Inf", self.n)]


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
    e2e: Histogram = field(default_factory=lambda: Histogram(REQUEST_BUCKETS_S))
    prompt_lens: Histogram = field(default_factory=lambda: Histogram(TOKEN_BUCKETS))
    output_lens: Histogram = field(default_factory=lambda: Histogram(TOKEN_BUCKETS))
    finished: Counter[str] = field(default_factory=Counter)  # by finish reason: stop, length, ...


class RankReports:
    """The latest running totals each rank sent round the ring, and when
    they came. Invariant: holds at most one report per rank, the newest."""

    def __init__(self) -> None:
        self._latest: dict[int, tuple[RankStats, float]] = {}

    def update(self, stats: list[RankStats]) -> None:
        now = time.monotonic()
        for s in stats:
            self._latest[s.rank] = (s, now)

    def latest(self) -> list[tuple[RankStats, float]]:
        """(report, its age in seconds) per rank, in rank order."""
        now = time.monotonic()
        return [(s, now - at) for _, (s, at) in sorted(self._latest.items())]
