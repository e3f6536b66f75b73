"""OpenAI's Responses API (POST /v1/responses) through `councild http` in front of a live
daemon, driven by the official openai client: text, the stream's event sequence, instructions,
max_output_tokens (incomplete), forced function calls and their results, json_schema output,
and 400s in OpenAI's error shape. The chat route is the reference: the same input must reach
the daemon as the same prompt (same input tokens, same greedy text)."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pydantic
import pytest
from bounded_tools import CHAT_TOOLS, RESPONSES_TOOLS, check_args
from http_harness import openai_client, start_front, terminal_events

ASK = "Forecast for Paris?"
TERMINAL = {"response.completed", "response.incomplete", "response.failed"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, daemon_proc):
    """The session's shared daemon (conftest.daemon_proc) behind a front of this module's."""
    front = start_front(tmp_path_factory.mktemp("http-responses"), daemon_proc.endpoint, "")
    yield daemon_proc, front
    front.stop()


@pytest.fixture
def oai(stack):
    return openai_client(stack[1])


def _one_terminal(events) -> None:
    """Sequence numbers count from 0 without a gap; exactly one terminal event, the last."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert [e.type for e in events if e.type in TERMINAL] == [events[-1].type]


def test_text_is_the_chat_routes_answer_and_stream_deltas_make_it(oai):
    r = oai.responses.create(model="any", input=ASK, max_output_tokens=12, temperature=0)
    chat = oai.chat.completions.create(model="any", messages=[{"role": "user", "content": ASK}], max_tokens=12,
                                       temperature=0)
    assert r.object == "response" and r.id.startswith("resp_")
    assert [o.type for o in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.output_text == chat.choices[0].message.content and r.output_text
    assert r.usage.input_tokens == chat.usage.prompt_tokens > 0
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # The random model does not stop by itself: cut by max_output_tokens, said so.
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 12 and r.output[0].status == "incomplete"

    events = list(oai.responses.create(model="any", input=ASK, max_output_tokens=12, temperature=0, stream=True))
    _one_terminal(events)
    kinds = [e.type for e in events]
    n = kinds.count("response.output_text.delta")
    assert n >= 1 and kinds == ["response.created", "response.in_progress", "response.output_item.added",
                                "response.content_part.added", *["response.output_text.delta"] * n,
                                "response.output_text.done", "response.content_part.done",
                                "response.output_item.done", "response.incomplete"]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == r.output_text
    assert next(e for e in events if e.type == "response.output_text.done").text == deltas
    final = events[-1].response
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert final.output_text == deltas and final.usage.output_tokens == 12 and final.id == events[0].response.id


def test_instructions_are_the_system_turn(oai):
    plain = oai.responses.create(model="any", input=ASK, max_output_tokens=2, temperature=0)
    told = oai.responses.create(model="any", input=ASK, instructions="Answer in one short line. " * 5,
                                max_output_tokens=2, temperature=0)
    chat = oai.chat.completions.create(model="any", max_tokens=2, temperature=0, messages=[
        {"role": "system", "content": "Answer in one short line. " * 5}, {"role": "user", "content": ASK}])
    assert told.usage.input_tokens >= plain.usage.input_tokens + 25
    assert told.usage.input_tokens == chat.usage.prompt_tokens
    assert told.instructions == "Answer in one short line. " * 5
    # A developer message opening the input joins the instructions: still one system turn.
    split = oai.responses.create(model="any", instructions="Answer in one short line.", max_output_tokens=2,
                                 temperature=0, input=[{"role": "developer", "content": "Be kind."},
                                                       {"role": "user", "content": ASK}])
    joined = oai.chat.completions.create(model="any", max_tokens=2, temperature=0, messages=[
        {"role": "system", "content": "Answer in one short line.\n\nBe kind."}, {"role": "user", "content": ASK}])
    assert split.usage.input_tokens == joined.usage.prompt_tokens


@pytest.mark.parametrize("choice, names", [("required", {"forecast", "alarm"}),
                                           ({"type": "function", "name": "alarm"}, {"alarm"})])
def test_forced_function_call_and_its_stream(oai, choice, names):
    kw = dict(model="any", input=ASK, max_output_tokens=120, temperature=0, tools=RESPONSES_TOOLS,
              tool_choice=choice, parallel_tool_calls=False)
    r = oai.responses.create(**kw)
    assert r.status == "completed" and r.incomplete_details is None
    assert [o.type for o in r.output] == ["function_call"]
    call = r.output[0]
    assert call.name in names and call.call_id.startswith("call_") and call.status == "completed"
    check_args(call.name, call.arguments)
    assert r.tool_choice == choice if isinstance(choice, str) else r.tool_choice.name == "alarm"
    assert [t.name for t in r.tools] == ["forecast", "alarm"]
    # Streamed (the client's stream helper assembles the response from the events).
    with oai.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    _one_terminal(events)
    assert [e.type for e in events] == ["response.created", "response.in_progress", "response.output_item.added",
                                        "response.function_call_arguments.delta",
                                        "response.function_call_arguments.done", "response.output_item.done",
                                        "response.completed"]
    assert events[3].delta == events[4].arguments == call.arguments and events[4].name == call.name
    assert [(o.type, o.name, o.arguments) for o in final.output] == [("function_call", call.name, call.arguments)]
    assert final.output[0].call_id != call.call_id  # ids are per request


def test_function_call_output_round_trip(oai):
    def conversation(city: str) -> list:
        return [{"role": "user", "content": [{"type": "input_text", "text": ASK}]},
                {"type": "function_call", "call_id": "call_1", "name": "forecast",
                 "arguments": json.dumps({"days": 3, "unit": "c", "city": city})},
                {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"}]

    r = oai.responses.create(model="any", input=conversation("Paris"), tools=RESPONSES_TOOLS, max_output_tokens=4,
                             temperature=0)
    chat = oai.chat.completions.create(model="any", tools=CHAT_TOOLS, max_tokens=4, temperature=0, messages=[
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "forecast", "arguments": json.dumps({"days": 3, "unit": "c", "city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}])
    # The same prompt as the chat route's call + tool turn, the same greedy answer.
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.output_text == (chat.choices[0].message.content or "")
    longer = oai.responses.create(model="any", input=conversation("Paris " * 30), tools=RESPONSES_TOOLS,
                                  max_output_tokens=4, temperature=0)
    assert longer.usage.input_tokens >= r.usage.input_tokens + 30  # the call's arguments are in the prompt

    # The Agents SDK's loop: a forced call's output items go back as input, with the result.
    first = oai.responses.create(model="any", input=ASK, tools=RESPONSES_TOOLS, tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=120, temperature=0)
    call = first.output[0]
    items = [{"role": "user", "content": ASK}, *[o.model_dump(exclude_none=True) for o in first.output],
             {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    follow = oai.responses.create(model="any", input=items, tools=RESPONSES_TOOLS, max_output_tokens=4, temperature=0)
    assert follow.usage.input_tokens > first.usage.input_tokens + 5
    assert follow.status in ("completed", "incomplete") and follow.output


def test_json_schema_text_format(oai):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}}
    r = oai.responses.create(model="any", input=ASK, max_output_tokens=64, temperature=0, text=fmt)
    value = json.loads(r.output_text)
    assert r.status == "completed"
    assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 9
    assert r.text.format.type == "json_schema" and r.text.format.name == "answer"
    with oai.responses.stream(model="any", input=ASK, max_output_tokens=64, temperature=0, text=fmt) as stream:
        final = stream.get_final_response()
    assert json.loads(final.output_text) == value

    class Answer(pydantic.BaseModel):  # the client's own schema from a model (strict), parsed back into it
        ok: bool
        n: int = pydantic.Field(ge=0, le=9)

    parsed = oai.responses.parse(model="any", input=ASK, max_output_tokens=64, temperature=0, text_format=Answer)
    assert isinstance(parsed.output_parsed, Answer) and 0 <= parsed.output_parsed.n <= 9


def test_disconnect_mid_stream_cancels_at_the_daemon(stack):
    d, front = stack
    with httpx.stream("POST", front.url + "/v1/responses", timeout=60,
                      json={"model": "any", "input": ASK, "max_output_tokens": 4000, "stream": True}) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        rid = json.loads(first[len("data: "):])["response"]["id"].removeprefix("resp_")
        next(line for line in lines if "response.output_text.delta" in line)
    deadline = time.monotonic() + 30
    while rid not in terminal_events(d.log_path) and time.monotonic() < deadline:
        time.sleep(0.1)
    ends = terminal_events(d.log_path)[rid]
    assert [e.get("finish_reason") for e in ends] == ["cancelled"] and ends[0]["completion_tokens"] < 4000


@pytest.mark.parametrize("body, param, words", [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "stores no responses"),
    ({"conversation": "conv_1"}, "conversation", "stores no responses"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "web_search"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[0].type", "only function tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": RESPONSES_TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice",
     "not among the tools"),
    ({"input": ""}, "input", "empty"),
    ({"input": [{"type": "function_call_output", "call_id": "call_9", "output": "x"}]}, "input[0].call_id",
     "no function_call"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0]", "input_image"),
    ({"input": [{"type": "computer_call_output", "call_id": "c"}]}, "input[0].type", "not supported"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]", "stored responses"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "robot"),
    ({"text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format.schema", "JSON Schema"),
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"temperature": "hot"}, "temperature", "number"),
    ({"frobnicate": 1}, "frobnicate", "unrecognized"),
    ({"truncation": "auto"}, "truncation", "never drops input"),
    ({"background": True}, "background", "stores no responses"),
])
def test_bad_requests_are_400_in_openais_error_shape(stack, oai, body, param, words):
    full = {"model": "any", "input": ASK, "max_output_tokens": 4, **body}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            oai.responses.create(model="any", stream=stream, extra_body=full)
        err = info.value.body
        assert err["param"] == param and words in err["message"] and err["type"] == "invalid_request_error", err
    raw = httpx.post(stack[1].url + "/v1/responses", json=full, timeout=30)
    assert raw.status_code == 400 and set(raw.json()) == {"error"}
    assert set(raw.json()["error"]) == {"message", "type", "param", "code"}


def test_bad_json_and_metrics(stack):
    url = stack[1].url
    r = httpx.post(url + "/v1/responses", content=b"{nope", headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(url + "/v1/responses", json=["a list"], timeout=30)
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    httpx.post(url + "/v1/responses", json={"model": "any", "input": "Hi", "max_output_tokens": 2}, timeout=60)
    text = httpx.get(url + "/metrics", timeout=30).text
    assert 'route="responses"' in text and 'status="400"' in text
    assert any('route="responses"' in line and 'status="200"' in line for line in text.splitlines())
