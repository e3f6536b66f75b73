"""The tool-call parser (daemon/tool_calls.py): both formats, streamed at every split point,
never a partial tag in the text, malformed calls kept as text; and the grammar
(daemon/tool_grammar.py) admits exactly what the parser reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daemon.tool_calls import CLOSE, OPEN, ToolCallStream, parse_tool_calls
from daemon.tool_grammar import JSON, XML, ToolGrammarError, check_lark, tool_call_lark, tool_constraint, tool_format
from protocol import messages as m

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)

TOOLS = [
    m.ToolSpec(name="get_weather", parameters={"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "units": {"enum": ["c", "f"]}},
        "required": ["city"]}),
    m.ToolSpec(name="search", parameters={"type": "object", "properties": {"query": {"type": "string"},
                                                                             "filters": {"type": "object"}}}),
]


def cid(i: int) -> str:
    return f"call_{i}"


def xml_call(name: str, args: dict) -> str:
    params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                     for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def json_call(name: str, args: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def stream_all(text: str, cuts: list[int]) -> tuple[list[str], list[m.ToolCall]]:
    s = ToolCallStream(TOOLS, cid)
    pieces, calls, last = [], [], 0
    for c in sorted(set(cuts)) + [len(text)]:
        out, new = s.feed(text[last:c])
        pieces.append(out)
        calls += new
        last = c
    out, new = s.finish()
    return pieces + [out], calls + new


def test_xml_call_with_typed_parameters():
    text = "Let me look.\n\n" + xml_call("get_weather", {"city": "Paris <b>x</b>", "days": 3, "units": "c"})
    out, calls = parse_tool_calls(text, TOOLS, cid)
    assert out == "Let me look."
    assert [(c.id, c.name) for c in calls] == [("call_0", "get_weather")]
    # days is an integer in the schema: read as JSON; city (string) and units (untyped enum) as text.
    assert json.loads(calls[0].arguments) == {"city": "Paris <b>x</b>", "days": 3, "units": "c"}


def test_json_calls_parallel_and_arguments_as_text():
    text = (json_call("search", {"query": "rivers", "filters": {"n": 2}}) + "\n"
            + '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>')
    out, calls = parse_tool_calls(text, TOOLS, cid)
    assert out == ""
    assert [c.name for c in calls] == ["search", "get_weather"]
    assert json.loads(calls[0].arguments) == {"query": "rivers", "filters": {"n": 2}}
    assert json.loads(calls[1].arguments) == {"city": "Rome"}


@pytest.mark.parametrize("bad", [
    "<tool_call>not a call</tool_call>",
    '<tool_call>{"name": "unknown_tool", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "search", "arguments": [1]}</tool_call>',
    "<tool_call>\n<function=get_weather>\nstray text\n</function>\n</tool_call>",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n",  # never closed
    '<tool_call>{"name": "search", "argu',
])
def test_malformed_calls_stay_text(bad):
    out, calls = parse_tool_calls("before " + bad, TOOLS, cid)
    assert calls == [] and out == "before " + bad


def test_text_without_calls_is_untouched_including_near_tags():
    text = "a <tool b <tool_cal c </tool_call> d\n\n  "
    assert parse_tool_calls(text, TOOLS, cid) == (text, [])


PIECES = st.lists(st.one_of(
    st.text(alphabet="ab <>/_=\n{}\"", max_size=12),
    st.sampled_from(["<tool_call>", "</tool_call>", "<tool_", "\n", "  ", "<function=search>"]),
    st.builds(xml_call, st.sampled_from(["get_weather", "search"]),
              st.fixed_dictionaries({"city": st.text(alphabet="Pa ris<>/\n", max_size=8)})),
    st.builds(json_call, st.sampled_from(["get_weather", "search", "nope"]),
              st.dictionaries(st.sampled_from(["city", "query"]), st.text(max_size=5), max_size=2)),
), max_size=6)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pieces=PIECES, data=st.data())
def test_streaming_equals_whole_parse_at_any_chunking(pieces, data):
    text = "".join(pieces)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    whole_text, whole_calls = parse_tool_calls(text, TOOLS, cid)
    streamed, calls = stream_all(text, cuts)
    assert "".join(streamed) == whole_text
    assert calls == whole_calls


@settings(max_examples=200, deadline=None)
@given(pieces=PIECES)
def test_every_split_point_streams_the_same_and_no_chunk_holds_a_partial_tag(pieces):
    text = "".join(pieces)
    whole_text, whole_calls = parse_tool_calls(text, TOOLS, cid)
    for cut in range(len(text) + 1):
        streamed, calls = stream_all(text, [cut])
        assert "".join(streamed) == whole_text and calls == whole_calls
    # Char by char. Chunks are only ever appended, so "their concatenation is the final text"
    # means no chunk ever carried a piece of a call or of a tag that later became one.
    streamed, calls = stream_all(text, list(range(len(text))))
    assert "".join(streamed) == whole_text and calls == whole_calls
    sent = ""
    for piece in streamed:
        sent += piece
        assert whole_text.startswith(sent)


def test_a_call_streamed_token_by_token_never_leaks_into_text():
    text = "Sure." + "\n" + xml_call("get_weather", {"city": "Oslo", "days": 2})
    streamed, calls = stream_all(text, list(range(len(text))))
    assert "".join(streamed) == "Sure."
    assert all("<" not in piece for piece in streamed)
    assert len(calls) == 1 and json.loads(calls[0].arguments) == {"city": "Oslo", "days": 2}


# ------------------------------------------------------------------------------ grammar


def test_format_follows_the_template():
    assert tool_format("... <function=example_function_name> ...") == XML
    assert tool_format("... <tool_call>\n{\"name\": ...") == JSON
    assert tool_format(None) == JSON


@pytest.mark.parametrize("fmt", [XML, JSON])
@pytest.mark.parametrize("thinking", [False, True])
def test_grammar_compiles_for_each_format(fmt, thinking):
    check_lark(tool_call_lark(TOOLS, "required", True, fmt, thinking))
    check_lark(tool_call_lark(TOOLS, m.NamedToolChoice(name="search"), False, fmt, thinking))


def _generate(**kw) -> m.Generate:
    return m.Generate(request_id="r", messages=[m.ChatMessage(role="user", content="hi")], **kw)


def test_constraint_only_for_forced_choices():
    assert tool_constraint(_generate(tools=TOOLS), "<function=") is None
    assert tool_constraint(_generate(tools=TOOLS, tool_choice="auto"), "<function=") is None
    assert tool_constraint(_generate(tools=TOOLS, tool_choice="none"), "<function=") is None
    c = tool_constraint(_generate(tools=TOOLS, tool_choice="required"), "<function=")
    assert c.kind == "lark" and "<function=get_weather>" in c.value and "<function=search>" in c.value
    c = tool_constraint(_generate(tools=TOOLS, tool_choice=m.NamedToolChoice(name="search")), None)
    assert c.kind == "lark" and '"search"' in c.value and "get_weather" not in c.value


def test_unknown_named_tool_and_unsupported_schema_are_refused_by_name():
    with pytest.raises(ToolGrammarError, match="'nope'"):
        tool_constraint(_generate(tools=TOOLS, tool_choice=m.NamedToolChoice(name="nope")), None)
    bad = [m.ToolSpec(name="f", parameters={"type": "object", "properties": {"a": {"not": {"type": "string"}}}})]
    for template in (None, "<function="):
        with pytest.raises(ToolGrammarError, match='"not"'):
            tool_constraint(_generate(tools=bad, tool_choice="required"), template)


@pytest.fixture(scope="module")
def ll_tokenizer():
    import llguidance.hf
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(Path(__file__).resolve().parents[2] / "daemon" / "assets" / "tiny-qwen35"))
    return tok, llguidance.hf.from_tokenizer(tok)


@pytest.mark.parametrize("fmt", [XML, JSON])
@pytest.mark.parametrize("thinking", [False, True])
def test_grammar_admits_what_the_parser_reads_and_refuses_what_breaks_the_schema(ll_tokenizer, fmt, thinking):
    import llguidance

    tok, lt = ll_tokenizer
    make = xml_call if fmt == XML else json_call
    good = make("get_weather", {"city": "Paris </b> x", "days": 3, "units": "f"}) + "\n" + make("search", {"query": "q"})
    bad_enum = make("get_weather", {"city": "Oslo", "units": "kelvin"})
    bad_type = make("get_weather", {"city": "Oslo", "days": "three"})
    prefix = "I should call the tools </b></think>\n\n" if thinking else ""
    grammar = llguidance.grammar_from("lark", tool_call_lark(TOOLS, "required", True, fmt, thinking))

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(lt, grammar)
        return matcher.consume_tokens(tok.encode(prefix + text, add_special_tokens=False)) and matcher.is_accepting()

    assert accepts(good)
    assert not accepts(bad_enum) and not accepts(bad_type) and not accepts("plain text")
    _, calls = parse_tool_calls(good, TOOLS, cid)
    assert [json.loads(c.arguments) for c in calls] == [{"city": "Paris </b> x", "days": 3, "units": "f"},
                                                        {"query": "q"}]
