"""`/metrics` through prometheus-client.

Each served model has its own `CollectorRegistry` (built by `registry`, kept
on the app), never the library's global one, so several servers or offline
engines in one process never collide. Nothing is copied into metric objects:
events are counted where they happen (`engine/metrics.py`, the scheduler,
the watchdog, the ranks' heartbeat reports) and one collector reads them at
scrape time, so a figure exported under two names is one count.

Two spellings are exported. Today's names, `ringserve_*`. And vLLM's
well-known names under a `ringserve:` prefix with vLLM's `model_name` label
(`ringserve:num_requests_running`, `ringserve:time_to_first_token_seconds`,
...), so a dashboard built for vLLM works once `vllm:` reads `ringserve:`.
Per-rank figures carry a `rank` label.

Adding a metric is one line in `SERIES`: `Series(name, kind, help, read)`,
where `read(conductor)` returns a number (counter, gauge), a `Histogram`, or
`{label values: number}` for a labelled series (name its `labels`). A new
count also needs its field in `engine/metrics.Metrics` and its `+= 1` where
the event happens. A counter's name ends in `_total`. Figures that exist
only in some configurations (the host KV tier's) come from their owner as
`{name: (value, help)}` and are exported as `ringserve_<name>`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from ringserve.cache.tier_figures import tier_counters, tier_gauges
from ringserve.engine.conductor import Conductor
from ringserve.engine.metrics import Histogram

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
VLLM = "ringserve:"  # vLLM's `vllm:` names, spelt for ringserve

Reading = float | Histogram | dict[tuple[str, ...], float]


@dataclass(frozen=True, slots=True)
class Series:
    """One exported metric: `read` gives its value from the conductor."""

    name: str
    kind: str  # "counter", "gauge" or "histogram"
    help: str
    read: Callable[[Conductor], Reading]
    labels: tuple[str, ...] = ()


def _kv_usage(c: Conductor) -> float:
    """vLLM's `kv_cache_usage_perc`: the fraction of KV slots that cannot be
    had now, i.e. neither free nor held only by the evictable prefix cache."""
    allocator, cache = c.scheduler.allocator, c.scheduler.cache
    usable = allocator.capacity - 1
    return (allocator.used - cache.evictable_size) / usable if usable else 0.0


def _per_rank(field: str) -> Callable[[Conductor], dict[tuple[str, ...], float]]:
    return lambda c: {(str(s.rank),): getattr(s, field) for s, _ in c.rank_stats()}


def _ages(c: Conductor) -> dict[tuple[str, ...], float]:
    return {(str(s.rank),): age for s, age in c.rank_stats()}


def _spec(field: str) -> Callable[[Conductor], float]:
    return lambda c: getattr(c.scheduler.speculation.stats, field)


def _spec_at(field: str, base: int) -> Callable[[Conductor], dict[tuple[str, ...], float]]:
    """A per-position speculation count, positions numbered from `base`."""
    return lambda c: {
        (str(j + base),): n for j, n in enumerate(getattr(c.scheduler.speculation.stats, field))
    }


FINISH_REASONS = ("abort", "length", "stop")  # vLLM's labels, each exported from the start


def _finished(c: Conductor) -> dict[tuple[str, ...], float]:
    counts = {reason: 0 for reason in FINISH_REASONS} | dict(c.metrics.finished)
    return {(reason,): n for reason, n in sorted(counts.items())}


SERIES: tuple[Series, ...] = (
    # ---- ringserve's own names ----
    Series("ringserve_requests_total", "counter", "requests received", lambda c: c.metrics.requests_total),
    Series("ringserve_requests_failed_total", "counter", "requests that ended in an error", lambda c: c.metrics.requests_failed),
    Series("ringserve_requests_rejected_total", "counter", "requests refused because the waiting queue was full", lambda c: c.metrics.requests_rejected),
    Series("ringserve_requests_timed_out_total", "counter", "requests failed after waiting longer than the queue timeout", lambda c: c.metrics.requests_timed_out),
    Series("ringserve_prompt_tokens_total", "counter", "prompt tokens received", lambda c: c.metrics.prompt_tokens),
    Series("ringserve_generation_tokens_total", "counter", "tokens generated", lambda c: c.metrics.generation_tokens),
    Series("ringserve_cache_hit_tokens_total", "counter", "prompt tokens served from the prefix cache", lambda c: c.metrics.cache_hit_tokens),
    Series("ringserve_passes_total", "counter", "passes completed", lambda c: c.metrics.passes),
    Series("ringserve_voids_total", "counter", "passes voided by some rank", lambda c: c.scheduler.voids),
    Series("ringserve_sampling_fallbacks_total", "counter", "rows sampled by the NaN fallback", lambda c: c.scheduler.fallbacks),
    Series("ringserve_wedge_suspicions_total", "counter", "waits that exceeded the wedge timeout", lambda c: c.health.suspicions),
    Series("ringserve_queue_depth", "gauge", "requests waiting to be scheduled", lambda c: len(c.scheduler.waiting)),
    Series("ringserve_requests_running", "gauge", "requests admitted and generating", lambda c: len(c.scheduler.running)),
    Series("ringserve_passes_in_flight", "gauge", "passes sent and not yet returned", lambda c: len(c.scheduler.in_flight)),
    Series("ringserve_kv_slots_free", "gauge", "KV slots free", lambda c: c.scheduler.allocator.available),
    Series("ringserve_kv_slots_used", "gauge", "KV slots allocated (running or cached)", lambda c: c.scheduler.allocator.used),
    Series("ringserve_kv_slots_cached", "gauge", "KV slots held by the prefix cache", lambda c: c.scheduler.cache.total_size),
    Series("ringserve_kv_slots_capacity", "gauge", "usable KV slots", lambda c: c.scheduler.allocator.capacity - 1),
    Series("ringserve_healthy", "gauge", "1 while the ring makes progress", lambda c: int(c.health.healthy)),
    Series("ringserve_time_to_first_token_seconds", "histogram", "time to first token", lambda c: c.metrics.ttft),
    Series("ringserve_time_per_output_token_seconds", "histogram", "time between output tokens", lambda c: c.metrics.tpot),
    Series("ringserve_rank_forwards_total", "counter", "passes each rank computed (others' as of their last heartbeat)", _per_rank("forwards"), ("rank",)),
    Series("ringserve_rank_forward_seconds_total", "counter", "seconds each rank spent computing passes", _per_rank("forward_s"), ("rank",)),
    Series("ringserve_rank_sent_bytes_total", "counter", "bytes each rank sent to its successor", _per_rank("sent_bytes"), ("rank",)),
    Series("ringserve_rank_report_age_seconds", "gauge", "age of each rank's figures (heartbeats go round while the ring is idle)", _ages, ("rank",)),
    Series("ringserve_spec_verifications_total", "counter", "decode steps that verified proposals", _spec("verifications")),
    Series("ringserve_spec_proposed_tokens_total", "counter", "speculative tokens proposed", _spec("proposed")),
    Series("ringserve_spec_accepted_tokens_total", "counter", "speculative tokens the target accepted", _spec("accepted")),
    Series("ringserve_spec_freed_slots_total", "counter", "KV slots of rejected positions freed", _spec("freed")),
    Series("ringserve_spec_proposed_at_position_total", "counter", "verifications that proposed a token at a position (from 1)", _spec_at("proposed_at", 1), ("position",)),
    Series("ringserve_spec_accepted_at_position_total", "counter", "verifications whose proposal at a position (from 1) was accepted", _spec_at("accepted_at", 1), ("position",)),
    # ---- vLLM's names (model_name label added on export) ----
    Series(f"{VLLM}num_requests_running", "gauge", "requests admitted and generating", lambda c: len(c.scheduler.running)),
    Series(f"{VLLM}num_requests_waiting", "gauge", "requests waiting to be scheduled", lambda c: len(c.scheduler.waiting)),
    Series(f"{VLLM}kv_cache_usage_perc", "gauge", "KV cache usage, 1 = full (evictable prefix cache counts as free)", _kv_usage),
    Series(f"{VLLM}prompt_tokens_total", "counter", "prompt tokens processed", lambda c: c.metrics.prompt_tokens),
    Series(f"{VLLM}generation_tokens_total", "counter", "generation tokens processed", lambda c: c.metrics.generation_tokens),
    Series(f"{VLLM}prefix_cache_queries_total", "counter", "prompt tokens looked up in the prefix cache", lambda c: c.metrics.prompt_tokens),
    Series(f"{VLLM}prefix_cache_hits_total", "counter", "prompt tokens found in the prefix cache", lambda c: c.metrics.cache_hit_tokens),
    Series(f"{VLLM}request_success_total", "counter", "requests finished, by finish reason", _finished, ("finished_reason",)),
    Series(f"{VLLM}time_to_first_token_seconds", "histogram", "time to first token", lambda c: c.metrics.ttft),
    Series(f"{VLLM}time_per_output_token_seconds", "histogram", "time between output tokens", lambda c: c.metrics.tpot),
    Series(f"{VLLM}inter_token_latency_seconds", "histogram", "time between output tokens", lambda c: c.metrics.tpot),
    Series(f"{VLLM}e2e_request_latency_seconds", "histogram", "request latency, arrival to last token, per request that ended (failed ones too)", lambda c: c.metrics.e2e),
    Series(f"{VLLM}spec_decode_num_drafts_total", "counter", "decode steps that verified proposals", _spec("verifications")),
    Series(f"{VLLM}spec_decode_num_draft_tokens_total", "counter", "speculative tokens proposed", _spec("proposed")),
    Series(f"{VLLM}spec_decode_num_accepted_tokens_total", "counter", "speculative tokens accepted", _spec("accepted")),
    Series(f"{VLLM}spec_decode_num_accepted_tokens_per_pos_total", "counter", "accepted speculative tokens by position (from 0)", _spec_at("accepted_at", 0), ("position",)),
    Series(f"{VLLM}request_prompt_tokens", "histogram", "prompt tokens per request that ended (failed ones too)", lambda c: c.metrics.prompt_lens),
    Series(f"{VLLM}request_generation_tokens", "histogram", "generated tokens per request that ended (failed ones too)", lambda c: c.metrics.output_lens),
)  # fmt: skip

_FAMILIES = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}


class ServingCollector:
    """Reads every `SERIES` from one conductor when scraped."""

    def __init__(self, conductor: Conductor, model_name: str) -> None:
        self.conductor, self.model_name = conductor, model_name

    def collect(self) -> Iterator[Metric]:
        for series in SERIES:
            yield self._family(series, series.read(self.conductor))
        cache = self.conductor.scheduler.cache
        for kind, owned in (("gauge", tier_gauges(cache)), ("counter", tier_counters(cache))):
            for name, (value, help_text) in owned.items():
                yield _FAMILIES[kind](f"ringserve_{name}", help_text, value=float(value))

    def _family(self, series: Series, value: Reading) -> Metric:
        extra = ("model_name",) if series.name.startswith(VLLM) else ()
        const = (self.model_name,) if extra else ()
        labels = [*series.labels, *extra]
        if isinstance(value, Histogram):
            family = HistogramMetricFamily(series.name, series.help, labels=labels)
            family.add_metric(list(const), value.cumulative(), sum_value=value.total)
            return family
        family = _FAMILIES[series.kind](series.name, series.help, labels=labels)
        points = value if isinstance(value, dict) else {(): value}
        for key, number in points.items():
            family.add_metric([*key, *const], float(number))
        return family


def registry(conductor: Conductor, model_name: str) -> CollectorRegistry:
    """A registry of this server's own, holding its one collector."""
    reg = CollectorRegistry(auto_describe=True)  # a name exported twice fails here
    reg.register(ServingCollector(conductor, model_name))
    return reg


REGISTRY = web.AppKey("metrics_registry", CollectorRegistry)


def exposition(app: web.Application) -> bytes:
    return generate_latest(app[REGISTRY])
