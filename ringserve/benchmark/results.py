"""The figures of a benchmark run, computed and printed as `vllm bench
serve` does: throughput, and TTFT, TPOT, ITL and end-to-end latency
(mean, median, std and chosen percentiles, in ms), with goodput, the rate
of requests meeting every given SLO."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ringserve.benchmark.request import RequestResult

# metric key -> (its name in the report, the section header)
METRICS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """`ttft:200 tpot:50 e2el:2000` (ms) -> {"ttft": 200.0, ...}."""
    slos: dict[str, float] = {}
    for item in items or []:
        key, _, value = item.partition(":")
        if key not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput {item!r}: the SLOs are ttft, tpot and e2el, as NAME:MS")
        try:
            slos[key] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of ms") from None
        if not 0 < slos[key] < float("inf"):
            raise ValueError(f"--goodput {item!r}: an SLO is a positive number of ms")
    return slos


@dataclass(frozen=True, slots=True)
class Samples:
    """Per-request figures of the successful requests, in seconds."""

    ttft: list[float]
    tpot: list[float]
    itl: list[float]
    e2el: list[float]


def samples(results: list[RequestResult]) -> Samples:
    ok = [r for r in results if r.success]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return Samples(
        [r.ttft for r in ok], tpot, [g for r in ok for g in r.itl], [r.latency for r in ok]
    )


def _meets(r: RequestResult, slos: dict[str, float]) -> bool:
    tpot = (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
    got = {"ttft": r.ttft, "tpot": tpot, "e2el": r.latency}
    return all(got[k] * 1e3 <= ms for k, ms in slos.items())


def summarise(
    results: list[RequestResult],
    duration_s: float,
    *,
    percentiles: list[float],
    slos: dict[str, float],
    metrics: list[str],
) -> dict[str, Any]:
    """The run's figures as vLLM's result JSON names them."""
    ok = [r for r in results if r.success]
    # the server's prompt count where it reported one (the true count for its tokenizer)
    total_input = sum(r.usage_prompt_tokens or r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    out: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration_s,
        "request_goodput": sum(_meets(r, slos) for r in ok) / duration_s if slos else None,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
        "errors": [r.error for r in results if not r.success],
    }
    per = samples(results)
    for key in metrics:
        values = np.asarray(getattr(per, key) or [0.0]) * 1e3
        out[f"mean_{key}_ms"] = float(np.mean(values))
        out[f"median_{key}_ms"] = float(np.median(values))
        out[f"std_{key}_ms"] = float(np.std(values))
        for p in percentiles:
            out[f"p{_word(p)}_{key}_ms"] = float(np.percentile(values, p))
    return out


def report(summary: dict[str, Any], *, max_concurrency: int | None, request_rate: float) -> str:
    """vLLM's table."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: Any, fmt: str = "") -> None:
        lines.append(f"{label:<40} {value:<10{fmt}}")

    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["failed"])
    row("Maximum request concurrency:", str(max_concurrency))
    if request_rate != float("inf"):
        row("Request rate configured (RPS):", request_rate, ".2f")
    row("Benchmark duration (s):", summary["duration"], ".2f")
    row("Total input tokens:", summary["total_input_tokens"])
    row("Total generated tokens:", summary["total_output_tokens"])
    row("Request throughput (req/s):", summary["request_throughput"], ".2f")
    if summary["request_goodput"] is not None:
        row("Request goodput (req/s):", summary["request_goodput"], ".2f")
    row("Output token throughput (tok/s):", summary["output_throughput"], ".2f")
    row("Total Token throughput (tok/s):", summary["total_token_throughput"], ".2f")
    for key, (name, header) in METRICS.items():
        if f"mean_{key}_ms" not in summary:
            continue
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        row(f"Mean {name} (ms):", summary[f"mean_{key}_ms"], ".2f")
        row(f"Median {name} (ms):", summary[f"median_{key}_ms"], ".2f")
        for k in summary:
            if k.startswith("p") and k.endswith(f"_{key}_ms"):
                row(f"P{k[1:].split('_')[0]} {name} (ms):", summary[k], ".2f")
    lines.append("=" * 50)
    return "\n".join(lines)


def _word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)
