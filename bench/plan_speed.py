"""A speed-aware plan against the capacity plan, side by side in one run.

    PYTHONPATH=. .venv/bin/python bench/plan_speed.py [--ms-per-layer 20] [--rank-speed 1,0.05,1]

(PYTHONPATH=. for the model factory in tests/.)

A generated 8-layer Llama (tests/model_factory.py) on a ring of 3 local
ranks with equal memory budgets; rank 1 is made slow per layer with
`RINGSERVE_FAULTS=slow:rank=1:ms_per_layer=M`, so its stage takes about M ms
per layer it holds while the other stages take the model's own, much
smaller, time. The planner is told the speeds (`--rank-speed`): rank 1's
factor is the reference layer time over its slowed one. Two rings run the
same decode-heavy workload: one planned for capacity (the largest KV pool:
rank 1 gets its share of layers), one planned for throughput (rank 1 gets
as few as its speed asks). A pipeline runs one pass per slowest stage, so
the predicted tok/s ratio is the capacity plan's bottleneck stage time over
the throughput plan's; the measured ratio is printed beside it, with the ms
per layer each rank's boot-time dry forward logged (`plan.speed`: it does
not see the injected sleep, which acts on passes only).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from decode_load import tokens_per_s, workload

from ringserve import LLM
from ringserve.ring.faults import ENV_VAR
from tests import model_factory


def dry_forward_ms(log_dir: Path) -> dict[int, float]:
    """Each rank's `plan.speed` ms per layer, from its JSON-lines log."""
    found = {}
    for path in sorted(log_dir.glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            event = json.loads(line)
            if event.get("event") == "plan.speed":
                found[event["rank"]] = event["ms_per_layer"]
    return found


def run(model: Path, plan_for: str, args: argparse.Namespace, log_dir: Path) -> tuple:
    options = {"max_batch": args.requests, "torch_threads": 1, "plan_for": plan_for}
    speeds = tuple(float(s) for s in args.rank_speed.split(","))
    with LLM(model, pp_size=3, rank_memory_mib=[40] * 3, rank_speed=speeds,
             log_dir=str(log_dir), **options) as llm:  # fmt: skip
        vocab = llm.tokenizer.vocab_size if llm.tokenizer else 256
        tokens_per_s(llm, workload(4, vocab, -1), 4)
        rates = [tokens_per_s(llm, workload(args.requests, vocab, r), args.new_tokens)
                 for r in range(args.rounds)]  # fmt: skip
        return llm.plan, max(rates), rates


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms-per-layer", type=int, default=20)
    ap.add_argument("--rank-speed", default="1,0.05,1")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    os.environ[ENV_VAR] = f"slow:rank=1:ms_per_layer={args.ms_per_layer}"
    with tempfile.TemporaryDirectory() as tmp:
        model = model_factory.llama_deep(Path(tmp))
        results = {}
        for plan_for in ("capacity", "throughput"):
            logs = Path(tmp) / plan_for
            logs.mkdir()
            results[plan_for] = (*run(model, plan_for, args, logs), dry_forward_ms(logs))
    print(f"8-layer Llama, pp 3, rank 1 slowed {args.ms_per_layer} ms per layer, "
          f"speeds {args.rank_speed}, {args.requests} requests x {args.new_tokens} new tokens")  # fmt: skip
    for plan_for, (plan, best, rates, dry) in results.items():
        slow = plan.bottleneck
        print(f"  {plan_for:10s} split {list(plan.layer_split)}  T {plan.capacity_tokens:7d}  "
              f"bottleneck rank {slow.rank} ({slow.stage_time:.2f} layer-times)  "
              f"{best:7.1f} tok/s (rounds {', '.join(f'{r:.1f}' for r in rates)})  "
              f"dry forward ms/layer {dry}")  # fmt: skip
    (cap, cap_best, *_), (fast, fast_best, *_) = results["capacity"], results["throughput"]
    predicted = cap.bottleneck.stage_time / fast.bottleneck.stage_time
    print(
        f"  throughput / capacity tok/s: predicted {predicted:.2f}, measured {fast_best / cap_best:.2f}"
    )


if __name__ == "__main__":
    main()
