"""Joining the ring's process group: the program's excepthook is left alone,
and ranks started with different ring settings refuse to start."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from dataclasses import replace

import pytest

from ringserve.config import EngineConfig
from ringserve.models.builtin import builtin_model_dir
from ringserve.ring.group import close_group, init_group


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_joining_and_leaving_groups_keeps_the_excepthook():
    hook = sys.excepthook
    for _ in range(2):  # torch would wrap the hook once per group joined
        init_group(0, 1, "127.0.0.1", _free_port(), connect_timeout_s=10)
        try:
            assert sys.excepthook is hook
        finally:
            close_group()
    assert sys.excepthook is hook


PEER = """
import sys
from ringserve.ring.group import RingMismatch, close_group, init_group
rank, port, terms = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].encode()
try:
    init_group(rank, 2, "127.0.0.1", port, connect_timeout_s=30, terms=terms)
    print("joined", flush=True)
except RingMismatch as exc:
    print("refused:", exc, flush=True)
finally:
    close_group()
"""


def join_two(terms: tuple[str, str]) -> list[str]:
    """Two real ranks over gloo, each given its own terms: the last line each printed."""
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PEER, str(rank), str(port), terms[rank]],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        return [p.communicate(timeout=60)[0].strip().splitlines()[-1] for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.timeout(120)
def test_ranks_given_the_same_terms_join_and_ranks_given_others_are_refused():
    assert join_two(("split 2,2", "split 2,2")) == ["joined", "joined"]
    said = join_two(("split 2,2", "split 3,1"))
    assert all(s.startswith("refused: ranks [1] were started with ring settings") for s in said)


@pytest.mark.timeout(120)
def test_a_refusal_names_what_differs():
    ours = {"layer_split": [2, 2], "model_config": {"rms_norm_eps": 1e-5, "vocab_size": 2048}}
    theirs = {"layer_split": [2, 2], "model_config": {"rms_norm_eps": 1e-6, "vocab_size": 2048}}
    said = join_two((json.dumps(ours), json.dumps(theirs)))
    assert all("rank 1: config.json rms_norm_eps 1e-06 (rank 0's: 1e-05)" in s for s in said), said
    assert all("layer_split" not in s and "vocab_size" not in s for s in said), said


def test_ring_terms_cover_what_shapes_the_ring_and_not_what_each_rank_chooses(tmp_path):
    model = builtin_model_dir()
    base = EngineConfig(model_dir=model, layer_split=(2, 2), kv_capacity_tokens=4096)
    same = [
        replace(base, torch_threads=3),
        replace(base, device="cpu"),
        replace(base, cpu_kernels="torch"),
        replace(base, plan={"ranks": []}),
    ]
    copy = tmp_path / "elsewhere"  # the same model at another path, as on another machine
    shutil.copytree(model, copy)
    same.append(replace(base, model_dir=copy))
    resaved = tmp_path / "resaved"  # and its config.json saved by another tool
    shutil.copytree(model, resaved)
    config = json.loads((model / "config.json").read_text())
    (resaved / "config.json").write_text(json.dumps(dict(reversed(config.items()))))
    assert (resaved / "config.json").read_text() != (model / "config.json").read_text()
    same.append(replace(base, model_dir=resaved))
    assert all(c.ring_terms() == base.ring_terms() for c in same)
    other = [
        replace(base, layer_split=(3, 1)),
        replace(base, kv_capacity_tokens=8192),
        replace(base, dtype="bfloat16"),
        replace(base, max_tokens_per_pass=256),
    ]
    assert all(c.ring_terms() != base.ring_terms() for c in other)


def test_a_node_takes_the_ring_terms_of_node_0_and_keeps_its_own_choices():
    model = builtin_model_dir()
    node0 = EngineConfig(
        model_dir=model, layer_split=(1, 3), kv_capacity_tokens=4096, plan={"ranks": [1]}
    )
    mine = EngineConfig(
        model_dir=model, layer_split=(3, 1), device="cpu", cpu_kernels="torch", torch_threads=2
    )
    taken = mine.with_ring_of(node0)
    assert taken.ring_terms() == node0.ring_terms()
    assert (taken.layer_split, taken.kv_capacity_tokens, taken.plan) == ((1, 3), 4096, node0.plan)
    assert (taken.device, taken.cpu_kernels, taken.torch_threads) == ("cpu", "torch", 2)
