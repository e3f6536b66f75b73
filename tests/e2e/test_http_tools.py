"""Tools and the Anthropic Messages API through `councild http` in front of a live daemon,
driven by the official openai and anthropic clients. What needs no grammar enforcement:
tools rendered by the chat template (the test model's template shows them the Qwen3.5 way),
tool_choice none / auto, a tool-result turn, count_tokens, Anthropic text, stream and errors.
The grammar-enforced cases are in test_http_constrained.py."""

from __future__ import annotations

import anthropic
import openai
import pytest
from http_harness import anthropic_client, daemon_behind_front, openai_client

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, e2e_model):
    with daemon_behind_front(tmp_path_factory.mktemp("http-tools"), e2e_model,
                             '[http.api_keys]\n"key-tools" = "tools"\n') as both:
        yield both


@pytest.fixture
def oai(stack):
    return openai_client(stack[1], api_key="key-tools", timeout=120)


@pytest.fixture
def claude(stack):
    return anthropic_client(stack[1], api_key="key-tools", timeout=120)


@pytest.mark.quick
def test_tools_are_rendered_for_auto_and_left_out_for_none(oai):
    kw = dict(model="any", messages=ASK, max_tokens=6, temperature=0)
    plain = oai.chat.completions.create(**kw)
    auto = oai.chat.completions.create(**kw, tools=TOOLS)
    none = oai.chat.completions.create(**kw, tools=TOOLS, tool_choice="none")
    # The template put the tool (its JSON and the call format) into the prompt for auto only.
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 40
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert none.choices[0].message.content == plain.choices[0].message.content
    # The random model writes no call: auto answers in text, finish_reason as without tools.
    assert auto.choices[0].finish_reason in ("length", "stop", "tool_calls")
    assert auto.choices[0].finish_reason != "tool_calls" or auto.choices[0].message.tool_calls


def test_a_tool_result_turn_is_rendered_with_its_call(oai):
    def turn(city: str):
        return ASK + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": f'{{"city": "{city}"}}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]

    short = oai.chat.completions.create(model="any", messages=turn("Paris"), tools=TOOLS, max_tokens=4, temperature=0)
    long = oai.chat.completions.create(model="any", messages=turn("Paris " * 30), tools=TOOLS, max_tokens=4,
                                       temperature=0)
    # The call's arguments are in the prompt: 30 more words of them, more tokens.
    assert long.usage.prompt_tokens >= short.usage.prompt_tokens + 30
    streamed = list(oai.chat.completions.create(model="any", messages=turn("Paris"), tools=TOOLS, max_tokens=4,
                                                temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == short.choices[0].message.content


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0]"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"messages": ASK + [{"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
])
def test_bad_tool_requests_are_400_naming_the_field(oai, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(**{"model": "any", "messages": ASK, "max_tokens": 4, **body})
    assert info.value.body["param"] == param


# ------------------------------------------------------------------------------ Anthropic


def test_anthropic_text_stream_and_count_tokens_agree(claude):
    kw = dict(model="any", max_tokens=8, extra_body={"temperature": 0}, system="Be brief.", messages=ASK)
    full = claude.messages.create(**kw)
    assert full.type == "message" and full.role == "assistant" and full.stop_reason == "max_tokens"
    assert [b.type for b in full.content] == ["text"] and full.usage.output_tokens == 8
    with claude.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == full.content[0].text and final.content[0].text == text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8
    count = claude.messages.count_tokens(model="any", system="Be brief.", messages=ASK)
    assert count.input_tokens == full.usage.input_tokens > 0
    with_tools = claude.messages.count_tokens(model="any", system="Be brief.", messages=ASK, tools=[
        {"name": "get_weather", "description": "weather", "input_schema": TOOLS[0]["function"]["parameters"]}])
    assert with_tools.input_tokens > count.input_tokens + 40


def test_anthropic_tool_result_blocks_are_accepted(claude):
    msgs = ASK + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}]
    tools = [{"name": "get_weather", "description": "weather", "input_schema": TOOLS[0]["function"]["parameters"]}]
    out = claude.messages.create(model="any", max_tokens=4, extra_body={"temperature": 0}, messages=msgs, tools=tools)
    assert out.stop_reason in ("max_tokens", "end_turn", "tool_use") and out.usage.input_tokens > 60


def test_anthropic_errors_have_anthropics_shape(stack, claude):
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(model="any", max_tokens=4, messages=[{"role": "robot", "content": "x"}])
    assert info.value.body["type"] == "error"
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert "messages.0.role" in info.value.body["error"]["message"]
    bad_key = anthropic.Anthropic(base_url=stack[1].url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        bad_key.messages.create(model="any", max_tokens=4, messages=ASK)
    assert info.value.body["error"]["type"] == "authentication_error"
