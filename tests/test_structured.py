"""Structured outputs: every output that finishes `stop` matches its
constraint (JSON schemas checked with jsonschema, over a corpus and over
generated schemas), on one rank with chunked prefill and on a ring of
three with voids; the HTTP forms (response_format, structured_outputs,
guided_*) through the official client; a schema that cannot compile is a
400 that says why, and the server stays healthy."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator

import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ringserve import LLM, SamplingParams, StructuredOutputsParams
from ringserve.engine.grammar import Grammars, StructuredOutputsConfig
from ringserve.http.structured import closed
from ringserve.models.builtin import builtin_model_dir
from ringserve.models.tokenizer import Tokenizer
from tests.test_http import MESSAGES, PROMPT, Server, serving

pytestmark = pytest.mark.timeout(180)

CORPUS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"enum": ["red", "green", "blue"]},
    {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[a-z]{2}[0-9]{2}$"},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
            "where": {
                "type": "object",
                "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                "required": ["lat", "lon"],
                "additionalProperties": False,
            },
        },
        "required": ["id", "where"],
        "additionalProperties": False,
    },
    {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 5}]},
    {"type": "string", "minLength": 2, "maxLength": 6},
]
# A prompt longer than the chunk size: its prefill is chunked.
LONG = "Answer in JSON only, please, and be brief about it. " * 3
OPTIONS = dict(chunk_size=16, max_tokens_per_pass=48, kv_capacity_tokens=4096)


def sampled(so: StructuredOutputsParams, seed: int, max_tokens: int = 96) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, structured_outputs=so)


def check_json(outs, schemas) -> int:
    """Every output that finished `stop` is valid; returns how many did."""
    stopped = 0
    for out, schema in zip(outs, schemas, strict=True):
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), schema)
            stopped += 1
    return stopped


@pytest.fixture(scope="module")
def llm():
    with LLM(**OPTIONS) as engine:
        yield engine


def test_json_schemas_of_a_corpus_are_followed_with_chunked_prefill(llm):
    schemas = [s for s in CORPUS for _ in range(2)]
    prompts = [LONG if i % 2 else "JSON:" for i in range(len(schemas))]
    params = [sampled(StructuredOutputsParams(json=s), i) for i, s in enumerate(schemas)]
    outs = llm.generate(prompts, params)
    assert check_json(outs, schemas) >= len(schemas) // 2, [o.text for o in outs]


def test_regex_choice_and_grammar_are_followed(llm):
    cases = [
        (StructuredOutputsParams(regex=r"[a-z]{3}-[0-9]{2}"), r"[a-z]{3}-[0-9]{2}"),
        (StructuredOutputsParams(choice=("yes", "no", "maybe so")), r"yes|no|maybe so"),
        (StructuredOutputsParams(grammar='start: "x" ("y" | "z")~1..3 "!"'), r"x[yz]{1,3}!"),
        (StructuredOutputsParams(grammar='root ::= "a" [0-9] "b"'), r"a[0-9]b"),
        (StructuredOutputsParams(json_object=True), None),
    ]
    outs = llm.generate(["pick:"] * len(cases), [sampled(so, 3, 48) for so, _ in cases])
    for out, (_, pattern) in zip(outs, cases, strict=True):
        if pattern is None:  # any object: a random model may write on until max_tokens
            assert out.finish_reason != "stop" or isinstance(json.loads(out.text), dict)
        else:
            assert out.finish_reason == "stop", out
            assert re.fullmatch(pattern, out.text), out.text


def test_a_grammar_the_last_allowed_token_completes_is_a_stop(llm):
    """Complete on its last allowed token, the answer is whole: `stop`, not
    `length` (which a client takes for a cut answer)."""
    one = StructuredOutputsParams(choice=("x", "p"))
    outs = llm.generate(["pick:"] * 4, [sampled(one, seed, max_tokens=1) for seed in range(4)])
    assert [(o.text in ("x", "p"), o.finish_reason) for o in outs] == [(True, "stop")] * 4


def test_an_unconstrained_request_beside_a_constrained_one_is_untouched(llm):
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    (alone,) = llm.generate(["free text"], greedy)
    mixed = llm.generate(
        ["free text", "JSON:"],
        [greedy, sampled(StructuredOutputsParams(json=CORPUS[0]), 1)],
    )
    assert mixed[0].token_ids == alone.token_ids


def test_a_schema_that_cannot_compile_is_refused_and_names_the_problem(llm):
    bad = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "nope"}}})
    with pytest.raises(ValueError, match="nope"):
        llm.generate("x", SamplingParams(structured_outputs=bad))
    with pytest.raises(ValueError, match="regex"):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="a(b")))
    (ok,) = llm.generate("x", SamplingParams(max_tokens=3))
    assert ok.finish_reason is not None


SCALARS = st.sampled_from(
    [
        {"type": "integer"},
        {"type": "boolean"},
        {"type": "string", "maxLength": 6},
        {"enum": ["on", "off", 3]},
        {"type": "number", "minimum": 0, "maximum": 9},
    ]
)
SCHEMAS = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.builds(lambda s: {"type": "array", "items": s, "maxItems": 3}, inner),
        st.dictionaries(st.sampled_from(["a", "b", "c", "key"]), inner, min_size=1, max_size=3).map(
            lambda props: {
                "type": "object",
                "properties": props,
                "required": sorted(props),
                "additionalProperties": False,
            }
        ),
    ),
    max_leaves=5,
)


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(schema=SCHEMAS)
def test_generated_schemas_are_followed(llm, schema):
    so = StructuredOutputsParams(json=schema)
    outs = llm.generate(["JSON:", LONG], [sampled(so, 11), sampled(so, 12)])
    check_json(outs, [schema, schema])


def test_a_ring_with_voids_follows_the_schema_and_rolls_the_matcher_back(monkeypatch):
    monkeypatch.setenv("RINGSERVE_FAULTS", "void:rank=2:every=4")
    schemas = CORPUS[:4] * 2
    params = [sampled(StructuredOutputsParams(json=s), i) for i, s in enumerate(schemas)]
    prompts = [LONG if i % 3 == 0 else "JSON:" for i in range(len(schemas))]
    # Which pass a request rides in depends on timing; a request whose retries
    # after voids ran out would fail on its own (tested elsewhere), not here.
    with LLM(pp_size=3, max_batch=3, wedge_timeout_s=20.0, max_retries=100, **OPTIONS) as ring:
        outs = ring.generate(prompts, params)
    monkeypatch.delenv("RINGSERVE_FAULTS")
    with LLM(**OPTIONS) as one:
        single = one.generate(prompts, params)
    assert check_json(outs, schemas) >= len(schemas) // 2
    # the seeded draws are the same wherever the pass ran and however often it was voided
    assert [o.token_ids for o in outs] == [o.token_ids for o in single]


def whitespace_allowed(config: StructuredOutputsConfig) -> bool:
    tok = Tokenizer.from_dir(builtin_model_dir())
    grammars = Grammars(builtin_model_dir() / "tokenizer.json", 2048, [0], config)
    so = StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"}})
    grammars.starter(so).bind(1)
    ok = True
    for token in tok.encode("[1, 2]", add_special_tokens=False):
        ok = ok and not (grammars.accept(1, token) or "").startswith("error")
    return ok


def test_json_is_compact_unless_the_server_option_allows_whitespace(llm):
    assert not whitespace_allowed(StructuredOutputsConfig())
    assert whitespace_allowed(StructuredOutputsConfig.parse('{"disable_any_whitespace": false}'))
    so = StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"}})
    outs = llm.generate(["JSON:"] * 6, [sampled(so, s) for s in range(6)])
    assert all(not re.search(r"\s", o.text) for o in outs), [o.text for o in outs]


def test_the_server_option_switches_whitespace_and_refuses_other_backends():
    assert StructuredOutputsConfig.parse(None).disable_any_whitespace
    loose = StructuredOutputsConfig.parse('{"disable_any_whitespace": false}')
    assert not loose.disable_any_whitespace
    with pytest.raises(ValueError, match="xgrammar"):
        StructuredOutputsConfig.parse('{"backend": "xgrammar"}')
    with pytest.raises(ValueError, match="unknown keys"):
        StructuredOutputsConfig.parse('{"whitespace": 1}')


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    async with serving() as s:
        yield s


async def test_the_openai_client_gets_structured_outputs_in_every_form(server: Server) -> None:
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    chat = await client.chat.completions.create(
        model="ringserve-builtin",
        messages=MESSAGES,
        max_tokens=64,
        seed=5,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "n", "schema": schema, "strict": True},
        },
    )
    if chat.choices[0].finish_reason == "stop":
        value = json.loads(chat.choices[0].message.content)
        jsonschema.validate(value, {**schema, "additionalProperties": False})
    for extra in (
        {"structured_outputs": {"choice": ["left", "right"]}},
        {"guided_choice": ["left", "right"]},
    ):
        done = await client.completions.create(
            model="ringserve-builtin", prompt=PROMPT, max_tokens=8, extra_body=extra
        )
        assert done.choices[0].text in ("left", "right")
    stream = await client.chat.completions.create(
        model="ringserve-builtin",
        messages=MESSAGES,
        max_tokens=16,
        stream=True,
        extra_body={"structured_outputs": {"regex": "[0-9]{4}"}},
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert re.fullmatch("[0-9]{4}", text), text
    obj = await client.chat.completions.create(
        model="ringserve-builtin",
        messages=MESSAGES,
        max_tokens=64,
        response_format={"type": "json_object"},
    )
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)


async def test_a_bad_schema_is_a_400_naming_it_and_the_server_stays_healthy(
    server: Server,
) -> None:
    bad = {"type": "object", "properties": {"a": {"type": "nope"}}}
    status, body = await server.post(
        "/v1/chat/completions",
        {
            "messages": MESSAGES,
            "response_format": {"type": "json_schema", "json_schema": {"schema": bad}},
        },
    )
    assert status == 400 and body["error"]["param"] == "response_format", body
    assert "nope" in body["error"]["message"]
    status, body = await server.post(
        "/v1/completions",
        {"prompt": PROMPT, "guided_regex": "a", "structured_outputs": {"choice": ["x"]}},
    )
    assert status == 400 and "at most one" in body["error"]["message"], body
    status, body = await server.post(
        "/v1/completions", {"prompt": PROMPT, "structured_outputs": {"regex": "a(b"}}
    )
    assert status == 400 and body["error"]["param"] == "structured_outputs", body
    status, body = await server.post(
        "/v1/completions", {"prompt": PROMPT, "structured_outputs": {}}
    )
    assert status == 400 and body["error"]["param"] == "structured_outputs", body
    assert "got none" in body["error"]["message"], body
    only_itself = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
    status, body = await server.post(
        "/v1/chat/completions",
        {
            "messages": MESSAGES,
            "response_format": {"type": "json_schema", "json_schema": {"schema": only_itself}},
        },
    )
    assert status == 400 and body["error"]["param"] == "response_format", body
    assert "matches nothing" in body["error"]["message"], body
    await server.assert_serving()
    await server.assert_no_kv_held()


def test_a_constrained_and_penalized_run_replays_with_the_scheduler_rerun(tmp_path):
    from ringserve.replay import replay

    schemas = CORPUS[:3]
    params = [sampled(StructuredOutputsParams(json=s), i, 40) for i, s in enumerate(schemas)]
    params += [
        SamplingParams(max_tokens=20, temperature=0, repetition_penalty=1.5, ignore_eos=True)
    ]
    prompts = [
        f"{topic}: write it as JSON for me. " * 4 for topic in ("cats", "dogs", "rain", "tea")
    ]
    # small enough that requests are retracted and re-prefilled
    options = dict(OPTIONS, kv_capacity_tokens=200, max_batch=4)
    with LLM(pp_size=2, log_dir=str(tmp_path), **options) as ring:
        outs = ring.generate(prompts, params)
    assert any(o.finish_reason == "stop" for o in outs[:3])
    check_json(outs[:3], schemas)
    report = replay(tmp_path)
    assert report.consistent and not report.findings, report.render()
    assert report.rerun.reproduced and report.rerun.decisions == report.passes
    logged = (tmp_path / "rank0.jsonl").read_text()
    assert '"request.retracted"' in logged


def test_launch_refuses_a_bad_structured_outputs_config_in_one_line():
    import subprocess
    import sys

    bad = '{"backend": "outlines"}'
    cmd = [sys.executable, "-m", "ringserve", "launch", "--structured-outputs-config", bad]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines() == [
        "ringserve: --structured-outputs-config: structured outputs backend 'outlines' is not "
        "available here; choose one of ['guidance', 'auto'] (llguidance)"
    ]


def test_strict_closes_every_object_schema_and_leaves_data_alone():
    """OpenAI's strict mode closes object schemas, nullable ones written as
    a type list included; `const`, `enum` and `default` are values, which a
    rewrite would make the answer fail the caller's own schema."""
    obj = {"type": "object", "properties": {"a": {"type": "integer"}}}
    value = {"type": "object"}  # data shaped like a schema
    schema = {
        "type": "object",
        "properties": {
            "nullable": {**obj, "type": ["object", "null"]},
            "listed": {"type": "array", "items": obj},
            "either": {"anyOf": [obj, {"type": "null"}]},
            "ref": {"$ref": "#/$defs/o"},
            "k": {"const": value},
            "e": {"enum": [value, 1]},
            "d": {**obj, "default": value},
        },
        "$defs": {"o": obj},
    }
    strict = closed(schema)
    props = strict["properties"]
    shut = [strict, props["nullable"], props["listed"]["items"], props["either"]["anyOf"][0]]
    shut += [strict["$defs"]["o"], props["d"]]
    assert all(s["additionalProperties"] is False for s in shut)
    assert props["k"]["const"] == value and props["e"]["enum"] == [value, 1]
    assert props["d"]["default"] == value
    assert "additionalProperties" not in props["either"]["anyOf"][1]
    answer = {"k": value, "e": value, "d": {"a": 1}, "nullable": None}
    jsonschema.validate(answer, strict)  # the caller's data still fits
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**answer, "nullable": {"a": 1, "extra": 2}}, strict)


def test_strict_leaves_an_object_made_of_allof_branches_satisfiable():
    """Each branch of an `allOf` names its own part of one object: closed
    one by one they would refuse each other's properties (no object fits);
    what they nest is still closed."""
    part = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    inner = {"type": "object", "properties": {"x": {"type": "integer"}}}
    other = {"type": "object", "properties": {"b": inner}, "required": ["b"]}
    for schema in ({"allOf": [part, other]}, {"type": "object", "allOf": [part, other]}):
        strict = closed(schema)
        jsonschema.validate({"a": 1, "b": {"x": 2}}, strict)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({"a": 1, "b": {"x": 2, "extra": 3}}, strict)


async def test_constraints_that_fail_the_grammar_are_the_requests_fault(server: Server) -> None:
    """A grammar that its own request's other constraints leave no token
    (or that never lets the output end) is a 400 naming the grammar, not a
    server error; the server goes on."""
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    contradiction = {"structured_outputs": {"choice": ["true"]}, "allowed_token_ids": [5, 6]}
    status, answer = await server.post("/v1/completions", {**body, **contradiction})
    assert status == 400 and answer["error"]["code"] == "grammar_failed", answer
    assert answer["error"]["message"].startswith("grammar failed: token"), answer
    await server.assert_serving()
    await server.assert_no_kv_held()
