"""Responses API bodies -> Generate arguments, and daemon replies -> Responses objects and
stream events, each validated against the official openai package's own models (what its
client parses). The paths a live test model does not reach (thinking, a call cut at the end,
a stream that fails) are driven here with the daemon's message types."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from front.responses_api import ResponseEvents, ResponsesAPI, ResponseShape, parse_responses_request
from front.schema import BadRequest
from protocol import messages as m
from protocol.client import CouncilError

EVENT = TypeAdapter(ResponseStreamEvent)
TOOL = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}


def parse(**kw):
    return parse_responses_request({"model": "m", "input": "hi", **kw})


def test_defaults_and_mapping():
    gen, stream, echo = parse()
    assert gen["messages"] == [{"role": "user", "content": "hi"}] and not stream
    assert gen["temperature"] == 1.0 and "max_tokens" not in gen and gen["constraint"] is None
    gen, stream, echo = parse(instructions="sys", max_output_tokens=7, temperature=0, top_p=0.5, stream=True,
                              tools=[TOOL], tool_choice={"type": "function", "name": "f"}, parallel_tool_calls=False,
                              reasoning={"effort": "none"}, priority="interactive", store=False, user="u",
                              include=["reasoning.encrypted_content"], stream_options={"include_obfuscation": False})
    assert gen["messages"][0] == {"role": "system", "content": "sys"} and stream
    assert (gen["max_tokens"], gen["temperature"], gen["top_p"]) == (7, 0.0, 0.5)
    assert gen["tools"] == [{"name": "f", "description": "", "parameters": TOOL["parameters"]}]
    assert gen["tool_choice"] == {"name": "f"} and gen["parallel_tool_calls"] is False
    assert gen["chat_template_kwargs"] == {"enable_thinking": False} and gen["priority"] == "interactive"
    assert echo["tools"][0]["name"] == "f" and echo["parallel_tool_calls"] is False


def test_input_items_become_chat_turns():
    gen, _, _ = parse(input=[
        {"role": "system", "content": "s"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                         {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "let me look", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{\"a\": \"x\"}"},
        {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
        {"role": "developer", "content": "later"}])
    assert gen["messages"] == [
        {"role": "system", "content": "s"}, {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "let me look", "tool_calls": [
            {"id": "c1", "name": "f", "arguments": "{\"a\": \"x\"}"}, {"id": "c2", "name": "f", "arguments": "{}"}]},
        {"role": "tool", "content": "one", "tool_call_id": "c1", "name": "f"},
        {"role": "tool", "content": "two", "tool_call_id": "c2", "name": "f"},
        {"role": "system", "content": "later"}]


@pytest.mark.parametrize("body, param", [
    ({"input": [{"role": "system", "content": "only a system turn"}]}, "input"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "user", "content": 3}]}, "input[0].content"),
    ({"input": ["text"]}, "input[0]"),
    ({"tools": [{"type": "function", "name": "f", "parameters": "x"}]}, "tools[0]"),
    ({"tools": [{"type": "mcp", "server_label": "x"}]}, "tools[0].type"),
    ({"tools": [TOOL], "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"top_p": 0}, "top_p"),
    ({"temperature": 3}, "temperature"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"max_tool_calls": 3}, "max_tool_calls"),
    ({"reasoning": {"effort": "huge"}}, "reasoning.effort"),
    ({"stream": "yes"}, "stream"),
    ({"instructions": ["x"]}, "instructions"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
])
def test_bad_bodies_name_the_field(body, param):
    with pytest.raises(BadRequest) as info:
        parse(**body)
    assert info.value.param == param


def _done(finish: str, text: str = "", reasoning: str = "", calls=()) -> m.Done:
    return m.Done(request_id="r1", finish_reason=finish, text=text, reasoning=reasoning, tool_calls=list(calls),
                  usage=m.Usage(prompt_tokens=5, completion_tokens=3, cached_tokens=2),
                  timings=m.Timings(queue_s=0, prefill_s=0, decode_s=0, ttft_s=0, tokens_per_s=0))


def _tokens(seq: int, text: str = "", reasoning: str = "", calls=None) -> m.Tokens:
    return m.Tokens(request_id="r1", seq=seq, text=text, token_ids=[1], reasoning=reasoning, tool_calls=calls)


def _shape() -> ResponseShape:
    _, _, echo = parse(tools=[TOOL], instructions="i")
    return ResponseShape("r1", "model", echo, 16)


def _events(chunks: list[str]) -> list:
    out = []
    for chunk in chunks:
        head, data = chunk.rstrip("\n").split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert head == f"event: {payload['type']}"
        out.append(EVENT.validate_python(payload))  # the openai package's own model, validated
    assert [e.sequence_number for e in out] == list(range(len(out)))
    return out


CALL = m.ToolCall(id="call_r1_0", name="f", arguments="{\"a\": \"x\"}")


def test_thinking_text_and_a_call_stream_as_three_items():
    ev = ResponseEvents(_shape())
    chunks = ev.start() + ev.chunk(_tokens(0, reasoning="hm")) + ev.chunk(_tokens(1, reasoning=" ok", text="Sure"))
    chunks += ev.chunk(_tokens(2, text=".", calls=[CALL])) + ev.finish(_done("tool_calls", "Sure.", "hm ok", [CALL]))
    events = _events(chunks)
    assert [e.type for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    final = events[-1].response
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    assert final.output[0].content[0].text == "hm ok" and final.output_text == "Sure."
    assert final.output[2].arguments == CALL.arguments and final.output[2].status == "completed"
    assert final.usage.input_tokens_details.cached_tokens == 2 and final.status == "completed"
    # The non-streamed response holds the same items.
    full = Response.model_validate(_shape().full(_done("tool_calls", "Sure.", "hm ok", [CALL])))
    assert [(o.type, o.id) for o in full.output] == [(o.type, o.id) for o in final.output]


def test_a_call_only_in_the_done_is_sent_and_marked_incomplete():
    ev = ResponseEvents(_shape())
    events = _events(ev.start() + ev.finish(_done("length", calls=[CALL])))
    assert [e.type for e in events][2:] == ["response.output_item.added", "response.function_call_arguments.delta",
                                            "response.function_call_arguments.done", "response.output_item.done",
                                            "response.incomplete"]
    final = events[-1].response
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert final.output[0].status == "incomplete" and final.output[0].arguments == CALL.arguments
    full = Response.model_validate(_shape().full(_done("length", calls=[CALL])))
    assert [o.type for o in full.output] == ["function_call"] and full.output[0].status == "incomplete"


def test_no_output_is_one_empty_message_and_a_failure_is_one_terminal_event():
    ev = ResponseEvents(_shape())
    events = _events(ev.start() + ev.finish(_done("stop")))
    assert events[-1].type == "response.completed" and events[-1].response.output[0].content[0].text == ""
    ev = ResponseEvents(_shape())
    events = _events(ev.start() + ev.chunk(_tokens(0, text="a")) + [ev.failed("deadline", "server_error")])
    assert [e.type for e in events if e.type.startswith("response.") and "item" not in e.type
            and "part" not in e.type and "text" not in e.type] == \
        ["response.created", "response.in_progress", "response.failed"]
    assert events[-1].response.error.message == "deadline" and events[-1].response.status == "failed"


class _Stream:
    """A daemon stream that fails after its Accepted: with an Error, or with a fault of the front's."""

    def __init__(self, error: Exception):
        self.error = error
        self.cancelled = False

    async def next_message(self):
        raise self.error

    async def cancel(self):
        self.cancelled = True


@pytest.mark.parametrize("error, status, code", [
    (CouncilError("deadline_exceeded", "past its deadline"), 504, "server_error"),
    (CouncilError("overloaded", "busy"), 429, "rate_limit_exceeded"),
    (KeyError("bug"), 500, "server_error"),
])
def test_a_stream_that_fails_ends_with_one_response_failed(error, status, code):
    recorded = []
    front = SimpleNamespace(metrics=SimpleNamespace(request=lambda *a: recorded.append(a)))
    api = ResponsesAPI(front)
    stream = _Stream(error)
    accepted = m.Accepted(request_id="r1", queue_position=0, prompt_tokens=5)

    async def collect():
        return [c async for c in api._events(stream, accepted, _shape(), "responses", "s", 0.0)]

    events = _events(asyncio.run(collect()))
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.failed"]
    assert events[-1].response.error.code == code and events[-1].response.status == "failed"
    assert [r[2] for r in recorded] == [status]
    assert stream.cancelled == isinstance(error, KeyError)  # a daemon error already ended the request there
