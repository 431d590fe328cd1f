"""`ringserve bench`: its figures from known timings, the ShareGPT reader,
and a run against a real launched ring serving a Hub id from an offline
cache, whose /metrics must agree with what the benchmark saw."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

from ringserve.benchmark.datasets import random_requests, sharegpt_requests
from ringserve.benchmark.request import RequestResult
from ringserve.benchmark.results import parse_goodput, report, summarise
from tests.hub_cache import REPO_ID, offline_env, write_hub_cache
from tests.launched import Launched


def test_figures_are_vllms_from_known_timings():
    a = RequestResult(10, True, ttft=0.1, latency=0.5, itl=[0.2, 0.2], output_tokens=3)
    b = RequestResult(20, True, ttft=0.3, latency=0.3, itl=[], output_tokens=1)
    failed = RequestResult(5, error="HTTP 500: boom")
    out = summarise(
        [a, b, failed],
        2.0,
        percentiles=[50.0, 99.0],
        slos=parse_goodput(["ttft:200"]),
        metrics=["ttft", "tpot", "itl", "e2el"],
    )
    assert out["completed"] == 2 and out["failed"] == 1 and out["errors"] == ["HTTP 500: boom"]
    assert out["total_input_tokens"] == 30 and out["total_output_tokens"] == 4
    assert out["request_throughput"] == 1.0 and out["output_throughput"] == 2.0
    assert out["total_token_throughput"] == 17.0
    assert out["request_goodput"] == 0.5  # only a meets TTFT <= 200 ms
    assert out["mean_ttft_ms"] == pytest.approx(200.0)
    assert out["median_e2el_ms"] == pytest.approx(400.0)
    assert out["mean_tpot_ms"] == pytest.approx(200.0)  # (0.5 - 0.1) / 2; b has one token
    assert out["p99_itl_ms"] == pytest.approx(200.0)
    text = report(out, max_concurrency=None, request_rate=float("inf"))
    assert "Request goodput (req/s):                 0.50" in text
    assert "P99 TTFT (ms):" in text and "Median E2EL (ms):" in text


def test_sharegpt_takes_first_turns_and_drops_short_ones(tmp_path):
    long = "tell me about the rivers of the north in detail please"
    data = [
        {"id": "a", "conversations": [{"from": "human", "value": long},
                                      {"from": "gpt", "value": "they run cold and fast to sea"}]},
        {"id": "b", "conversations": [{"from": "human", "value": "hi"},
                                      {"from": "gpt", "value": "hello there my good friend"}]},
        {"id": "c", "conversations": [{"from": "human", "value": long}]},
    ]  # fmt: skip
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    (req,) = sharegpt_requests(path, 1)
    assert req.prompt == long and req.prompt_len == 11 and req.expected_output_len == 7
    with pytest.raises(ValueError, match="1 usable conversations .*, fewer than --num-prompts 2"):
        sharegpt_requests(path, 2)
    path.write_text(json.dumps({"conversations": data}))  # an object, not a list
    with pytest.raises(ValueError, match="a ShareGPT file is a list"):
        sharegpt_requests(path, 1)


def test_random_prompts_have_the_asked_lengths():
    reqs = random_requests(4, 12, 5, prefix_len=3, seed=1)
    assert [r.prompt_len for r in reqs] == [15] * 4
    assert len({tuple(r.prompt.split()[:3]) for r in reqs}) == 1  # the shared prefix
    assert len({r.prompt for r in reqs}) == 4


def test_bench_counts_the_built_in_models_prompts_in_its_tokens(capsys):
    """The built-in model is served under its directory's name, which is no
    Hub id: bench still finds its tokenizer, and says so when it has none."""
    from ringserve.benchmark.serve import _tokenizer
    from ringserve.models.builtin import BUILTIN_VERSION

    tok = _tokenizer(None, BUILTIN_VERSION)
    assert tok is not None and tok.vocab_size == 2048
    assert capsys.readouterr().err == ""
    assert _tokenizer(None, "no-such-org/no-such-model") is None
    assert "counted in words" in capsys.readouterr().err


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {
        k: float(v)
        for k, _, v in (line.rpartition(" ") for line in text.splitlines())
        if k and not k.startswith("#")
    }


@pytest.mark.timeout(240)
def test_bench_against_a_launched_ring_serving_a_hub_id(tmp_path):
    hf_home = tmp_path / "hf"
    write_hub_cache(hf_home)
    env = offline_env(hf_home)
    args = ("--model", REPO_ID, "--served-model-name", "tiny", "--pp", "2",
            "--kv-capacity-tokens", "4096", "--heartbeat-s", "0.2")  # fmt: skip
    with Launched(*args, env=env) as server:
        with urllib.request.urlopen(server.url + "/v1/models", timeout=5) as resp:
            assert [m["id"] for m in json.load(resp)["data"]] == ["tiny"]
        cmd = [sys.executable, "-m", "ringserve", "bench", "--base-url", server.url,
               "--num-prompts", "6", "--request-rate", "20", "--max-concurrency", "3",
               "--random-input-len", "12", "--random-output-len", "8", "--ignore-eos",
               "--tokenizer", REPO_ID, "--json", "--goodput", "e2el:60000"]  # fmt: skip
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=120, env={**os.environ, **env}
        )
        assert done.returncode == 0, done.stderr
        out = json.loads(done.stdout)
        assert out["model"] == "tiny" and out["completed"] == 6 and out["failed"] == 0
        assert out["total_output_tokens"] == 48 and out["request_goodput"] > 0
        assert 0 < out["median_ttft_ms"] <= out["median_e2el_ms"] and out["mean_itl_ms"] > 0
        # the server counted what the client saw
        m = metrics(server.url)
        assert m['ringserve:request_success_total{finished_reason="length",model_name="tiny"}'] == 6
        assert m['ringserve:generation_tokens_total{model_name="tiny"}'] == 48
        assert m['ringserve:prompt_tokens_total{model_name="tiny"}'] == out["total_input_tokens"]
        assert m['ringserve:e2e_request_latency_seconds_count{model_name="tiny"}'] == 6
        assert m['ringserve:request_generation_tokens_sum{model_name="tiny"}'] == 48
        assert (
            m['ringserve:request_prompt_tokens_sum{model_name="tiny"}'] == out["total_input_tokens"]
        )
        assert m['ringserve:num_requests_running{model_name="tiny"}'] == 0
        # rank 1's own totals come round with the idle heartbeats
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            m = metrics(server.url)
            zero = m['ringserve_rank_forwards_total{rank="0"}']
            if (
                m.get('ringserve_rank_forwards_total{rank="1"}')
                == zero
                == m["ringserve_passes_total"]
            ):
                break
            time.sleep(0.2)
        assert m.get('ringserve_rank_forwards_total{rank="1"}') == m["ringserve_passes_total"] > 0
        assert m['ringserve_rank_sent_bytes_total{rank="1"}'] > 0
        assert m['ringserve_rank_forward_seconds_total{rank="1"}'] > 0
