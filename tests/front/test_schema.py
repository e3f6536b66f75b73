"""OpenAI bodies -> Generate arguments: every field mapped, harmless, or refused by name."""

from __future__ import annotations

import pytest

from front.schema import BadRequest, parse_request

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)


def chat(**kw):
    return parse_request({"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}, True, 4096)


def test_defaults_follow_openai():
    p = chat()
    assert p.generate["temperature"] == 1.0 and p.generate["max_tokens"] == 4096 and not p.stream


def test_extras_and_options_map():
    p = chat(temperature=0, top_k=5, min_p=0.1, repetition_penalty=1.2, priority="interactive", speculation="fast",
             logit_bias={"42": -100}, logprobs=True, top_logprobs=3, stop="END", seed=3, user="u1")
    g = p.generate
    assert g["logit_bias"] == {42: -100.0} and g["stop"] == ["END"] and g["top_logprobs"] == 3 and g["logprobs"]
    assert (g["priority"], g["speculation"], g["top_k"], g["min_p"]) == ("interactive", "fast", 5, 0.1)


def test_chat_template_kwargs_only_for_chat():
    assert chat(chat_template_kwargs={"enable_thinking": False}).generate["chat_template_kwargs"] == {
        "enable_thinking": False}
    with pytest.raises(BadRequest):
        parse_request({"prompt": "x", "chat_template_kwargs": {"a": 1}}, False, 10)


def test_content_parts_and_developer_role():
    p = parse_request({"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                      {"type": "text", "text": "b"}]}]}, True, 10)
    assert p.generate["messages"] == [{"role": "system", "content": "ab"}]


@pytest.mark.parametrize("body, param", [
    ({"n": 3}, "n"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"response_format": {"type": "grammar"}}, "response_format.type"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "a"}]}]}, "messages[0].tool_calls"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
])
def test_refusals_name_the_field(body, param):
    with pytest.raises(BadRequest) as e:
        parse_request({"messages": [{"role": "user", "content": "hi"}], **body}, True, 10)
    assert e.value.param == param


def test_completions_prompt_forms_and_legacy_logprobs():
    assert parse_request({"prompt": ["one"]}, False, 10).generate["prompt"] == "one"
    assert parse_request({"prompt": [1, 2, 3]}, False, 10).generate["prompt_tokens"] == [1, 2, 3]
    p = parse_request({"prompt": "x", "logprobs": 2}, False, 10)
    assert p.logprobs and p.generate["top_logprobs"] == 2
    with pytest.raises(BadRequest):
        parse_request({"prompt": ["a", "b"]}, False, 10)
    with pytest.raises(BadRequest):
        parse_request({"prompt": "x", "echo": True}, False, 10)


def test_tools_tool_choice_and_response_format_map_to_the_protocol():
    tool = {"type": "function", "function": {"name": "f", "description": "d",
                                             "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}}
    g = parse_request({"messages": [{"role": "user", "content": "hi"}], "tools": [tool],
                       "tool_choice": {"type": "function", "function": {"name": "f"}}, "parallel_tool_calls": False},
                      True, 10).generate
    assert g["tools"] == [{"name": "f", "description": "d", "parameters": tool["function"]["parameters"]}]
    assert g["tool_choice"] == {"name": "f"} and g["parallel_tool_calls"] is False and g["constraint"] is None
    g = parse_request({"messages": [{"role": "user", "content": "hi"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": True}}}, True, 10).generate
    assert g["constraint"] == {"kind": "json_schema", "value": '{"type": "object"}'} and g["tools"] is None
    g = parse_request({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}},
                      True, 10).generate
    assert g["constraint"] == {"kind": "json_object", "value": ""}
    turn = parse_request({"messages": [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": "x"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"}]}, True, 10).generate["messages"]
    assert turn == [{"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "name": "f", "arguments": '{"a": "x"}'}]},
                    {"role": "tool", "content": "done", "tool_call_id": "c1"}]
