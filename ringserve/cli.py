"""The `ringserve` command: `launch` serves a model, `plan` prints the memory
plan for a rig, `replay` checks a run's logs."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

from ringserve.config import (
    KV_TOKENS_PER_WAITING,
    PLAN_FOR,
    SPECULATIVE_METHODS,
    EngineConfig,
    speculative_options,
)


def _defaults() -> dict[str, object]:
    return {f.name: f.default for f in fields(EngineConfig)}


def _engine_args(p: argparse.ArgumentParser) -> None:
    """Engine options; their defaults are `EngineConfig`'s (an option left
    out is not passed on)."""
    d = _defaults()
    p.add_argument(
        "--model", default=None, help="Hugging Face model directory (default: built-in model)"
    )
    p.add_argument("--pp", type=int, default=1, help="pipeline ranks (default 1)")
    p.add_argument(
        "--rank-memory-mib", default=None, help="memory budget per rank, e.g. 28000,9000,9000"
    )
    p.add_argument(
        "--layer-split", default=None, help="layers per rank, e.g. 3,5,4 (default: even)"
    )
    p.add_argument(
        "--rank-speed",
        default=None,
        help="speed per layer of each rank relative to 1.0, e.g. 1,1,0.5 (default: equal)",
    )
    p.add_argument(
        "--plan-for", choices=PLAN_FOR, help=f"what the planner maximises (default {d['plan_for']})"
    )
    p.add_argument(
        "--min-kv-tokens", type=int, help="refuse a plan whose KV capacity is below this"
    )
    p.add_argument("--dtype", choices=["float32", "bfloat16", "auto"], help=f"default {d['dtype']}")
    p.add_argument("--max-model-len", type=int, help="default: the model's")
    p.add_argument(
        "--kv-capacity-tokens",
        type=int,
        help=f"KV slots per rank without a plan (default {d['kv_capacity_tokens']})",
    )
    p.add_argument("--max-tokens-per-pass", type=int, help=f"default {d['max_tokens_per_pass']}")
    p.add_argument(
        "--chunk-size",
        type=int,
        help=f"prefill chunk per request per pass (default {d['chunk_size']})",
    )
    p.add_argument("--max-batch", type=int, help=f"requests per pass (default {d['max_batch']})")
    p.add_argument(
        "--passes-in-flight",
        type=int,
        help="micro-batches in flight (default: the number of ranks)",
    )
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        help="requests that may wait for admission; beyond, HTTP 429 "
        f"(default: KV capacity // {KV_TOKENS_PER_WAITING})",
    )
    p.add_argument(
        "--queue-timeout-s",
        type=float,
        help="fail a request still waiting for admission after this long (default: no limit)",
    )
    p.add_argument("--no-prefix-reuse", action="store_true")
    p.add_argument("--wedge-timeout-s", type=float, help=f"default {d['wedge_timeout_s']}")
    p.add_argument("--heartbeat-s", type=float, help=f"default {d['heartbeat_s']}")
    _speculative_args(p, d)


def _speculative_args(p: argparse.ArgumentParser, d: dict[str, object]) -> None:
    p.add_argument(
        "--speculative",
        choices=SPECULATIVE_METHODS,
        help="speculative decoding: ngram (prompt lookup) or draft (a draft model)",
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        help=f"most tokens proposed per decode step (default {d['num_speculative_tokens']})",
    )
    p.add_argument(
        "--ngram-max", type=int, help=f"longest n-gram matched (default {d['ngram_max']})"
    )
    p.add_argument(
        "--ngram-min", type=int, help=f"shortest n-gram matched (default {d['ngram_min']})"
    )
    p.add_argument(
        "--draft-model", default=None, help="draft model directory (--speculative draft)"
    )
    p.add_argument(
        "--speculative-config",
        default=None,
        help='vLLM\'s JSON form, e.g. \'{"method": "ngram", "num_speculative_tokens": 5, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\'',
    )
    p.add_argument(
        "--no-adaptive-speculation",
        action="store_true",
        help="propose num-speculative-tokens always, whatever the acceptance",
    )


_PASSED_ON = (
    "dtype", "max_model_len", "kv_capacity_tokens", "max_tokens_per_pass", "chunk_size",
    "max_batch", "passes_in_flight", "wedge_timeout_s", "heartbeat_s", "plan_for", "min_kv_tokens",
    "max_waiting_requests", "queue_timeout_s", "speculative", "num_speculative_tokens",
    "ngram_max", "ngram_min",
)  # fmt: skip


def _config(args: argparse.Namespace) -> EngineConfig:
    from ringserve.models.builtin import builtin_model_dir

    model = Path(args.model) if args.model else builtin_model_dir()
    split = tuple(int(x) for x in args.layer_split.split(",")) if args.layer_split else None
    given = {k: getattr(args, k) for k in _PASSED_ON if getattr(args, k) is not None}
    if args.rank_speed:
        given["rank_speed"] = tuple(float(x) for x in args.rank_speed.split(","))
    if args.draft_model:
        given["draft_model"] = Path(args.draft_model)
    if args.no_adaptive_speculation:
        given["speculative_adaptive"] = False
    if args.speculative_config:
        given.update(_speculative_config(args.speculative_config))
    return EngineConfig(
        model_dir=model, prefix_reuse=not args.no_prefix_reuse, layer_split=split, **given
    )


def _speculative_config(text: str) -> dict[str, object]:
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--speculative-config is not JSON: {exc}") from exc
    if not isinstance(spec, dict):
        raise ValueError("--speculative-config must be a JSON object")
    return speculative_options(spec)


def _launch(args: argparse.Namespace) -> int:
    from ringserve.http.options import HttpOptions
    from ringserve.launch.launcher import NodeSpec, launch, say
    from ringserve.launch.processes import free_port
    from ringserve.plan.sizing import size_ring

    if args.nnodes > 1 and args.master_port is None:
        raise SystemExit("ringserve: --master-port is required with --nnodes > 1")
    config, plan = size_ring(_config(args), args.pp, args.rank_memory_mib)
    if plan is not None:
        say("memory plan\n" + plan.table())
    node = NodeSpec(
        args.pp, args.nnodes, args.node_rank, args.master_addr, args.master_port or free_port()
    )
    http = HttpOptions(
        host=args.host, port=args.port, api_key=args.api_key, model_name=args.served_model_name
    )
    return launch(node, config, http, args.log_dir)


def _plan(args: argparse.Namespace) -> int:
    from ringserve.plan.sizing import size_ring

    _, plan = size_ring(_config(args), args.pp, args.rank_memory_mib)
    if plan is None:
        raise SystemExit("ringserve: plan needs --rank-memory-mib")
    print(plan.table())
    return 0


def _replay(args: argparse.Namespace) -> int:
    from ringserve.replay import main as replay_main

    return replay_main(args)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ringserve", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    launch = sub.add_parser("launch", help="serve a model over HTTP")
    _engine_args(launch)
    launch.add_argument("--host", default="127.0.0.1")
    launch.add_argument("--port", type=int, default=8000)
    launch.add_argument("--api-key", default=None)
    launch.add_argument("--served-model-name", default=None)
    launch.add_argument("--log-dir", default=None, help="write rank{R}.jsonl logs here")
    launch.add_argument("--nnodes", type=int, default=1)
    launch.add_argument("--node-rank", type=int, default=0)
    launch.add_argument("--master-addr", default="127.0.0.1")
    launch.add_argument("--master-port", type=int, default=None)
    launch.set_defaults(run=_launch)
    plan = sub.add_parser("plan", help="print the memory plan for --rank-memory-mib")
    _engine_args(plan)
    plan.set_defaults(run=_plan)
    replay = sub.add_parser("replay", help="check the logs of a run")
    replay.add_argument("log_dir")
    replay.add_argument("--json", action="store_true", help="machine-readable report")
    replay.set_defaults(run=_replay)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.run(args)
    except ValueError as exc:  # bad options and refused plans say why
        print(f"ringserve: {exc}", file=sys.stderr)
        return 2
