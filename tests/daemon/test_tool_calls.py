"""The tool-call parser (daemon/request_text/tool_calls.py): both formats, streamed at every split point,
never a partial tag in the text, never the format's markup in the text (malformed calls read
leniently or dropped, cut calls reported as far as they go); and the grammar
(daemon/request_text/tool_grammar.py) admits exactly what the parser reads, bounds free strings and keeps
the format's tags out of values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daemon.request_text.tool_calls import CLOSE, OPEN, ToolCallStream, parse_tool_calls
from daemon.request_text.tool_grammar import JSON, XML, ToolGrammarError, check_lark, tool_call_lark, tool_constraint, tool_format
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


@pytest.mark.parametrize("bad, calls", [
    ("<tool_call>not a call</tool_call>", []),
    ('<tool_call>{"name": "unknown_tool", "arguments": {}}</tool_call>', []),
    ("<tool_call>\n<function=unknown_tool>\n</function>\n</tool_call>", []),
    ('<tool_call>{"name": "search", "arguments": [1]}</tool_call>', [("search", {})]),
    ("<tool_call>\n<function=get_weather>\nstray text\n</function>\n</tool_call>", [("get_weather", {})]),
    # Never closed (cut): the call as far as it goes.
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n", [("get_weather", {"city": "Paris"})]),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", [("get_weather", {"city": "Par"})]),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</param",
     [("get_weather", {"city": "Paris"})]),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n1",
     [("get_weather", {"city": "Oslo", "days": 1})]),
    ("<tool_call>\n<function=get_weather>\n<parameter=days>\ntr", [("get_weather", {})]),
    ("<tool_call>\n<function=get_wea", [("get_weather", {})]),  # the one tool the cut name fits
    ("<tool_call>\n<function=", []),  # which tool: unknown
    ('<tool_call>{"name": "search", "argu', [("search", {})]),
    ('<tool_call>{"name": "search", "arguments": {"query": "riv', [("search", {"query": "riv"})]),
    ('<tool_call>{"name": "search", "arguments": {"query": "a", "filters": {"n": [1, 2', [
        ("search", {"query": "a", "filters": {"n": [1, 2]}})]),
    ('<tool_call>{"name": "sea', [("search", {})]),
    ('<tool_call>{"name": "zz', []),
    # Without the outer tag; a stray closing tag.
    ("<function=search>\n<parameter=query>\nq\n</parameter>\n</function>\n</tool_call>", [("search", {"query": "q"})]),
    ("</tool_call>", []),
    ("<parameter=city>\nParis\n</parameter>", []),
])
def test_malformed_and_cut_calls_never_leave_markup_in_the_text(bad, calls):
    out, got = parse_tool_calls("before " + bad, TOOLS, cid)
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert out.rstrip() == ("before \nParis" if bad.startswith("<parameter=") else "before")


def test_a_forced_call_cut_before_its_name_is_still_the_forced_call():
    for cut in ("<", "<tool", "<tool_call>", "<tool_call>\n<func", "<tool_call>\n<function=se"):
        out, calls = parse_tool_calls(cut, TOOLS, cid, forced="search")
        assert out == "" and [(c.name, c.arguments) for c in calls] == [("search", "{}")], cut
    # Without a forced name the tail that began a tag is dropped, a lone "<" stays text.
    assert parse_tool_calls("x <tool", TOOLS, cid) == ("x", [])
    assert parse_tool_calls("x <", TOOLS, cid) == ("x <", [])


def test_close_json_keeps_the_longest_usable_prefix():
    from daemon.request_text.tool_calls import _NOTHING, close_json

    assert close_json('{"a": [1, "x') == {"a": [1, "x"]}
    assert close_json('{"a": 1, "b') == {"a": 1}
    assert close_json('{"a": "q\\u00') == {"a": "q"}
    assert close_json('[{"k": tr') == [{}]
    assert close_json("tr") is _NOTHING


def test_text_without_calls_is_untouched_including_near_tags_but_stray_tags_go():
    text = "a <tool b <tool_cal c <function d\n\n  "
    assert parse_tool_calls(text, TOOLS, cid) == (text, [])
    assert parse_tool_calls("a </tool_call> b </parameter>", TOOLS, cid) == ("a  b ", [])
    # What a dropped tag split is read again as one: it may be a tag.
    out, calls = parse_tool_calls("<tool</tool_call>_call>\n<function=search>\n</function>\n</tool_call>", TOOLS, cid)
    assert out == "" and [c.name for c in calls] == ["search"]


MARKUP = ("<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>")


PIECES = st.lists(st.one_of(
    st.text(alphabet="ab <>/_=\n{}\"", max_size=12),
    st.sampled_from(["<tool_call>", "</tool_call>", "<tool_", "\n", "  ", "<function=search>", "</function>",
                     "<parameter=city>", "</parameter>", "<parameter=", "<function="]),
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
    assert not any(tag in whole_text for tag in MARKUP), whole_text
    assert all(isinstance(json.loads(c.arguments), dict) for c in calls)


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


def test_an_enum_that_is_not_an_array_is_not_text_and_breaks_nothing():
    """`"enum": true` (a malformed schema the HTTP fuzzer sent) was a TypeError in the call
    parser's set-up, an internal error for tool_choice auto; forced, the grammar refuses it."""
    bad = [m.ToolSpec(name="lookup", parameters={"type": "object", "properties": {
        "u": {"type": "string", "enum": True}, "w": {"enum": "ab"}}})]
    out, calls = parse_tool_calls(xml_call("lookup", {"u": "x"}), bad, cid)
    assert [json.loads(c.arguments) for c in calls] == [{"u": "x"}]
    assert tool_constraint(_generate(tools=bad, tool_choice="auto"), "<function=") is None
    with pytest.raises(ToolGrammarError, match="enum"):
        tool_constraint(_generate(tools=bad, tool_choice="required"), "<function=")


@pytest.mark.parametrize("inner", [1, [{"lat": {"type": "number"}}]])
def test_a_nested_properties_that_is_not_an_object_is_refused_not_a_crash(inner):
    """Deeper than the protocol's check (top-level properties): counting a schema's free
    strings read .values() of a nested properties of 1 (AttributeError, an internal error);
    the HTTP fuzzer's long run found it."""
    bad = [m.ToolSpec(name="f", parameters={"type": "object", "properties": {
        "where": {"type": "object", "properties": inner}}})]
    for choice in ("required", m.NamedToolChoice(name="f")):
        try:
            tool_constraint(_generate(tools=bad, tool_choice=choice), "<function=")
        except ToolGrammarError:
            pass  # refused by name is as good as enforced


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


def test_bound_schema_caps_free_strings_only():
    from daemon.request_text.tool_grammar import NO_TAGS_PATTERN, bound_schema

    schema = {"type": "object", "properties": {
        "free": {"type": "string"}, "short": {"type": "string", "maxLength": 5}, "long": {"type": "string",
                                                                                           "maxLength": 500},
        "enum": {"type": "string", "enum": ["a" * 100]}, "when": {"type": "string", "format": "date"},
        "list": {"type": "array", "items": {"type": ["string", "null"]}},
        "deep": {"anyOf": [{"type": "object", "properties": {"x": {"type": "string", "minLength": 80}}}]}},
        "$defs": {"d": {"type": "string"}}}
    out = bound_schema(schema, 64, True)
    p = out["properties"]
    assert p["free"] == {"type": "string", "maxLength": 64, "pattern": NO_TAGS_PATTERN}
    assert p["short"]["maxLength"] == 5 and p["long"]["maxLength"] == 64
    assert p["enum"] == schema["properties"]["enum"] and p["when"] == schema["properties"]["when"]
    assert p["list"]["items"]["maxLength"] == 64
    assert p["deep"]["anyOf"][0]["properties"]["x"]["maxLength"] == 80  # its minLength wins over the cap
    assert out["$defs"]["d"]["maxLength"] == 64
    assert bound_schema(schema, 0, False) == schema and "maxLength" not in schema["properties"]["free"]


@pytest.mark.parametrize("fmt", [XML, JSON])
def test_grammar_keeps_tags_out_of_values_and_bounds_strings(ll_tokenizer, fmt):
    import llguidance

    tok, lt = ll_tokenizer
    tools = [m.ToolSpec(name="write", parameters={"type": "object", "properties": {
        "path": {"type": "string"}, "note": {"type": "string", "maxLength": 8},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2}}, "required": ["path"]})]
    make = xml_call if fmt == XML else json_call

    def accepts(text: str, cap: int) -> bool:
        matcher = llguidance.LLMatcher(lt, llguidance.grammar_from("lark", tool_call_lark(
            tools, "required", False, fmt, False, cap)))
        return matcher.consume_tokens(tok.encode(text, add_special_tokens=False)) and matcher.is_accepting()

    assert accepts(make("write", {"path": "/a/b.txt", "note": "x </b> y", "tags": ["a <b>"]}), 64)
    for tag in ("<parameter=x>", "</parameter>", "<function=f>", "</tool_call>", "<tool_call>", "</function>"):
        assert not accepts(make("write", {"path": "a" + tag}), 64), tag
        assert not accepts(make("write", {"path": "a", "tags": [tag]}), 64), tag
    assert accepts(make("write", {"path": "p" * 64}), 64) and not accepts(make("write", {"path": "p" * 65}), 64)
    assert accepts(make("write", {"path": "p" * 300}), 0)  # no cap
    assert not accepts(make("write", {"path": "p", "note": "n" * 9}), 0)  # the schema's own maxLength
    assert not accepts(make("write", {"path": "p", "tags": ["a", "b", "c"]}), 0)  # and maxItems
    check_lark(tool_call_lark(tools, "required", True, fmt, True, 64))


def test_text_parameter_pattern_is_enforced_where_llguidance_reads_it(ll_tokenizer):
    import llguidance

    tok, lt = ll_tokenizer
    tools = [m.ToolSpec(name="when", parameters={"type": "object", "properties": {
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}$"}}, "required": ["date"]})]
    grammar = llguidance.grammar_from("lark", tool_call_lark(tools, "required", False, XML, False, 64))

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(lt, grammar)
        return matcher.consume_tokens(tok.encode(text, add_special_tokens=False)) and matcher.is_accepting()

    assert accepts(xml_call("when", {"date": "2026-12"})) and not accepts(xml_call("when", {"date": "12-2026"}))
