"""The `ringserve` command: `launch` serves a model, `plan` prints the memory
plan for a rig, `replay` checks a run's logs, `bench` measures a server.

A mistake on the command line (a model that is not there, a malformed list,
a port in use, a split that does not fit) is one line on stderr and exit
code 2; `--debug` shows the traceback instead."""

from __future__ import annotations

import argparse
import errno
import os
import re
import socket
from dataclasses import fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from ringserve.benchmark.options import add_arguments as bench_args
from ringserve.config import (
    CPU_KERNELS,
    KV_TOKENS_PER_WAITING,
    PLAN_FOR,
    RING_FIELDS,
    SPECULATIVE_METHODS,
    EngineConfig,
    UserError,
    json_object,
    with_speculative_config,
)

if TYPE_CHECKING:
    from ringserve.launch.exchange import RingExchange
    from ringserve.launch.launcher import NodeSpec


def _defaults() -> dict[str, object]:
    return {f.name: f.default for f in fields(EngineConfig)}


def _engine_args(p: argparse.ArgumentParser) -> None:
    """Engine options; their defaults are `EngineConfig`'s (an option left
    out is not passed on)."""
    d = _defaults()
    p.add_argument(
        "--model",
        default=None,
        help="model directory or Hugging Face Hub id, e.g. Qwen/Qwen2.5-0.5B-Instruct "
        "(default: built-in model)",
    )
    p.add_argument("--revision", default=None, help="Hub branch, tag or commit (default main)")
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
    p.add_argument(
        "--device",
        help="where the ranks run: auto (cuda where torch sees a GPU, else cpu), cpu, cuda "
        "(rank r on GPU r %% GPUs), or one per rank, e.g. cuda:0,cuda:1,cuda:1 "
        f"(default {d['device']})",
    )
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
        help="the most micro-batches in flight; those past the number of ranks open only "
        "while requests wait for them (default: ranks + 2 on a ring, 1 on one rank)",
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
    p.add_argument(
        "--host-kv-tokens",
        type=int,
        help="KV slots per rank in host memory, a second tier the cache spills to (default 0: none)",
    )
    p.add_argument(
        "--host-kv-mib",
        type=int,
        help="host memory per rank for that tier; the planner solves the tokens",
    )
    p.add_argument(
        "--structured-outputs-config",
        help='JSON, as vLLM\'s: {"backend": "guidance", "disable_any_whitespace": true}',
    )
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
        "--cpu-kernels",
        choices=CPU_KERNELS,
        help="CPU kernels: native reads the KV pool in place for decode attention and fuses "
        "the norms, rope and SwiGLU (AVX-512 or AVX2, built with the system's C compiler at "
        "first use) and packs bfloat16 matmul weights for oneDNN; torch runs torch's ops "
        f"throughout (default {d['cpu_kernels']}; native falls back to torch's attention and "
        "norms where it cannot build)",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="on a GPU, run decode passes op by op instead of replaying CUDA graphs",
    )
    p.add_argument(
        "--no-adaptive-speculation",
        action="store_true",
        help="propose num-speculative-tokens always, whatever the acceptance",
    )


_PASSED_ON = (
    "dtype", "max_model_len", "kv_capacity_tokens", "max_tokens_per_pass", "chunk_size",
    "max_batch", "passes_in_flight", "wedge_timeout_s", "heartbeat_s", "plan_for", "min_kv_tokens",
    "max_waiting_requests", "queue_timeout_s", "host_kv_tokens", "host_kv_mib",
    "structured_outputs_config", "speculative",
    "num_speculative_tokens", "ngram_max", "ngram_min", "cpu_kernels", "device",
)  # fmt: skip


def numbers(text: str, flag: str, kind: type = int) -> tuple:
    """`a,b,c` as numbers, or a UserError naming the flag."""
    try:
        return tuple(kind(x) for x in text.split(","))
    except ValueError:
        noun = "integers" if kind is int else "numbers"
        raise UserError(f"{flag} {text!r}: give comma-separated {noun}, e.g. 3,5,4") from None


def _model_dir(args: argparse.Namespace) -> Path:
    from ringserve.models.hub import resolve_model

    if args.model is None:
        if args.revision is not None:
            raise UserError("--revision needs --model")
        from ringserve.models.builtin import builtin_model_dir

        return builtin_model_dir()
    return resolve_model(args.model, args.revision)


def _config(args: argparse.Namespace) -> EngineConfig:
    model = _model_dir(args)
    split = numbers(args.layer_split, "--layer-split") if args.layer_split else None
    given = {k: getattr(args, k) for k in _PASSED_ON if getattr(args, k) is not None}
    if args.structured_outputs_config is not None:
        from ringserve.engine.grammar import StructuredOutputsConfig

        try:
            StructuredOutputsConfig.parse(args.structured_outputs_config)
        except ValueError as exc:
            raise UserError(f"--structured-outputs-config: {exc}") from None
    if args.rank_speed:
        given["rank_speed"] = numbers(args.rank_speed, "--rank-speed", float)
    if args.draft_model:
        given["draft_model"] = Path(args.draft_model)
    if args.no_adaptive_speculation:
        given["speculative_adaptive"] = False
    if args.enforce_eager:
        given["enforce_eager"] = True
    if args.speculative_config:
        given = with_speculative_config(
            given, json_object(args.speculative_config, "--speculative-config")
        )
    return EngineConfig(
        model_dir=model, prefix_reuse=not args.no_prefix_reuse, layer_split=split, **given
    )


def _budgets(args: argparse.Namespace) -> list[int] | None:
    if not args.rank_memory_mib:
        return None
    return list(numbers(args.rank_memory_mib, "--rank-memory-mib"))


def _check_port_free(host: str, port: int, flag: str = "--port") -> None:
    """Refuse a port another process holds before any rank is started (as
    the server will bind it: address reuse on, so a closing socket's
    TIME_WAIT does not count)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except socket.gaierror as exc:  # the address itself, whatever the port
            raise UserError(f"--host {host}: {exc.strerror}; pick another --host") from None
        except OSError as exc:
            fix = "another --host" if exc.errno == errno.EADDRNOTAVAIL else f"another {flag}"
            raise UserError(
                f"cannot listen on {host}:{port} ({exc.strerror}); pick {fix}"
            ) from None


def _check_node_0_ports(args: argparse.Namespace) -> None:
    """Node 0 listens on the HTTP port, on the master port (rank 0's store
    for the rendezvous) and, with several nodes, the port after it (the
    ring exchange, which says so itself when it cannot listen): the HTTP
    and master ports free, and the three different."""
    _check_port_free(args.host, args.port)
    if args.master_port is None:  # one node: the launcher picks a free one
        return
    ring = [args.master_port] + ([args.master_port + 1] if args.nnodes > 1 else [])
    if args.port in ring:
        raise UserError(
            f"--port {args.port} is the ring's: rank 0 listens on --master-port "
            f"{args.master_port}"
            + (" and the exchange on the port after it" if args.nnodes > 1 else "")
        )
    _check_port_free("0.0.0.0", args.master_port, "--master-port")


def _check_launch(args: argparse.Namespace) -> None:
    """What the launcher's own options must be, before anything starts."""
    _check_pp(args)
    for flag, port in (("--port", args.port), ("--master-port", args.master_port)):
        if port is not None and not 1 <= port <= 65535:
            raise UserError(f"{flag} {port} is not a TCP port (1-65535)")
    if args.nnodes < 1:
        raise UserError(f"--nnodes {args.nnodes}: a ring runs on at least one node")
    if args.nnodes > 1 and args.master_port is None:
        raise UserError("--master-port is required with --nnodes > 1")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise UserError("--enable-auto-tool-choice needs --tool-call-parser")
    for flag, value in (
        ("--api-key", args.api_key),
        ("--served-model-name", args.served_model_name),
        ("--host", args.host),
    ):
        if value is not None and not value.strip():
            raise UserError(f"{flag} is empty: give one, or leave the option out")
    if args.log_dir is not None:
        try:
            Path(args.log_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"--log-dir {args.log_dir}: {exc.strerror}") from None
        if not os.access(args.log_dir, os.W_OK):
            raise UserError(f"--log-dir {args.log_dir}: not writable")
    from ringserve.logs import say
    from ringserve.ring.faults import ENV_VAR, FaultPlan, never_fire

    for rank in range(max(args.pp, 1)):
        try:
            FaultPlan.from_env(rank)
        except ValueError as exc:
            raise UserError(f"{ENV_VAR}: {exc}") from None
    for why in never_fire(os.environ.get(ENV_VAR, ""), max(args.pp, 1)):
        say(f"{ENV_VAR}: this rule can never fire: {why}")


def _check_pp(args: argparse.Namespace) -> None:
    if args.pp < 1:
        raise UserError(f"--pp {args.pp}: a ring has at least one rank")


def _launch(args: argparse.Namespace) -> int:
    _check_launch(args)
    if args.node_rank == 0:
        _check_node_0_ports(args)
    if args.log_dir is None:
        return _launch_checked(args)
    from ringserve.logs import claim_log_dir

    with claim_log_dir(args.log_dir, args.node_rank):  # held while this launch runs
        return _launch_checked(args)


def _launch_checked(args: argparse.Namespace) -> int:
    budgets, config = _budgets(args), _config(args)  # mistakes found before torch loads

    from ringserve.http.options import HttpOptions
    from ringserve.launch.launcher import NodeSpec, launch
    from ringserve.launch.processes import free_port

    node = NodeSpec(
        args.pp, args.nnodes, args.node_rank, args.master_addr, args.master_port or free_port()
    )
    # node 0's exchange serves the other nodes for as long as this call runs,
    # and the other nodes watch it: ranks still joining a ring whose node 0
    # is gone would wait out the rendezvous
    config, exchange = _sized_for_node(config, node, budgets)
    node0 = exchange.answers if exchange is not None and node.node_rank != 0 else None
    # vLLM's default: the name the model was asked for (a Hub id, not its snapshot hash)
    name = args.served_model_name
    if name is None and args.model is not None and not Path(args.model).is_dir():
        name = args.model
    http = HttpOptions(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        model_name=name,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
    )
    return launch(node, config, http, args.log_dir, node0)


def _sized_for_node(
    config: EngineConfig, node: NodeSpec, budgets: list[int] | None
) -> tuple[EngineConfig, RingExchange | None]:
    """The ring this node's ranks start on: sized here on node 0 (published
    to the other nodes when there are several), taken from node 0 on the
    others (launch/exchange.py); and the exchange, which node 0 keeps
    serving while its launcher runs."""
    from ringserve.launch.exchange import RingExchange
    from ringserve.logs import say
    from ringserve.plan.sizing import check_fits_here, placement, resolve_device, size_ring

    if node.nnodes == 1:
        config, plan = size_ring(config, node.world, budgets)
        check_fits_here(config, plan)
        if plan is not None:
            say("memory plan\n" + plan.table())
        say(_devices(placement(config.device, node.world)))
        return config, None
    exchange = RingExchange(
        node.master_addr, node.master_port, node.node_rank, node.nnodes, node.world
    )
    own = replace(config, device=resolve_device(config.device, node.world))
    if node.node_rank == 0:
        # without given budgets, each node's ranks as measured on their own node's devices
        asked = budgets is None and config.layer_split is None
        exchange.ask_budgets(asked)
        every = exchange.gather_budgets(_measured(own, node), node.nnodes) if asked else None
        config, plan = size_ring(own, node.world, budgets, measured=every)
        if plan is not None:
            say("memory plan\n" + plan.table())
        exchange.publish(config)
        exchange.wait_for_nodes(node.nnodes)
    else:
        if exchange.budgets_asked():
            exchange.offer_budgets(_measured(own, node))
        config = exchange.take(own)
        split = ",".join(map(str, config.layer_split or ()))
        say(f"ring sized by node 0: layer split {split}, KV capacity {config.kv_capacity_tokens}")
        replaced = _given_away(own, config)
        if replaced:
            say(f"node 0's ring settings replace this node's: {replaced}")
    say(_devices(placement(config.device, node.world)))
    return config, exchange


def _given_away(own: EngineConfig, ring: EngineConfig) -> str:
    """This node's ring settings, given on its command line (not left at
    their defaults), that node 0's ring replaced: `--dtype bfloat16 (node 0:
    float32)`, ..."""
    defaults = {f.name: f.default for f in fields(EngineConfig)}
    parts = []
    for name in RING_FIELDS:
        mine, theirs = getattr(own, name), getattr(ring, name)
        if mine != theirs and mine != defaults.get(name):
            parts.append(f"--{name.replace('_', '-')} {_flag_value(mine)} "
                         f"(node 0: {_flag_value(theirs)})")  # fmt: skip
    return ", ".join(parts)


def _flag_value(value: object) -> str:
    if value is None:  # not given there: the model's or the engine's own
        return "not given"
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


def _measured(config: EngineConfig, node: NodeSpec) -> list[int]:
    """This node's ranks' default budgets, measured on this node's devices."""
    from ringserve.plan.ledger import default_budgets

    return [f.bytes for f in default_budgets(node.world, config.device, node.ranks)]


def _plan(args: argparse.Namespace) -> int:
    _check_pp(args)
    budgets, config = _budgets(args), _config(args)
    from ringserve.plan.sizing import placement, size_ring

    sized, plan = size_ring(config, args.pp, budgets)
    if plan is None:
        raise UserError(
            "ringserve plan picks the layer split itself, from --rank-memory-mib or from each "
            "rank's measured memory: drop --layer-split"
        )
    print(_devices(placement(sized.device, args.pp)))
    print(plan.table())
    return 0


def _devices(places: list[str]) -> str:
    return "devices: " + ", ".join(f"rank {r} {d}" for r, d in enumerate(places))


def _replay(args: argparse.Namespace) -> int:
    from ringserve.replay import main as replay_main

    return replay_main(args)


def _bench(args: argparse.Namespace) -> int:
    from ringserve.benchmark.serve import run

    return run(args)


class _Parser(argparse.ArgumentParser):
    """A mistake on the command line is one line and exit 2, as every other
    refusal is (argparse's own would print the whole usage first)."""

    def error(self, message: str) -> NoReturn:
        hint = f"`{self.prog} --help` lists the options"
        if "expected one argument" in message:
            hint += "; a value that begins with '-' goes after '=', e.g. --layer-split=-1,5"
        self.exit(2, f"ringserve: {message} ({hint})\n")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="ringserve", description=__doc__)
    p.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    debug = argparse.ArgumentParser(add_help=False)  # `--debug` after the subcommand too
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS)
    sub = p.add_subparsers(dest="command", required=True)
    launch = sub.add_parser("launch", help="serve a model over HTTP", parents=[debug])
    _engine_args(launch)
    launch.add_argument("--host", default="127.0.0.1")
    launch.add_argument("--port", type=int, default=8000)
    launch.add_argument("--api-key", default=None)
    launch.add_argument("--served-model-name", default=None)
    launch.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='answer tool_choice "auto" (needs --tool-call-parser)',
    )
    launch.add_argument(
        "--tool-call-parser", choices=["hermes"], help="how auto tool calls are read from answers"
    )
    launch.add_argument("--log-dir", default=None, help="write rank{R}.jsonl logs here")
    launch.add_argument("--nnodes", type=int, default=1)
    launch.add_argument("--node-rank", type=int, default=0)
    launch.add_argument("--master-addr", default="127.0.0.1")
    launch.add_argument("--master-port", type=int, default=None)
    launch.set_defaults(run=_launch)
    plan = sub.add_parser(
        "plan",
        help="print the plan (layer split, KV capacity, stage times) from --rank-memory-mib "
        "or each rank's measured memory",
        parents=[debug],
    )
    _engine_args(plan)
    plan.set_defaults(run=_plan)
    replay = sub.add_parser("replay", help="check the logs of a run", parents=[debug])
    replay.add_argument(
        "log_dirs",
        nargs="+",
        metavar="LOG_DIR",
        help="the --log-dir of the run; one per node of a ring over several nodes",
    )
    replay.add_argument("--json", action="store_true", help="machine-readable report")
    replay.set_defaults(run=_replay)
    bench = sub.add_parser(
        "bench", help="measure an OpenAI-compatible server (vllm bench serve's flags)",
        parents=[debug],
    )  # fmt: skip
    bench_args(bench)
    bench.set_defaults(run=_bench)
    return p


def _as_flags(message: str) -> str:
    """`message` with the engine's field names (`kv_capacity_tokens`, as the
    config and the Python API call them) written as the flags that set them
    on this command line (`--kv-capacity-tokens`); what a JSON option says
    of its own keys keeps their names (`--speculative-config: num_...`)."""
    flags: dict[str, str] = {}
    pending = [parser()]
    while pending:
        for action in pending.pop()._actions:
            if isinstance(action, argparse._SubParsersAction):
                pending.extend(action.choices.values())
            elif "_" in action.dest and action.option_strings:
                flags.setdefault(action.dest, max(action.option_strings, key=len))
    names = re.compile(rf"(?<![-\w])({'|'.join(sorted(flags, key=len, reverse=True))})\b")
    json_option = re.match(r"[\w-]+[-_]config: ", message)
    at = json_option.end() if json_option else len(message)
    return names.sub(lambda m: flags[m.group(1)], message[:at]) + message[at:]


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from ringserve import logs

    # stdout is for what a command prints; errors say themselves, in one line
    scope = logs.LogScope(0, None, console_level="debug" if args.debug else "error")
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as exc:  # UserError, bad options, refused plans
        if args.debug:
            raise
        logs.say(_as_flags(" ".join(str(exc).split())))
        return 2
    except KeyboardInterrupt:  # Ctrl-C before a command's own handler is set (or with none)
        if args.debug:
            raise
        logs.say("interrupted")
        return 130
    finally:
        scope.close()
