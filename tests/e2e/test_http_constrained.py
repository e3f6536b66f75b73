"""Grammar-enforced output through `councild http` (official openai and anthropic clients):
response_format json_schema / json_object, tool_choice required / named (one call, then the
grammar ends the output), streamed tool-call deltas equal to the non-streamed calls, an
unsupported schema refused naming the construct. These need the daemon to enforce
Generate.constraint (helper grammar's branch); without it every case here is answered 400
"constrained decoding is not supported" and these tests fail, as they should."""

from __future__ import annotations

import json

import openai
import pytest
from bounded_tools import CHAT_TOOLS, check_args
from http_harness import anthropic_client, daemon_behind_front, openai_client

ASK = [{"role": "user", "content": "Forecast for Paris?"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, e2e_model):
    with daemon_behind_front(tmp_path_factory.mktemp("http-constrained"), e2e_model) as both:
        yield both


@pytest.fixture
def oai(stack):
    return openai_client(stack[1])


@pytest.mark.quick
def test_json_schema_strict_output_matches_the_schema(oai):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 9,
                                                                                 "minimum": 0}},
              "required": ["ok", "n"], "additionalProperties": False}
    r = oai.chat.completions.create(model="any", messages=ASK, max_tokens=64, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}})
    value = json.loads(r.choices[0].message.content)
    assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 9


def test_json_object_output_is_an_object(oai):
    r = oai.chat.completions.create(model="any", messages=ASK, max_tokens=200, temperature=0,
                                    response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert r.choices[0].message.content.lstrip().startswith("{")


@pytest.mark.parametrize("choice, names", [("required", {"forecast", "alarm"}),
                                           ({"type": "function", "function": {"name": "alarm"}}, {"alarm"})])
def test_forced_tool_choice_makes_one_valid_call_and_streams_it_identically(oai, choice, names):
    kw = dict(model="any", messages=ASK, max_tokens=120, temperature=0, tools=CHAT_TOOLS, tool_choice=choice,
              parallel_tool_calls=False)
    r = oai.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and len(msg.tool_calls) == 1 and not msg.content
    call = msg.tool_calls[0]
    assert call.type == "function" and call.function.name in names
    check_args(call.function.name, call.function.arguments)
    chunks = list(oai.chat.completions.create(**kw, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    # The same call, under the streamed request's own id (ids are per request: call_<request id>_<n>).
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == \
        [(0, call.function.name, call.function.arguments)]
    assert deltas[0].id.startswith("call_") and deltas[0].id.endswith("_0") and deltas[0].id != call.id
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_unsupported_tool_schema_is_400_naming_the_construct(oai):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}]
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="any", messages=ASK, max_tokens=8, tools=tools, tool_choice="required")
    assert '"not"' in info.value.body["message"]


def test_anthropic_tool_use_with_tool_choice_any(stack):
    claude = anthropic_client(stack[1])
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in CHAT_TOOLS]
    kw = dict(model="any", max_tokens=120, extra_body={"temperature": 0}, messages=ASK, tools=tools,
              tool_choice={"type": "any", "disable_parallel_tool_use": True})
    out = claude.messages.create(**kw)
    assert out.stop_reason == "tool_use"
    uses = [b for b in out.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name in ("forecast", "alarm")
    check_args(uses[0].name, json.dumps(uses[0].input))
    # Streamed: the SDK assembles the same tool_use block from Anthropic's events.
    with claude.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and [(b.name, b.input) for b in streamed] == [(uses[0].name, uses[0].input)]
