"""bench/gpu_check.py on a machine without CUDA: it imports, parses its
arguments, and refuses to run with a message saying why."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_parses_its_arguments(gpu_check):
    args = gpu_check.parse_args(["--quick", "--models", "8b", "--layers", "4", "--skip-tests"])
    assert (args.quick, args.models, args.layers, args.skip_tests) == (True, "8b", 4, True)
    assert gpu_check.parse_args([]).models == "1b,8b"
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--models", "70b"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_gpu_check_refuses_to_run_without_cuda(gpu_check, capsys):
    assert gpu_check.main(["--quick"]) == gpu_check.NO_CUDA_EXIT
    assert "no CUDA device" in capsys.readouterr().err


def test_gpu_check_runs_every_kernel_and_gpu_test_file_with_the_interpreter_off(
    gpu_check, monkeypatch
):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cmd, env = gpu_check.kernel_test_command()
    assert env["TRITON_INTERPRET"] == "0"
    tests = SCRIPT.parent.parent.joinpath("tests")
    here = sorted(p.name for g in ("test_kernels_*.py", "test_gpu_*.py") for p in tests.glob(g))
    assert sorted(Path(a).name for a in cmd if a.startswith("tests/")) == here
    assert {"test_kernels_attention.py", "test_gpu_engine.py"} <= set(here)
