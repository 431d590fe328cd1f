"""Tool calls in chat through the official client, streamed and not: a
named or `required` tool choice is constrained by the grammar and always
parses; `auto` answers are read by the hermes parser (forced here through a
grammar, as a random model writes no calls of its own); assistant tool
calls and tool results in the history reach the chat template."""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import jsonschema
import openai
import pytest

from ringserve.http.tools import HermesParser, plan_tools
from ringserve.models.builtin import builtin_model_dir
from tests.test_http import MODEL, Server, serving

pytestmark = pytest.mark.timeout(60)

# A small chat template with tools, in the Hermes manner.
TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>"
    '{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}'
    "</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["utc", "cet"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
FORCED = '<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>'


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tools") / "model"
    shutil.copytree(builtin_model_dir(), path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return path


@pytest.fixture
async def server(tool_model) -> AsyncIterator[Server]:
    http = {"enable_auto_tool_choice": True, "tool_call_parser": "hermes"}
    async with serving(model_dir=tool_model, http=http) as s:
        yield s


def client(server: Server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


async def streamed_calls(stream) -> tuple[list[dict], str | None, str]:
    """Tool calls reassembled from a stream as an OpenAI client does it;
    `pieces`: how many deltas brought some of a call's arguments."""
    calls: dict[int, dict] = {}
    finish, content = None, ""
    async for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                if d.index not in calls:
                    assert d.id and d.type == "function" and d.function.name, "name comes first"
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                    calls[d.index]["pieces"] = 0
                calls[d.index]["arguments"] += d.function.arguments or ""
                calls[d.index]["pieces"] += bool(d.function.arguments)
            finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish, content


def check_calls(calls) -> None:
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


async def test_a_named_tool_choice_calls_that_function(server: Server) -> None:
    body = dict(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        max_tokens=64,
        seed=3,
        temperature=0.8,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    done = await client(server).chat.completions.create(**body)
    choice = done.choices[0]
    if choice.finish_reason == "length":
        pytest.skip("the random model wrote on past max_tokens")
    assert choice.finish_reason == "stop" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    check_calls([{"name": call.function.name, "arguments": call.function.arguments}])
    calls, finish, _ = await streamed_calls(
        await client(server).chat.completions.create(**body, stream=True)
    )
    assert finish == "stop"
    assert [(c["name"], c["arguments"]) for c in calls] == [
        ("get_weather", call.function.arguments)
    ]


async def test_required_tool_choice_makes_a_list_of_calls(server: Server) -> None:
    body = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=96, tool_choice="required")
    for seed in range(4):
        done = await client(server).chat.completions.create(**body, seed=seed, temperature=0.7)
        if done.choices[0].finish_reason != "length":
            break
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = [
        {"name": c.function.name, "arguments": c.function.arguments}
        for c in choice.message.tool_calls
    ]
    assert calls and {c["name"] for c in calls} <= set(SCHEMAS)
    check_calls(calls)
    streamed, finish, _ = await streamed_calls(
        await client(server).chat.completions.create(
            **body, seed=seed, temperature=0.7, stream=True
        )
    )
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed] == [
        (c["name"], c["arguments"]) for c in calls
    ]
    # the arguments stream as the tokens come, not whole at the end
    longest = max(streamed, key=lambda c: len(c["arguments"]))
    assert len(longest["arguments"]) >= 8 and longest["pieces"] > 1, longest
    one = await client(server).chat.completions.create(
        **body, seed=seed, temperature=0.7, parallel_tool_calls=False
    )
    if one.choices[0].finish_reason == "tool_calls":
        assert len(one.choices[0].message.tool_calls) == 1


async def test_auto_answers_are_parsed_into_tool_calls(server: Server) -> None:
    # a random model writes no calls: a grammar makes it write one
    body = dict(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        max_tokens=64,
        extra_body={"structured_outputs": {"choice": [FORCED]}},
    )
    done = await client(server).chat.completions.create(**body)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_time",
        {"zone": "utc"},
    )
    calls, finish, content = await streamed_calls(
        await client(server).chat.completions.create(**body, stream=True)
    )
    assert finish == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_time", call.function.arguments)]
    plain = await client(server).chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=8, temperature=0
    )
    assert plain.choices[0].finish_reason in ("stop", "length")


async def test_tool_calls_and_results_in_the_history_reach_the_template(server: Server) -> None:
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {  # arguments whose JSON is a string: decoded once, to that string
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps('{"a": 1}')},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    status, body = await server.post("/tokenize", {"messages": history})
    assert status == 200, body
    _, text = await server.post("/detokenize", {"tokens": body["tokens"]})
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}' in text["prompt"]
    assert '"arguments": "{\\"a\\": 1}"}' in text["prompt"], text["prompt"]
    assert "sunny, 21 C" in text["prompt"]
    done = await client(server).chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, max_tokens=4, tool_choice="none"
    )
    assert done.choices[0].message.tool_calls is None


async def test_a_strict_function_gets_no_properties_its_schema_does_not_name(
    server: Server,
) -> None:
    """OpenAI's strict function calling: the arguments follow the schema with
    every object closed, as `response_format`'s strict schemas are; an open
    schema lets the random model write keys of its own."""
    open_schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    tools = [
        {"type": "function", "function": {"name": "add", "strict": True, "parameters": open_schema}}
    ]
    closed_schema = {**open_schema, "additionalProperties": False}
    named = {"type": "function", "function": {"name": "add"}}
    for choice, seed in [(c, s) for c in ("required", named) for s in range(4)]:
        done = await client(server).chat.completions.create(
            model=MODEL, messages=ASK, tools=tools, tool_choice=choice, max_tokens=40, seed=seed
        )
        (call,) = done.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), closed_schema)
    plan = plan_tools(
        [{"type": "function", "function": {"name": "add", "parameters": open_schema}}],
        named,
        True,
        None,
    )
    assert plan.grammar.json == open_schema  # not strict: the schema as given
    assert plan_tools(tools, named, True, None).grammar.json == closed_schema


async def test_tool_choices_the_server_cannot_serve_are_refused(tool_model) -> None:
    async with serving(model_dir=tool_model) as plain:
        status, body = await plain.post(
            "/v1/chat/completions", {"messages": ASK, "tools": TOOLS, "tool_choice": "auto"}
        )
        assert status == 400 and body["error"]["param"] == "tool_choice", body
        status, body = await plain.post(
            "/v1/chat/completions",
            {
                "messages": ASK,
                "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
            },
        )
        assert status == 400 and "nope" in body["error"]["message"], body
        await plain.assert_serving()


def test_the_hermes_parser_reads_calls_and_keeps_the_text_before_them():
    parser = HermesParser()
    text = (
        'Let me check. <tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    )
    parsed = parser.parse(text)
    assert parsed.content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in parsed.calls] == [
        ("a", {"x": 1}),
        ("b", {}),
    ]
    assert parser.parse("no calls here").calls == []
    broken = parser.parse("<tool_call>{not json</tool_call>")
    assert broken.calls == [] and broken.content == "<tool_call>{not json</tool_call>"
    assert parser.safe_prefix("hello <tool") == len("hello ")
    assert parser.safe_prefix("hello <tool_call>{") == len("hello ")
    assert parser.safe_prefix("hello") == 5


def test_a_call_list_read_piece_by_piece_gives_the_calls_read_whole() -> None:
    from ringserve.http.call_list import CallListReader

    text = (
        '[ {"parameters": {"city": "Pa\\"r}is", "days": [1, {"a": 2}]}, "name": "get_weather"},'
        '{"name":"get_time","parameters":{"zone":"utc"} }]'
    )
    whole = CallListReader().read_all(text)
    assert [(n, json.loads(a)) for n, a in whole] == [
        ("get_weather", {"city": 'Pa"r}is', "days": [1, {"a": 2}]}),
        ("get_time", {"zone": "utc"}),
    ]
    reader, got, opened = CallListReader(), {}, []
    for i in range(0, len(text), 3):
        for piece in reader.push(text[i : i + 3]):
            if piece.opens:
                opened.append(piece.index)
            got[piece.index] = (piece.name, got.get(piece.index, ("", ""))[1] + piece.arguments)
    assert opened == [0, 1] and [got[0], got[1]] == whole


async def test_tokenize_renders_tools_and_template_kwargs_as_a_chat_does(server: Server) -> None:
    """/tokenize's count is the chat prompt's: the tools and the template's
    variables reach the template there too."""
    body = dict(messages=ASK, tools=TOOLS, chat_template_kwargs={"add_generation_prompt": False})
    status, counted = await server.post("/tokenize", body)
    assert status == 200, counted
    _, bare = await server.post("/tokenize", {"messages": ASK})
    assert counted["count"] > bare["count"] + 20  # the tools' JSON is in the prompt
    done = await client(server).chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        max_tokens=1,
        tool_choice="required",
        extra_body={"chat_template_kwargs": body["chat_template_kwargs"]},
    )
    assert done.usage.prompt_tokens == counted["count"]
    status, refused = await server.post("/tokenize", {"prompt": "a", "tools": TOOLS})
    assert status == 400 and refused["error"]["param"] == "tools"
    status, refused = await server.post("/tokenize", {"messages": ASK, "tools": [{"x": 1}]})
    assert status == 400 and "tools[0]" in refused["error"]["param"]
