"""A request with tools on the engine thread's side (daemon/request_text/requests.py Job): committed
tokens -> Tokens chunks whose tool_calls are the Done's, thinking kept apart, no part of a
call in any chunk's text, finish_reason tool_calls. The bundled model's real tokenizer."""

from __future__ import annotations

import json

import pytest

from daemon.request_text.detokenize import CommittedText
from daemon.engine.types import DecodeStep
from daemon.paths import BUNDLED_MODEL
from daemon.request_text.reasoning import ReasoningSplit
from daemon.request_text.requests import Job
from protocol import messages as m

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)

TOOLS = [m.ToolSpec(name="get_weather", parameters={"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}}})]
CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n" \
       "</function>\n</tool_call>"


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(BUNDLED_MODEL))


def run(tok, text: str, per_step: int, stream: bool = True, thinking: bool = False, tools=TOOLS):
    msg = m.Generate(request_id="r1", messages=[m.ChatMessage(role="user", content="hi")], tools=tools,
                     max_tokens=4096, stream=stream)
    job = Job(msg=msg, identity=b"c", seat="s", priority="normal", weight=1.0, deadline=None, received_at=0.0)
    prompt = tok.encode("<|im_start|>assistant\n")
    job.prompt = prompt
    job.reasoning = ReasoningSplit("<think>", "</think>", starts_inside=True) if thinking else None
    job.start(None, CommittedText(tok, prompt), "off")
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok.encode(text, add_special_tokens=False) + [eos]
    chunks = []
    for i in range(0, len(ids), per_step):
        kept = job.absorb(DecodeStep(tokens=ids[i:i + per_step]), frozenset({eos}))
        if stream:
            c = job.chunk(kept)
            if c is not None:
                chunks.append(c)
        if job.finished_reason is not None:
            break
    if stream:  # what the worker's _finish flushes
        c = job.chunk([])
        if c is not None:
            chunks.append(c)
    return chunks, job.done()


@pytest.mark.parametrize("per_step", [1, 2, 5])
def test_streamed_calls_are_the_done_calls_and_never_text(tok, per_step):
    chunks, done = run(tok, "Let me check.\n" + CALL + "\n" + CALL.replace("Paris", "Rome"), per_step)
    assert done.finish_reason == "tool_calls" and done.text == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in done.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Rome", "days": 2})]
    assert [c.id for c in done.tool_calls] == ["call_r1_0", "call_r1_1"]
    assert "".join(c.text for c in chunks) == done.text
    assert all("<" not in c.text for c in chunks)
    assert [t for c in chunks for t in (c.tool_calls or [])] == done.tool_calls
    assert [c.seq for c in chunks] == list(range(len(chunks)))


def test_thinking_stays_reasoning_and_a_call_inside_it_is_not_a_call(tok):
    text = "maybe " + CALL + " no.</think>\n\n" + CALL
    chunks, done = run(tok, text, 3, thinking=True)
    assert done.reasoning == "maybe " + CALL + " no." and "".join(c.reasoning for c in chunks) == done.reasoning
    assert len(done.tool_calls) == 1 and done.text == "" and done.finish_reason == "tool_calls"
    assert [t for c in chunks for t in (c.tool_calls or [])] == done.tool_calls


def test_without_streaming_and_without_tools(tok):
    _, done = run(tok, "ok " + CALL, 4, stream=False)
    assert done.text == "ok" and len(done.tool_calls) == 1 and done.finish_reason == "tool_calls"
    chunks, done = run(tok, "ok " + CALL, 4, tools=None)  # no tools: the text is the text
    assert done.text == "ok " + CALL and done.tool_calls == [] and done.finish_reason == "stop"
    assert "".join(c.text for c in chunks) == done.text


def test_a_call_never_closed_is_still_a_call_and_never_text(tok):
    # Cut inside its first parameter's tag: the call with what was generated (nothing yet),
    # never the template's markup as text (a client would show it to the user).
    chunks, done = run(tok, "a " + CALL[:40], 2)
    assert [(c.name, json.loads(c.arguments)) for c in done.tool_calls] == [("get_weather", {})]
    assert "<" not in done.text and done.text.strip() == "a"
    assert "".join(c.text for c in chunks) == done.text
    assert [t for c in chunks for t in (c.tool_calls or [])] == done.tool_calls


def test_the_bundled_template_shows_tools_and_calls_the_qwen35_way(tok):
    from daemon.request_text.intake import template_message, template_tool
    from daemon.request_text.tool_calls import parse_tool_calls
    from daemon.request_text.tool_grammar import XML, tool_format

    call = m.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris", "days": 2}')
    chat = [m.ChatMessage(role="user", content="hi"), m.ChatMessage(role="assistant", content="", tool_calls=[call]),
            m.ChatMessage(role="tool", content="sunny", tool_call_id="call_1")]
    text = tok.apply_chat_template([template_message(c) for c in chat], tools=[template_tool(TOOLS[0])],
                                   add_generation_prompt=True, tokenize=False)
    assert '"name": "get_weather"' in text and "<tool_response>\nsunny\n</tool_response>" in text
    assert tool_format(tok.chat_template) == XML
    # The earlier call is rendered in the format the parser reads back to the same call.
    shown = text[text.index("<tool_call>\n<function=get_weather>"):]
    shown = shown[: shown.index("</tool_call>") + len("</tool_call>")]
    assert parse_tool_calls(shown, TOOLS, lambda i: "call_1") == ("", [call])
    plain = tok.apply_chat_template([template_message(chat[0])], add_generation_prompt=True, tokenize=False)
    assert plain == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"  # unchanged without tools
