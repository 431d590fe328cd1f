"""Progress a person watches: weight-loading lines from a rank, throttled,
and vLLM's tqdm bar over LLM.generate."""

from __future__ import annotations

import torch

from ringserve import LLM, SamplingParams
from ringserve.launch.progress import LoadProgress
from ringserve.models.builtin import builtin_model_dir
from ringserve.models.config import ModelConfig
from ringserve.models.loader import load_model


def test_loading_reports_progress_lines_only_as_often_as_asked(capsys):
    model_dir = builtin_model_dir()
    cfg = ModelConfig.from_dir(model_dir)
    layers = range(cfg.num_layers)
    load_model(model_dir, cfg, layers, torch.float32, progress=LoadProgress(3, every_s=0.0))
    lines = capsys.readouterr().err.splitlines()
    assert lines and all(line.startswith("ringserve: rank 3 loading weights ") for line in lines)
    shares = [int(line.split("weights ")[1].split("%")[0]) for line in lines]
    assert shares == sorted(shares) and shares[-1] < 100  # the finished load is report_loaded's
    load_model(model_dir, cfg, layers, torch.float32, progress=LoadProgress(3))
    assert capsys.readouterr().err == ""  # a load under 2 s prints nothing


def test_generate_shows_a_tqdm_bar_unless_told_not_to(capsys):
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with LLM(kv_capacity_tokens=1024) as llm:
        capsys.readouterr()
        llm.generate(["a", "b", "c"], params)
        bar = capsys.readouterr().err
        llm.generate(["a", "b", "c"], params, use_tqdm=False)
        quiet = capsys.readouterr().err
    assert "Processed prompts: 100%" in bar and "3/3" in bar and "output: " in bar
    assert "Processed prompts" not in quiet
