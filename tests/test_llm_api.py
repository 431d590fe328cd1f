"""The offline API as a user coming from vLLM uses it: sampling parameters
refused by field when mistyped (never reaching the ring), vLLM's prompt
forms, chat messages in OpenAI's shape, Ctrl-C and close() in the middle of
a generate, stop strings after min_tokens, and one ring per process."""

from __future__ import annotations

import _thread
import io
import math
import subprocess
import sys
import threading
import time

import pytest
import structlog
from tqdm import tqdm

from ringserve import LLM, SamplingParams
from tests.model_factory import llama_deep

pytestmark = pytest.mark.timeout(120)

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
MESSAGES = [{"role": "user", "content": "Tell me about foxes."}]

MISTYPED = {
    "seed": 1.5,
    "logprobs": True,
    "top_k": 2.5,
    "temperature": "0.5",
    "top_p": None,
    "max_tokens": True,
    "ignore_eos": "yes",
    "n": 1.0,
    "stop": 5,
    "stop_token_ids": ["a"],
    "logit_bias": [1, 2],
    "structured_outputs": "json",
}


@pytest.mark.parametrize("field", list(MISTYPED))
def test_a_mistyped_parameter_is_refused_by_name(field):
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**{field: MISTYPED[field]})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("seed", 2**70),
        ("logprobs", 2.5),
        ("prompt_logprobs", 99),
        ("presence_penalty", math.inf),
        ("logit_bias", {5: math.nan}),
        ("structured_outputs", {"foo": 1}),
    ],
)
def test_a_value_out_of_its_range_is_refused_by_name(field, value):
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**{field: value})


def test_top_k_zero_is_off_and_lists_become_tuples():
    params = SamplingParams(top_k=0, stop="x", stop_token_ids=[3], bad_words="y")
    assert params.top_k == -1
    assert params.stop == ("x",) and params.stop_token_ids == (3,) and params.bad_words == ("y",)


def test_vllms_switches_at_their_defaults_are_taken_and_other_values_refused_by_name():
    """vLLM code passes them, at their defaults, or leaves the lists None."""
    params = SamplingParams(
        n=2, best_of=2, max_tokens=None, stop=None, stop_token_ids=None, bad_words=None,
        skip_special_tokens=True, spaces_between_special_tokens=True,
        include_stop_str_in_output=False, detokenize=True,
    )  # fmt: skip
    assert params.max_tokens is None and params.stop == params.bad_words == ()
    assert params.clone() == params and params.clone() is not params
    others = {"best_of": 3, "skip_special_tokens": False, "spaces_between_special_tokens": False,
              "include_stop_str_in_output": True, "detokenize": False}  # fmt: skip
    for field, value in others.items():
        with pytest.raises(ValueError, match=f"^{field}"):
            SamplingParams(**{field: value})
    with pytest.raises(ValueError, match="^pp_size"):
        LLM(pp_size="2")


def test_an_llm_seed_makes_unseeded_sampling_repeat_from_run_to_run():
    sampled = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    runs = []
    for seed in (7, 7, 8):
        with LLM(seed=seed, tensor_parallel_size=1) as llm:
            runs.append([o.token_ids for o in llm.generate(["a", "b"], sampled, use_tqdm=False)])
    assert runs[0] == runs[1] and runs[0] != runs[2]
    assert runs[0][0] != runs[0][1]  # each request draws its own seed
    with pytest.raises(TypeError, match=r"unknown options \['gpu_memory_utilization'\]"):
        LLM(gpu_memory_utilization=0.9)
    with pytest.raises(ValueError, match="^tensor_parallel_size must be 1"):
        LLM(tensor_parallel_size=2)


@pytest.mark.timeout(120)
def test_max_tokens_none_runs_to_the_context_and_stop_strings_need_a_tokenizer(tmp_path):
    with LLM(llama_deep(tmp_path), max_model_len=24) as small:  # no tokenizer.json
        (out,) = small.generate(
            [[5, 6, 7, 8]], SamplingParams(max_tokens=None, ignore_eos=True), use_tqdm=False
        )
        assert (len(out.token_ids), out.finish_reason) == (20, "length")
        with pytest.raises(ValueError, match="stop strings need a tokenizer"):
            small.generate([[5, 6]], SamplingParams(stop="a"), use_tqdm=False)
        with pytest.raises(ValueError, match="min_tokens 30 is more than the 24 tokens"):
            small.generate([[5, 6]], SamplingParams(max_tokens=None, min_tokens=30), use_tqdm=False)
        assert small.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)[0].token_ids


@pytest.fixture(scope="module")
def llm():
    with LLM(max_batch=8) as llm:
        yield llm


def test_vllms_prompt_forms_give_the_same_output(llm):
    (plain,) = llm.generate(["Once upon a time"], GREEDY, use_tqdm=False)
    forms = [{"prompt": "Once upon a time"}, {"prompt_token_ids": plain.prompt_token_ids}]
    outs = llm.generate(forms, sampling_params=GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [plain.token_ids] * 2
    assert outs[0].prompt == "Once upon a time"


@pytest.mark.parametrize(
    "prompt", [b"abc", [[5, 1.9]], [[5, True]], {"prompt": "x", "extra": 1}, 42]
)
def test_a_prompt_of_no_known_form_is_refused(llm, prompt):
    with pytest.raises((TypeError, ValueError)):
        llm.generate(prompt, GREEDY, use_tqdm=False)
    assert llm.generate(["still serving"], GREEDY, use_tqdm=False)[0].token_ids


def test_chat_takes_openais_message_shapes(llm):
    plain = [{"role": "system", "content": "Be brief."}, *MESSAGES]
    shaped = [
        {"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
        *MESSAGES,
    ]  # fmt: skip
    (want,) = llm.chat(plain, GREEDY, use_tqdm=False)
    (got,) = llm.chat(shaped, GREEDY, use_tqdm=False)
    assert got.prompt_token_ids == want.prompt_token_ids and got.token_ids == want.token_ids
    with pytest.raises(ValueError, match="text parts"):
        llm.chat([{"role": "user", "content": [{"type": "image_url"}]}], GREEDY, use_tqdm=False)


def test_chat_takes_openais_tool_call_turns(llm):
    """An assistant turn of tool calls has no content and JSON text for
    arguments (OpenAI's shape); the template reads empty text and objects,
    as for the HTTP API."""

    def conversation(content: str | None, arguments: object) -> list[dict]:
        call = {"id": "c1", "type": "function",
                "function": {"name": "get_weather", "arguments": arguments}}  # fmt: skip
        return [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": content, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ]

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]  # fmt: skip
    (want,) = llm.chat(conversation("", {"city": "Paris"}), GREEDY, tools=tools, use_tqdm=False)
    (got,) = llm.chat(conversation(None, '{"city": "Paris"}'), GREEDY, tools=tools, use_tqdm=False)
    assert '"arguments": {"city": "Paris"}' in want.prompt
    assert got.prompt == want.prompt and got.token_ids == want.token_ids
    with pytest.raises(ValueError, match="^continue_final_message"):
        llm.chat(MESSAGES, GREEDY, continue_final_message=True, use_tqdm=False)
    llm.chat(MESSAGES, GREEDY, continue_final_message=False, chat_template=None, use_tqdm=False)


def test_best_of_equal_to_n_makes_n_choices(llm):
    (out,) = llm.generate(["x"], SamplingParams(n=2, best_of=2, max_tokens=3), use_tqdm=False)
    assert len(out.outputs) == 2 and all(len(c.token_ids) == 3 for c in out.outputs)


def test_use_tqdm_may_be_the_bars_factory(llm):
    made: list[dict] = []

    def factory(**options: object) -> tqdm:
        made.append(options)
        return tqdm(**options, disable=True)

    llm.generate(["a", "b"], GREEDY, use_tqdm=factory)
    assert len(made) == 1 and made[0]["total"] == 2


def test_the_bar_counts_prompts_whatever_their_choices(llm):
    bars: list[tqdm] = []

    def factory(**options: object) -> tqdm:
        bars.append(tqdm(**options, file=io.StringIO()))
        return bars[-1]

    two = SamplingParams(n=2, max_tokens=3, temperature=0.8, seed=1, ignore_eos=True)
    three = SamplingParams(n=3, max_tokens=2, temperature=0.8, seed=2, ignore_eos=True)
    outs = llm.generate(["a", "b", "c"], [two, GREEDY, three], use_tqdm=factory)
    assert [len(o.outputs) for o in outs] == [2, 1, 3]
    (bar,) = bars
    assert bar.total == 3 and bar.n == 3  # prompts, as vLLM's bar; not the six requests


def test_stop_strings_count_from_min_tokens_on(llm):
    (free,) = llm.generate(["Once upon a time"], GREEDY, use_tqdm=False)
    stop = free.text[:1]
    assert stop, free
    (early,) = llm.generate(["Once upon a time"], SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True, stop=stop), use_tqdm=False)  # fmt: skip
    assert early.finish_reason == "stop" and early.text == ""
    assert early.stop_reason == early.outputs[0].stop_reason == stop  # vLLM's field
    assert free.stop_reason is None
    at = free.token_ids[2]
    (by_id,) = llm.generate(["Once upon a time"], SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True, stop_token_ids=[at]), use_tqdm=False)  # fmt: skip
    assert (by_id.finish_reason, by_id.stop_reason) == ("stop", at)
    cut = free.token_ids.index(at)
    assert by_id.token_ids == free.token_ids[: cut + 1]  # the stop token's id is kept,
    assert by_id.text == llm.tokenizer.decode(free.token_ids[:cut])  # its text is not
    (late,) = llm.generate(["Once upon a time"], SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True, stop=stop, min_tokens=4), use_tqdm=False)  # fmt: skip
    assert len(late.token_ids) >= 4 and late.text.startswith(free.text[:1])


def _long_work(llm: LLM) -> None:
    long = SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True)
    llm.generate([f"story {i}" for i in range(32)], long, use_tqdm=False)  # a minute or more


def test_ctrl_c_in_generate_aborts_its_requests(llm):
    threading.Timer(0.5, _thread.interrupt_main).start()
    began = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        _long_work(llm)
    assert time.monotonic() - began < 10, "the interrupt waited for the work to end"
    scheduler = llm._ring.conductor.scheduler
    deadline = time.monotonic() + 3
    while not scheduler.idle and time.monotonic() < deadline:
        time.sleep(0.05)
    assert scheduler.idle, "the interrupted requests still run"
    began = time.monotonic()
    assert llm.generate(["after"], GREEDY, use_tqdm=False)[0].token_ids
    assert time.monotonic() - began < 5


class _InterruptedOnce:
    """A ring's loop whose next `call_soon_threadsafe` from the caller's
    thread schedules its callback and then raises KeyboardInterrupt, as a
    Ctrl-C landing right after the work was handed to the loop would."""

    def __init__(self, loop) -> None:
        self._loop, self._caller = loop, threading.get_ident()

    def __getattr__(self, name):
        return getattr(self._loop, name)

    def call_soon_threadsafe(self, *args, **kwargs):
        handle = self._loop.call_soon_threadsafe(*args, **kwargs)
        if threading.get_ident() == self._caller and self._caller is not None:
            self._caller = None
            raise KeyboardInterrupt
        return handle


def test_ctrl_c_just_after_the_work_is_handed_over_cancels_it(llm):
    ring = llm._ring
    ring.loop = _InterruptedOnce(ring.loop)
    try:
        with pytest.raises(KeyboardInterrupt):
            _long_work(llm)
    finally:
        ring.loop = ring.loop._loop
    time.sleep(1.0)  # the loop has had its time to start what it was handed
    assert ring.conductor.scheduler.idle, "work handed over as the caller was interrupted runs on"
    began = time.monotonic()
    assert llm.generate(["after"], GREEDY, use_tqdm=False)[0].token_ids
    assert time.monotonic() - began < 10, "a later generate waited behind the interrupted work"


def test_close_from_another_thread_ends_a_generate():
    llm = LLM(max_batch=8)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            _long_work(llm)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            errors.append(exc)

    worker = threading.Thread(target=work)
    worker.start()
    time.sleep(0.5)
    llm.close()
    worker.join(timeout=10)
    assert not worker.is_alive(), "generate outlived close()"
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError), errors
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate(["x"], GREEDY, use_tqdm=False)


def test_one_ring_of_several_ranks_per_process():
    with LLM(pp_size=2, max_batch=4) as first:
        with pytest.raises(RuntimeError, match="close that LLM first"):
            LLM(pp_size=2)
        assert first.generate(["still"], GREEDY, use_tqdm=False)[0].token_ids


def test_a_ctrl_c_in_close_still_ends_the_ranks_and_the_group():
    """Interrupted while it waits for rank 0's thread, close() still stops
    the rank processes and ends the process group, so this process can run
    another ring."""
    first = LLM(pp_size=2, max_batch=4)
    ring = first._ring
    procs = list(ring.children.procs.values())

    def interrupted(timeout: float | None = None) -> None:
        raise KeyboardInterrupt

    ring._thread.join = interrupted
    configured = structlog.get_config()
    with pytest.raises(KeyboardInterrupt):
        first.close()
    assert procs and all(p.poll() is not None for p in procs), "a rank outlived close()"
    assert structlog.get_config() != configured, "the LLM's logging outlived close()"
    with LLM(pp_size=2, max_batch=4) as second:
        assert second.generate(["again"], GREEDY, use_tqdm=False)[0].token_ids


def test_constraints_that_leave_no_token_fail_the_request_in_one_line(llm):
    params = SamplingParams(
        max_tokens=4, temperature=0, allowed_token_ids=[5], structured_outputs={"regex": "ab"}
    )
    (out,) = llm.generate(["x"], params, use_tqdm=False)
    reason = out.finish_reason
    assert reason.startswith("error: grammar failed: token") and "\n" not in reason, reason
    assert "allowed_token_ids" in reason and len(reason) < 500


def test_bans_that_leave_allowed_token_ids_nothing_are_refused_at_submit(llm):
    """min_tokens bans the ends of sequence (1 and 3 in the built-in model)
    and stop ids, bad words their one-token words: where that is all of
    allowed_token_ids, nothing could be drawn, and no token outside them may
    stand in."""
    eos = sorted(llm._ring.conductor.desk.new_request.eos_ids)
    tok = llm.get_tokenizer()
    word, token = next(  # a word that is one token: bad_words bans it everywhere
        (w, t)
        for t in range(100, 2048)
        if (w := tok.decode([t]).strip()) and tok.encode(w, add_special_tokens=False) == [t]
    )
    cases = {
        "min_tokens": SamplingParams(max_tokens=5, min_tokens=3, allowed_token_ids=eos),
        "stop_token_ids": SamplingParams(
            max_tokens=5, min_tokens=5, stop_token_ids=[7], allowed_token_ids=[*eos, 7]
        ),
        "bad_words": SamplingParams(max_tokens=5, bad_words=[word], allowed_token_ids=[token]),
    }
    for name, params in cases.items():
        with pytest.raises(ValueError, match="none could be drawn"):
            llm.generate(["x"], params, use_tqdm=False)
            pytest.fail(f"the {name} case was not refused")
    # with one more token allowed, or the ends not banned, the request runs within it
    fine = SamplingParams(max_tokens=5, min_tokens=3, allowed_token_ids=[*eos, 7], temperature=0)
    (out,) = llm.generate(["x"], fine, use_tqdm=False)
    assert out.outputs[0].token_ids[:3] == [7, 7, 7], out
    ignoring = SamplingParams(max_tokens=2, min_tokens=2, ignore_eos=True, allowed_token_ids=eos)
    (out,) = llm.generate(["x"], ignoring, use_tqdm=False)
    assert set(out.outputs[0].token_ids) <= set(eos), out


def test_what_the_wire_would_refuse_is_refused_at_submit(llm):
    """Behind SamplingParams' checks, rank 0 refuses a request whose spec the
    sampling rank could not decode (it would end the ring, not the request)."""
    params = SamplingParams(max_tokens=2)
    object.__setattr__(params, "seed", 2.5)  # past the constructor's checks
    with pytest.raises(ValueError, match="the ring cannot carry"):
        llm.generate(["x"], params, use_tqdm=False)
    assert llm.generate(["still serving"], GREEDY, use_tqdm=False)[0].token_ids


@pytest.mark.timeout(120)
def test_an_llm_writes_nothing_to_stdout(tmp_path) -> None:
    """The caller's stdout is theirs: planning logged there before the log
    scope began (structlog's default logger prints)."""
    script = (
        "from ringserve import LLM\n"
        f"with LLM(pp_size=2, log_dir={str(tmp_path)!r}) as llm:\n"
        "    llm.generate('hi', use_tqdm=False)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=110
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    assert "plan.solved" in (tmp_path / "rank0.jsonl").read_text()
