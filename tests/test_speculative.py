"""Speculative decoding with prompt-lookup proposals: greedy outputs equal
transformers token for token (pp 1 and pp 3, prefix reuse, chunked prefill,
a tight KV pool, voided passes), the rejected slots come back, the log
replays exactly, and the proposer finds what it should."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from ringserve import LLM, SamplingParams
from ringserve.config import EngineConfig, speculative_options
from ringserve.replay import replay
from ringserve.sched.ngram import NgramIndex
from tests import model_factory
from tests.workloads import hf_greedy

NEW_TOKENS = 20
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
SPEC = dict(speculative="ngram", num_speculative_tokens=4, ngram_max=3, ngram_min=1)
ENGINE = dict(chunk_size=16, max_tokens_per_pass=48, kv_capacity_tokens=512, **SPEC)


def copying_prompts(hf, vocab: int, seed: int = 0) -> list[list[int]]:
    """Prompts that hold a text the model wrote and then begin it again (so
    the answer mostly repeats it), sharing a prefix, one long enough to be
    chunked, and one plain random prompt."""
    rng = random.Random(seed)
    shared = [rng.randrange(2, vocab) for _ in range(24)]
    prompts = []
    for n in (3, 6, 40):
        text = hf_greedy(hf, [rng.randrange(2, vocab) for _ in range(n)], 24)
        prompts.append(shared + text + [rng.randrange(2, vocab)] + text[:2])
    prompts.append([rng.randrange(2, vocab) for _ in range(9)])
    return prompts


@pytest.fixture(scope="module")
def copier(tmp_path_factory):
    path = model_factory.llama_copy(tmp_path_factory.mktemp("copy"), layers=3, embed_std=0.015)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = copying_prompts(hf, hf.config.vocab_size)
    return path, prompts, [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]


def assert_clean(llm: LLM) -> None:
    sched = llm._ring.conductor.scheduler
    census = sched.census()
    assert census.held_by_running == 0 and census.cached_locked == 0
    assert census.free + census.cached_unlocked == census.capacity - 1


def test_greedy_with_ngram_speculation_equals_transformers(copier):
    path, prompts, expected = copier
    with LLM(path, **ENGINE) as llm:
        first = llm.generate(prompts, GREEDY)
        again = llm.generate(prompts, GREEDY)
        stats = llm._ring.conductor.scheduler.speculation.stats
        assert_clean(llm)
    assert [o.token_ids for o in first] == expected
    assert [o.token_ids for o in again] == expected
    assert any(o.cached_tokens >= 16 for o in first), "the shared prefix was never reused"
    assert stats.accepted > 0 and stats.freed > 0, stats  # both outcomes ran
    assert stats.accepted_at[1] > 0, "no verification accepted two proposals"


def test_seeded_sampling_speculating_is_the_sampling_without_it(copier):
    """A sampled position emits its own seeded draw (accepting a proposal
    only when the draw is it), so a seeded request's output does not depend
    on how many tokens its passes proposed, nor on what shared them."""
    path, prompts, _ = copier
    # the copier is all but deterministic; this temperature flattens it so
    # that draws both take and refuse the proposals (and the rule of
    # accepting with the proposal's probability gave other outputs: 3 of 4)
    params = [
        SamplingParams(max_tokens=NEW_TOKENS, temperature=20.0, seed=s, ignore_eos=True)
        for s in range(len(prompts))
    ]
    plain_options = {k: v for k, v in ENGINE.items() if k not in SPEC}
    with LLM(path, **plain_options) as llm:
        plain = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM(path, **ENGINE) as llm:
        together = [o.token_ids for o in llm.generate(prompts, params)]
        alone = [llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params, strict=True)]
        stats = llm._ring.conductor.scheduler.speculation.stats
        assert_clean(llm)
    assert stats.accepted > 0 and stats.freed > 0, stats  # proposals both taken and refused
    assert together == plain and alone == plain


@pytest.mark.timeout(240)
def test_ring_of_three_with_voids_equals_transformers_and_replays(copier, tmp_path, monkeypatch):
    path, prompts, expected = copier
    monkeypatch.setenv("RINGSERVE_FAULTS", "void:rank=1:every=7")
    llm = LLM(path, pp_size=3, log_dir=str(tmp_path), **ENGINE)
    sampled = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.7, seed=5, ignore_eos=True)
    try:
        outs = llm.generate(prompts + prompts[:2], [GREEDY] * len(prompts) + [sampled] * 2)
        sched = llm._ring.conductor.scheduler
        assert sched.voids >= 2 and sched.speculation.stats.accepted > 0
        assert_clean(llm)
    finally:
        llm.close()
    assert [o.token_ids for o in outs[: len(prompts)]] == expected
    assert all(len(o.token_ids) == NEW_TOKENS for o in outs[len(prompts) :])
    report = replay(tmp_path)
    assert report.consistent, report.render()
    assert report.rerun.reproduced and report.rerun.decisions == report.passes


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    """A smaller model of the copier's vocabulary and successor map."""
    tmp = tmp_path_factory.mktemp("draft")
    return model_factory.llama_copy(
        tmp, "draft", hidden=32, intermediate=64, layers=1, heads=2, kv_heads=1, scramble=0.3
    )


@pytest.mark.parametrize("pp_size", [1, 3])
def test_greedy_with_a_draft_model_equals_transformers(copier, draft_dir, tmp_path, pp_size):
    path, prompts, expected = copier
    options = dict(ENGINE, speculative="draft", draft_model=str(draft_dir))
    llm = LLM(path, pp_size=pp_size, log_dir=str(tmp_path), **options)
    try:
        outs = llm.generate(prompts, GREEDY)
        sched = llm._ring.conductor.scheduler
        stats = sched.speculation.stats
        assert stats.accepted > 0 and stats.freed > 0, stats
        assert_clean(llm)
        drafter = llm._ring.conductor.drafter
        assert not drafter.rows and drafter.allocator.available == drafter.pool.capacity - 1
    finally:
        llm.close()
    assert [o.token_ids for o in outs] == expected
    report = replay(tmp_path)
    assert report.consistent, report.render()
    assert report.rerun.reproduced and report.rerun.decisions == report.passes


def test_the_draft_stays_within_the_planned_pass_and_its_own_positions(
    copier, draft_dir, tmp_path, monkeypatch
):
    """A request's first proposal catches the draft up on its whole prompt:
    in forwards no larger than the largest pass (what the plan holds the
    draft's activations for), never one forward of every prompt at once; and
    a draft with fewer positions than the served context never runs past
    them (a draft with learned positions would fail the pass: an index out
    of range). Outputs stay the target's."""
    import json
    import shutil

    from ringserve.engine import drafter as drafter_module

    short = tmp_path / "short_draft"
    shutil.copytree(draft_dir, short)
    config = json.loads((short / "config.json").read_text())
    config["max_position_embeddings"] = 70
    (short / "config.json").write_text(json.dumps(config))
    real = drafter_module.ForwardBatch
    forwards: list[tuple[int, int]] = []  # (longest row, tokens) of each draft forward

    class Watched:
        @staticmethod
        def build(rows, sizes, *args, **kwargs):
            forwards.append((max(map(len, rows)), sum(sizes)))
            return real.build(rows, sizes, *args, **kwargs)

    monkeypatch.setattr(drafter_module, "ForwardBatch", Watched)
    path, prompts, expected = copier
    assert max(len(p) for p in prompts) + NEW_TOKENS > 70
    options = dict(ENGINE, speculative="draft", draft_model=str(short))
    with LLM(path, **options) as llm:
        forwards.clear()  # the boot audit's dry forward: the plan's own worst case
        outs = llm.generate(prompts, GREEDY)
        assert llm._ring.conductor.scheduler.speculation.stats.accepted > 0
    assert [o.token_ids for o in outs] == expected
    assert forwards and max(n for _, n in forwards) <= ENGINE["max_tokens_per_pass"], forwards
    assert max(longest for longest, _ in forwards) <= 70, forwards


def test_stop_token_inside_accepted_tokens_ends_the_request_there(copier):
    path, prompts, expected = copier
    stop = expected[0][NEW_TOKENS // 2]
    cut = expected[0].index(stop) + 1
    params = SamplingParams(
        max_tokens=NEW_TOKENS, temperature=0, stop_token_ids=[stop], ignore_eos=True
    )
    with LLM(path, **ENGINE) as llm:
        out = llm.generate(prompts[0], params)[0]
        assert_clean(llm)
    assert out.token_ids == expected[0][:cut] and out.finish_reason == "stop"


def test_ngram_proposes_what_followed_the_longest_newest_match():
    def propose(history, n_max, n_min, k):
        return NgramIndex().propose(history, n_max, n_min, k)

    # [6, 7] occurs twice before the end; the newest wins: 2, 3 followed it
    assert propose([5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 6, 7], 3, 2, 3) == [2, 3, 6]
    # a longer match ([8, 6, 7]) beats a newer, shorter one ([6, 7])
    assert propose([8, 6, 7, 4, 4, 1, 6, 7, 5, 0, 8, 6, 7], 3, 1, 2) == [4, 4]
    assert propose([1, 2, 3, 4], 3, 1, 2) == []  # nothing recurs
    assert propose([9, 9, 9], 3, 3, 2) == []  # too short to match 3
    assert propose([1, 2, 1, 2], 2, 2, 4) == [1, 2]  # the continuation ends at the end


def test_ngram_index_grows_with_the_history():
    index, history = NgramIndex(), [4, 5, 6]
    assert index.propose(history, 2, 1, 2) == []
    history += [4, 5]
    assert index.propose(history, 2, 1, 2) == [6, 4]


def test_vllm_speculative_config_maps_onto_engine_options(tmp_path):
    options = speculative_options(
        {
            "method": "ngram",
            "num_speculative_tokens": 5,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        }
    )
    config = EngineConfig(model_dir=tmp_path, **options)
    assert config.speculative_tokens == 5 and (config.ngram_max, config.ngram_min) == (4, 2)
    with pytest.raises(ValueError, match="unknown keys"):
        speculative_options({"method": "ngram", "lookahead": 3})
    with pytest.raises(ValueError, match="ngram_min"):
        EngineConfig(model_dir=tmp_path, speculative="ngram", ngram_min=5, ngram_max=2)
    with pytest.raises(ValueError, match="speculative must be"):
        EngineConfig(model_dir=tmp_path, speculative="medusa")


def test_launch_options_reach_the_engine_config():
    from ringserve.cli import _config, main, parser
    from ringserve.models.builtin import builtin_model_dir

    model = str(builtin_model_dir())

    def config(*argv: str) -> EngineConfig:
        return _config(parser().parse_args(["launch", "--model", model, *argv]))

    plain = config("--speculative", "ngram", "--num-speculative-tokens", "3", "--ngram-min", "1")
    assert (plain.speculative, plain.speculative_tokens, plain.ngram_min) == ("ngram", 3, 1)
    vllm = config("--speculative-config", '{"method": "ngram", "prompt_lookup_max": 5}')
    assert vllm.speculative == "ngram" and vllm.ngram_max == 5
    assert not config("--speculative", "ngram", "--no-adaptive-speculation").speculative_adaptive
    assert config().speculative_tokens == 0
    assert main(["launch", "--model", model, "--speculative", "draft"]) == 2
    assert main(["launch", "--model", model, "--speculative-config", "{nope"]) == 2
    # the same option set two ways to two values: which was meant cannot be told
    same = config("--speculative", "ngram", "--speculative-config", '{"method": "ngram"}')
    assert same.speculative == "ngram"
    for argv in (
        ["--speculative", "ngram", "--speculative-config", '{"method": "draft", "model": "/x"}'],
        ["--num-speculative-tokens", "3", "--speculative-config", '{"method": "ngram", '
         '"num_speculative_tokens": 5}'],
        ["--speculative", "draft", "--draft-model", "/a", "--speculative-config",
         '{"method": "draft", "model": "/b"}'],
    ):  # fmt: skip
        with pytest.raises(ValueError, match="give it once"):
            config(*argv)
    with pytest.raises(ValueError, match="sets draft_model to '/b'"):
        LLM(draft_model="/a", speculative_config={"method": "draft", "model": "/b"})


def test_a_stop_string_inside_one_pass_of_tokens_ends_the_output_there():
    """A verification brings several tokens at once; none past the stop
    string is the request's output (as if they had come one per pass)."""
    from ringserve.engine.handle import RequestHandle
    from ringserve.engine.textstream import TextStream
    from ringserve.models.builtin import builtin_model_dir
    from ringserve.models.tokenizer import Tokenizer
    from ringserve.sched.request import RequestFactory

    tok = Tokenizer.from_dir(builtin_model_dir())
    ids = tok.encode("one two three four five")
    req = RequestFactory(frozenset())([1], SamplingParams(max_tokens=20, stop=["three"]))
    handle = RequestHandle(req, TextStream(tok, ("three",)))
    req.output.extend(ids)  # one pass brought them all
    delta = handle.take_new_tokens()
    cut = handle.kept
    assert "three" in tok.decode(ids[:cut]) and "three" not in tok.decode(ids[: cut - 1])
    assert delta.token_ids == ids[:cut] and delta.text == "one two "
    assert handle.output().token_ids == ids[:cut] and cut < len(ids)


def test_penalized_requests_verify_with_their_penalties(copier):
    """Each verified position is judged on the logits its own draw would
    see (penalties over its context, the accepted proposals included), so
    speculation changes nothing for penalized or biased requests."""
    path, prompts, _ = copier
    penalized = [
        SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, **extra)
        for extra in (
            {"repetition_penalty": 1.3},
            {"frequency_penalty": 2.0, "presence_penalty": 2.0},
            {"logit_bias": {7: 100.0}, "repetition_penalty": 1.1},
            {"repetition_penalty": 4.0},
        )
    ]
    with LLM(path, **ENGINE) as llm:
        spec = [o.token_ids for o in llm.generate(prompts, penalized)]
        stats = llm._ring.conductor.scheduler.speculation.stats
        assert_clean(llm)
    plain = {k: v for k, v in ENGINE.items() if k not in SPEC}
    with LLM(path, **plain) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, penalized)]
    assert spec == expected
    assert stats.verifications > 0 and stats.accepted > 0, stats


def test_a_grammar_constrained_request_beside_speculating_ones_keeps_its_mask():
    """A constrained request proposes nothing, but its row may share a pass
    with verification rows: its mask applies there too."""
    from ringserve import StructuredOutputsParams
    from ringserve.models.builtin import builtin_model_dir

    choice = StructuredOutputsParams(choice=("alpha beta", "gamma", "delta epsilon zeta"))
    text = "one two three four five six seven eight " * 3
    params = [GREEDY] * 3 + [
        SamplingParams(max_tokens=16, temperature=0, structured_outputs=choice)
    ]
    prompts = [text, text + "one", text + "one two", "pick one:"]
    with LLM(builtin_model_dir(), **ENGINE) as llm:
        outs = llm.generate(prompts, params)
        stats = llm._ring.conductor.scheduler.speculation.stats
    assert outs[3].outputs[0].text in choice.choice
    assert stats.verifications > 0, stats


def test_a_stop_token_inside_a_verified_run_ends_the_request_and_the_count_there(copier):
    """Tokens a verification accepted past a stop token are not the
    request's, and /metrics does not count them as generated."""
    path, prompts, expected = copier
    at = next(i for i in range(4, NEW_TOKENS) if expected[0][i] not in expected[0][:i])
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, stop_token_ids=[expected[0][at]])
    with LLM(path, **ENGINE) as llm:
        (out,) = llm.generate(prompts[:1], params, use_tqdm=False)
        conductor = llm._ring.conductor
        stats = conductor.scheduler.speculation.stats
        assert stats.accepted > 0, stats
        assert conductor.metrics.generation_tokens == len(out.token_ids)
    assert out.token_ids == expected[0][: at + 1]
    assert out.finish_reason == "stop"
