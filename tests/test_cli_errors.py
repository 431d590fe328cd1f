"""A mistake at the command line is one line on stderr and exit code 2, no
traceback; `--debug` shows the traceback. Each case runs the real command
as a subprocess, all of them at once."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from ringserve.models.builtin import builtin_model_dir
from tests.launched import free_port

pytestmark = pytest.mark.timeout(120)


def broken_model(tmp, name: str, config: dict | None = None, cut_weights: bool = False) -> str:
    """A copy of the built-in model with its config replaced, or its
    weights cut short as an interrupted copy leaves them."""
    model = tmp / name
    shutil.copytree(builtin_model_dir(), model)
    if config is not None:
        (model / "config.json").write_text(json.dumps(config))
    if cut_weights:
        weights = model / "model.safetensors"
        os.truncate(weights, weights.stat().st_size // 2)
    return str(model)


def test_user_mistakes_are_one_line_and_exit_2(tmp_path):
    builtin = json.loads((builtin_model_dir() / "config.json").read_text())
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        two_nodes = ["launch", "--pp", "2", "--nnodes", "2"]
        cases = {
            "missing model": (["launch", "--model", str(tmp_path / "nope")], "no such directory"),
            "config missing a size": (
                ["launch", "--model", broken_model(tmp_path, "partial", {"model_type": "llama"})],
                "config.json has no 'num_attention_heads', which a llama config needs",
            ),
            "weights cut short": (
                ["launch", "--model", broken_model(tmp_path, "cut", cut_weights=True)],
                "model.safetensors is truncated",
            ),
            "bad budget list": (
                ["launch", "--pp", "2", "--rank-memory-mib", "9000,lots"],
                "--rank-memory-mib '9000,lots': give comma-separated integers",
            ),
            "port in use": (["launch", "--port", str(port)], f"cannot listen on 127.0.0.1:{port}"),
            "exchange port in use": (
                [*two_nodes, "--master-port", str(port - 1), "--port", str(free_port())],
                f"node 0 cannot serve ring exchange at 127.0.0.1:{port}",
            ),
            "master port in use": (
                ["launch", "--master-port", str(port), "--port", str(free_port())],
                f"cannot listen on 0.0.0.0:{port} (Address already in use); pick another --master-port",
            ),
            "HTTP port on the ring's": (
                [*two_nodes, "--master-port", "24990", "--port", "24991"],
                "--port 24991 is the ring's",
            ),
            "split does not fit": (
                ["launch", "--pp", "2", "--rank-memory-mib", "10,10"],
                "rank 1 cannot hold its slice",
            ),
            "a field's check names the flag": (
                ["launch", "--kv-capacity-tokens", "0"],
                "--kv-capacity-tokens must be >= 2, got 0",
            ),
            "one of two fields": (
                ["launch", "--heartbeat-s", "0"],
                "--heartbeat-s must be > 0, got 0.0",
            ),
            "budgets past this machine's memory": (
                ["launch", "--pp", "2", "--rank-memory-mib", "8000000,8000000", "--device", "cpu"],
                "of this machine's memory",
            ),
            "unknown family": (
                [
                    "plan",
                    "--model",
                    broken_model(tmp_path, "mamba", {**builtin, "model_type": "mamba"}),
                    "--rank-memory-mib",
                    "900",
                ],
                "unsupported model_type 'mamba'",
            ),
            "budgets in bytes": (
                ["plan", "--pp", "2", "--rank-memory-mib", "34359738368,10737418240"],
                "rank memory budgets are in MiB",
            ),
            "a negative budget": (
                ["plan", "--pp", "2", "--rank-memory-mib=-5,30000"],
                "rank memory budgets are in MiB, 0 to 16777216 (16 TiB), got -5",
            ),
            "infinite rank speed": (
                ["plan", "--pp", "2", "--rank-memory-mib", "900,900", "--rank-speed", "inf,1"],
                "--rank-speed must be positive finite factors",
            ),
            "a draft model without draft speculation": (
                ["plan", "--draft-model", str(builtin_model_dir())],
                "--draft-model is used only with speculative 'draft' (--speculative draft)",
            ),
            "a draft of another vocabulary": (
                [
                    "plan",
                    "--speculative",
                    "draft",
                    "--draft-model",
                    broken_model(
                        tmp_path, "wide", {**builtin, "vocab_size": 2 * builtin["vocab_size"]}
                    ),
                ],
                "they must share one tokenizer",
            ),  # fmt: skip
            "unknown device": (
                ["plan", "--device", "gpu", "--rank-memory-mib", "900"],
                "device must be auto, cpu, cuda",
            ),
            "devices short of the ring": (
                ["plan", "--pp", "2", "--device", "cpu,cpu,cpu"],
                "3 devices given for 2 ranks",
            ),
            "port out of range": (["launch", "--port", "99999"], "--port 99999 is not a TCP port"),
            "empty chunk": (["launch", "--chunk-size", "0"], "--chunk-size must be >= 1"),
            "no pass in flight": (
                ["launch", "--passes-in-flight", "0"],
                "--passes-in-flight must be >= 1",
            ),
            "context of no tokens": (
                ["launch", "--max-model-len", "-1"],
                "--max-model-len must be >= 1",
            ),
            "no nodes": (["launch", "--nnodes", "0"], "--nnodes 0"),
            "no ranks": (["plan", "--pp", "0"], "--pp 0"),
            "empty api key": (["launch", "--api-key="], "--api-key is empty"),
            "empty host": (["launch", "--host="], "--host is empty"),
            "a host that is no address": (
                ["launch", "--host", "999.1.1.1"],
                "--host 999.1.1.1: Name or service not known; pick another --host",
            ),
            # refused at once, before a budget or an estimate is made for every rank
            "ranks by the billion": (
                ["plan", "--pp", "3000000000"],
                "3000000000 ranks for a model of 4 layers",
            ),
            "host tier not in MiB": (
                ["plan", "--host-kv-mib", "16777217"],
                "--host-kv-mib must be 1 to 16777216 (16 TiB",
            ),
            "a floor above the default cap": (
                ["plan", "--min-kv-tokens", "20000"],
                "raise --kv-capacity-tokens, which caps the pool",
            ),
            "auto tools without a parser": (
                ["launch", "--enable-auto-tool-choice"],
                "--enable-auto-tool-choice needs --tool-call-parser",
            ),
            "log dir is a file": (["launch", "--log-dir", str(afile)], f"--log-dir {afile}"),
            "mistyped speculative config": (
                [
                    "launch",
                    "--speculative-config",
                    '{"method": "ngram", "num_speculative_tokens": "x"}',
                ],
                "num_speculative_tokens must be an integer",
            ),
            "negative list without =": (
                ["launch", "--layer-split", "-1,5"],
                "expected one argument",
            ),
            "unknown option": (["launch", "--bogus"], "unrecognized arguments: --bogus"),
            # the benchmark's options are judged before it sends anything
            "bench percentiles": (
                ["bench", "--metric-percentiles", "abc"],
                "--metric-percentiles 'abc'",
            ),
            "bench goodput": (["bench", "--goodput", "ttft=200"], "--goodput 'ttft=200'"),
            "bench result file": (
                ["bench", "--result-filename", str(tmp_path / "no" / "such" / "r.json")],
                "--result-filename",
            ),
            "bench prompt length": (["bench", "--random-input-len", "-5"], "--random-input-len"),
            "bench negative SLO": (["bench", "--goodput", "tpot:-5"], "an SLO is a positive"),
            "bench prefix length": (["bench", "--random-prefix-len", "-5"], "--random-prefix-len"),
            "bench output length": (
                ["bench", "--sharegpt-output-len", "0"],
                "--sharegpt-output-len must be",
            ),
            "bench port": (["bench", "--port", "99999"], "--port 99999 is not a TCP port"),
            "bench tokenizer": (
                ["bench", "--model", "m", "--tokenizer", str(tmp_path / "none")],
                f"--tokenizer {tmp_path / 'none'}",
            ),
        }
        if not torch.cuda.is_available():
            cases["no GPU"] = (
                ["launch", "--device", "cuda"],
                "device 'cuda' asks for CUDA, but torch sees no GPU here",
            )
        # A few at a time: each starts an interpreter that imports torch,
        # and dozens at once starve whatever else the machine runs.
        with ThreadPoolExecutor(AT_ONCE) as pool:
            done = dict(
                zip(cases, pool.map(run_cli, [argv for argv, _ in cases.values()]), strict=True)
            )
    for name, (_, said) in cases.items():
        code, err = done[name]
        assert code == 2, (name, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("ringserve: "), (name, err)
        assert said in lines[0], (name, err)


AT_ONCE = 4


def run_cli(argv: list[str], env: dict[str, str] | None = None) -> tuple[int, str]:
    """(exit code, stderr) of `ringserve ARGV` (`env` added to this
    environment), under a timeout."""
    done = subprocess.run(
        [sys.executable, "-m", "ringserve", *argv],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )
    return done.returncode, done.stderr


def test_debug_shows_the_traceback(tmp_path):
    argv = ["launch", "--model", str(tmp_path / "nope"), "--debug"]
    done = subprocess.run(
        [sys.executable, "-m", "ringserve", *argv], capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0
    assert "Traceback" in done.stderr and "UserError: model" in done.stderr


def test_fault_rules_that_do_not_parse_are_one_line_and_exit_2():
    done = subprocess.run(
        [sys.executable, "-m", "ringserve", "launch", "--pp", "2"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "RINGSERVE_FAULTS": "bogus"},
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ringserve: RINGSERVE_FAULTS"), done.stderr


def test_ctrl_c_is_one_line_and_exit_130():
    """Ctrl-C in a command without a handler of its own (here `bench`
    waiting on a server that never answers) says so in one line."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        argv = ["bench", "--port", str(held.getsockname()[1]), "--num-prompts", "1"]
        proc = subprocess.Popen(
            [sys.executable, "-m", "ringserve", *argv],
            stdin=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            time.sleep(3)  # well inside the wait for /v1/models
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=30)
        finally:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130 and err.strip() == "ringserve: interrupted", err


def test_a_node_says_which_of_its_settings_node_0_replaced_in_words():
    from ringserve.cli import _given_away
    from ringserve.config import EngineConfig
    from ringserve.models.builtin import builtin_model_dir

    model = builtin_model_dir()
    mine = EngineConfig(model_dir=model, max_model_len=512, dtype="bfloat16")
    node0 = EngineConfig(model_dir=model)
    said = _given_away(mine, node0)
    assert (
        said == "--max-model-len 512 (node 0: not given), --dtype bfloat16 (node 0: float32)"
        or (said == "--dtype bfloat16 (node 0: float32), --max-model-len 512 (node 0: not given)")
    ), said


def test_a_cache_dir_that_cannot_hold_the_built_in_model_is_one_line(tmp_path):
    not_a_dir = tmp_path / "a_file"
    not_a_dir.write_text("")
    code, err = run_cli(["plan", "--pp", "1"], env={"RINGSERVE_CACHE_DIR": str(not_a_dir)})
    assert code == 2, err
    (line,) = err.strip().splitlines()
    assert line.startswith(f"ringserve: cannot write the built-in model into {not_a_dir}"), line
    assert "RINGSERVE_CACHE_DIR" in line
