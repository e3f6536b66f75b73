"""Forced tool calls and schema answers close, and no tool markup ever reaches a client as
text: `councild http` in front of a live daemon, the official openai and anthropic clients,
held-out schemas (tests/tool_cases.py). The bundled model (trained on Python only) never ends a
string on its own, so what closes the calls here is the grammar: the format's tags kept out
of values, free strings capped ([constraint] string_max_chars, or the request's own).
bench/tool_close_bench.py measures the same on the bundled model over every case."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from http_harness import anthropic_client, daemon_behind_front, openai_client
from tool_cases import ANSWERS, ASK_TOOL, TOOLS, anthropic_tool, errors, openai_tool

from daemon.paths import BUNDLED_MODEL
from protocol import Client

MARKUP = ("<tool_call", "</tool_call", "<function", "</function", "<parameter", "</parameter")
FORCED = ["write_file", "grep", "create_event", "resize_image", "deploy"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    # The bundled model with the daemon's default cap: the case the issue was filed on.
    with daemon_behind_front(tmp_path_factory.mktemp("http-tool-close"), BUNDLED_MODEL) as both:
        yield both


@pytest.fixture
def oai(stack):
    return openai_client(stack[1])


@pytest.fixture
def claude(stack):
    return anthropic_client(stack[1])


def ask(name: str) -> list[dict]:
    return [{"role": "user", "content": ASK_TOOL.format(name=name, description=TOOLS[name][0])}]


@pytest.mark.parametrize("name", FORCED)
def test_forced_calls_close_valid(oai, name):
    r = oai.chat.completions.create(model="any", messages=ask(name), max_tokens=128, temperature=0,
                                    tools=[openai_tool(name)], parallel_tool_calls=False,
                                    tool_choice={"type": "function", "function": {"name": name}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [call] = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == name and errors(args, TOOLS[name][1]) == []
    assert r.usage.completion_tokens <= 128
    # The daemon's cap, lowered to fit max_tokens (128: 64 characters for a free string), bounds every one.
    assert all(len(v) <= 64 for v in args.values() if isinstance(v, str))


def test_the_request_field_overrides_the_daemons_string_cap(oai):
    kw = dict(model="any", messages=ask("read_file"), max_tokens=200, temperature=0, parallel_tool_calls=False,
              tools=[openai_tool("read_file")], tool_choice="required")
    short = oai.chat.completions.create(**kw, extra_body={"string_max_chars": 3})
    longer = oai.chat.completions.create(**kw, extra_body={"string_max_chars": 40})
    assert len(json.loads(short.choices[0].message.tool_calls[0].function.arguments)["path"]) <= 3
    assert len(json.loads(longer.choices[0].message.tool_calls[0].function.arguments)["path"]) <= 40
    assert short.usage.completion_tokens < longer.usage.completion_tokens
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(**kw, extra_body={"string_max_chars": -1})
    assert info.value.body["param"] == "string_max_chars"
    with pytest.raises(anthropic.BadRequestError):
        anthropic.Anthropic(base_url=str(oai.base_url).removesuffix("/v1/"), api_key="x", max_retries=0).messages.create(
            model="any", max_tokens=8, messages=ask("read_file"), extra_body={"string_max_chars": "many"})


@pytest.mark.parametrize("name", ["summary", "address", "user", "recipe"])
def test_json_schema_answers_with_free_strings_are_valid_within_160_tokens(oai, name):
    r = oai.chat.completions.create(
        model="any", max_tokens=160, temperature=0, messages=[{"role": "user", "content": f"JSON {name}"}],
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": ANSWERS[name],
                                                                "strict": True}})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens <= 160
    assert errors(json.loads(r.choices[0].message.content), ANSWERS[name]) == []


# ------------------------------------------------------------------ cut calls, every route

CUT_TOOL = "write_file"  # two free strings: plenty of places to cut
CUTS = [1, 2, 3, 5, 8, 12, 16, 20, 25, 30, 36]


def _no_markup(text: str | None) -> None:
    assert not any(tag in (text or "") for tag in MARKUP), text


def test_openai_calls_cut_by_max_tokens_are_calls_never_text(oai):
    full = oai.chat.completions.create(model="any", messages=ask(CUT_TOOL), max_tokens=128, temperature=0,
                                       tools=[openai_tool(CUT_TOOL)], tool_choice="required",
                                       parallel_tool_calls=False, extra_body={"string_max_chars": 64})
    assert full.choices[0].finish_reason == "tool_calls"
    cut_seen = 0
    for n in CUTS:
        kw = dict(model="any", messages=ask(CUT_TOOL), max_tokens=n, temperature=0, tools=[openai_tool(CUT_TOOL)],
                  tool_choice="required", parallel_tool_calls=False, extra_body={"string_max_chars": 64})
        r = oai.chat.completions.create(**kw)
        choice = r.choices[0]
        _no_markup(choice.message.content)
        assert choice.finish_reason == "length" and not choice.message.content
        # The one tool a forced choice allows: a call, its arguments as far as generated.
        [call] = choice.message.tool_calls
        args = json.loads(call.function.arguments)
        assert call.function.name == CUT_TOOL and set(args) <= {"path", "content"}
        # (Not a prefix of the uncut call's: the cap on strings follows max_tokens.)
        assert all(isinstance(v, str) and len(v) <= 64 for v in args.values())
        cut_seen += bool(args)
        chunks = list(oai.chat.completions.create(**kw, stream=True))
        for c in chunks:
            if c.choices:
                _no_markup(c.choices[0].delta.content)
        deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == [(CUT_TOOL, args)]
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert cut_seen >= 3  # the sweep did cut inside the arguments, not only before them


def test_anthropic_calls_cut_by_max_tokens_are_tool_use_blocks(claude):
    for n in CUTS:
        kw = dict(model="any", max_tokens=n, extra_body={"temperature": 0}, messages=ask(CUT_TOOL),
                  tools=[anthropic_tool(CUT_TOOL)], tool_choice={"type": "tool", "name": CUT_TOOL,
                                                                 "disable_parallel_tool_use": True})
        out = claude.messages.create(**kw)
        assert out.stop_reason == "max_tokens"
        assert [b.type for b in out.content] == ["tool_use"], out.content
        assert out.content[0].name == CUT_TOOL and set(out.content[0].input) <= {"path", "content"}
        with claude.messages.stream(**kw) as stream:
            final = stream.get_final_message()
            _no_markup("".join(stream.text_stream))
        assert final.stop_reason == "max_tokens"
        assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", CUT_TOOL, out.content[0].input)]


def test_anthropic_any_closes_valid(claude):
    out = claude.messages.create(model="any", max_tokens=128, extra_body={"temperature": 0}, messages=ask("deploy"),
                                 tools=[anthropic_tool("deploy"), anthropic_tool("set_timer")],
                                 tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert out.stop_reason == "tool_use"
    [use] = [b for b in out.content if b.type == "tool_use"]
    assert not [b for b in out.content if b.type == "text"] and errors(use.input, TOOLS[use.name][1]) == []


def test_the_protocol_reports_a_cut_call_as_a_call(stack):
    with Client(stack[0].endpoint, seat="cutter") as c:
        tools = [{"name": CUT_TOOL, "description": "", "parameters": TOOLS[CUT_TOOL][1]}]
        done = c.complete(messages=ask(CUT_TOOL), tools=tools, tool_choice={"name": CUT_TOOL}, max_tokens=12,
                          parallel_tool_calls=False)
        assert done.finish_reason == "length" and done.text == ""
        assert [t.name for t in done.tool_calls] == [CUT_TOOL]
        stream = c.generate(messages=ask(CUT_TOOL), tools=tools, tool_choice={"name": CUT_TOOL}, max_tokens=12,
                            parallel_tool_calls=False, string_max_chars=4)
        assert list(stream) == []  # no text chunk at all
        assert stream.done.finish_reason == "length" and [t.name for t in stream.done.tool_calls] == [CUT_TOOL]
        assert all(len(v) <= 4 for v in json.loads(stream.done.tool_calls[0].arguments).values())
