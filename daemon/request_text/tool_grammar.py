"""The grammar that makes a model call a tool: tool_choice "required" or a named function.

Built as llguidance's Lark dialect (``Generate.constraint`` kind ``lark``) in the format the
model's chat template teaches it (daemon/request_text/tool_calls.py parses the same two): Qwen3.5 /
Qwen3-Coder XML, where each parameter is its own element, or Hermes JSON inside
``<tool_call>``. Arguments follow each tool's JSON Schema: in JSON, the whole arguments
object is one ``%json`` schema; in XML, a typed parameter's value is ``%json`` of its
property schema and a string parameter is text without ``</`` (so its closing tag ends it).
A thinking model may think first: the grammar lets a ``</think>``-terminated block come
before the calls, so reasoning stays free and only the answer is constrained.

Forced calls close. No value may hold one of the format's own tags (``TAGS``: no parser
could read such a call back, and a model that loops on them never ends the value); a text
parameter honours its ``minLength``/``maxLength`` (and its ``pattern`` where llguidance can
read it), JSON values their whole schema (``maxItems`` included). ``bound_schema`` also caps
every free string (no ``maxLength``, no ``enum``/``const``) at the request's
``string_max_chars`` (else the daemon's ``[constraint]`` default): a model that never ends a
string on its own (the bundled one writes Python forever) still closes the call. The same
cap applies to ``json_schema`` answers (daemon/request_text/intake.py).

Pure string building plus llguidance's grammar check (no tokenizer, no mlx): a schema that
llguidance cannot compile is refused here, naming the construct, before any work starts.
"""

from __future__ import annotations

import json
import re

import llguidance

from protocol import messages as m

from .tool_calls import is_text_param

XML, JSON = "xml", "json"
# The call format's own tags. A value holding one could not be read back (the parser ends
# the call, function or parameter there), so no value inside a forced call may hold one.
TAGS = ("<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>")
# Bounds on a whole schema walk (bound_schema): deeper schemas are left as they are.
_MAX_DEPTH = 64


def _no_words_pattern(words: tuple[str, ...]) -> str:
    """An anchored regex (JSON Schema ``pattern`` syntax) for text holding none of ``words``,
    each of which starts with ``<`` and holds no other ``<``: split the text at every ``<``;
    it holds a word exactly when some piece after a ``<`` starts with that word's tail, so
    each piece must either stop inside a tail's prefix or leave the trie of tails."""
    root: dict = {}
    for w in words:
        node = root
        for ch in w[1:]:
            node = node.setdefault(ch, {})
        node[None] = True

    def esc(ch: str) -> str:
        return "\\" + ch if ch in "\\^]-[/" else ch

    def piece(node: dict) -> str:
        kids = sorted(k for k in node if k is not None)
        alts = ["[^<" + "".join(esc(c) for c in kids) + "][^<]*"]
        alts += [esc(c) + piece(node[c]) for c in kids if None not in node[c]]
        return "(?:" + "|".join(alts) + ")?"

    return "^[^<]*(?:<" + piece(root) + ")*$"


NO_TAGS_PATTERN = _no_words_pattern(TAGS)
# The same rule as a Lark regex (text params of the XML format). Positive, not as a negation
# (~/.*TAG.*/): intersected with a length bound, the negation made llguidance's lexer build
# too many expressions once a value began a tag; this form stays small.
_NO_TAGS_LARK = "/" + NO_TAGS_PATTERN[1:-1] + "/"


def _pattern_floor(pattern: object) -> int | None:
    """For a pattern that admits strings of any length: the length of its shortest match
    (a cap never goes below it, or no value would be left); None for a pattern whose own
    matches are bounded (or that Python's parser cannot read): it is the schema's own bound."""
    try:
        lo, hi = re._parser.parse(pattern).getwidth()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - an ECMAScript construct Python does not read
        return None
    anchored = pattern.startswith("^") and pattern.endswith("$")  # else it searches: any text around
    return lo if hi >= (1 << 16) or not anchored else None


def _is_free_string(schema: dict) -> bool:
    t = schema.get("type")
    if not (t == "string" or (isinstance(t, list) and "string" in t)):
        return False
    if "pattern" in schema and _pattern_floor(schema["pattern"]) is None:
        return False
    return not any(k in schema for k in ("enum", "const", "format"))


# An integer with no bound of its own gets JSON's safe range (what a double holds exactly):
# a model writing digits forever then still ends the number.
SAFE_INT = (1 << 53) - 1


def string_slots(schema, _depth: int = 0) -> int:
    """How many free strings a value of ``schema`` holds (an array's items counted
    maxItems times, twice without it; the larger branch of anyOf/oneOf)."""
    if not isinstance(schema, dict) or _depth > _MAX_DEPTH:
        return 0
    if _is_free_string(schema):
        return 1
    props = schema.get("properties")
    # (The isinstance is on the iterable itself: a generator's filter runs after .values().)
    n = sum(string_slots(v, _depth + 1) for v in (props.values() if isinstance(props, dict) else ()))
    if isinstance(schema.get("items"), dict):
        most = schema.get("maxItems")
        n += string_slots(schema["items"], _depth + 1) * (most if isinstance(most, int) and most >= 0 else 2)
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            n += max((string_slots(v, _depth + 1) for v in schema[key]), default=0)
    return n


def budget_cap(max_chars: int, max_tokens: int, slots: int) -> int:
    """The free-string cap of one request: ``max_chars`` (0: none), lowered so that every
    free string fits in half of ``max_tokens`` at one token a character (the other half for
    the markup and the other values): the call can close before max_tokens."""
    if not max_chars:
        return 0
    return max(1, min(max_chars, max_tokens // (2 * max(1, slots))))


def bound_schema(schema, max_chars: int, no_tags: bool, _depth: int = 0):
    """A copy of a JSON Schema in which every free string (a string type without enum,
    const or format) is at most ``max_chars`` characters (0: no cap at all; a smaller
    maxLength of its own stays) and every integer without bounds within +-SAFE_INT; with
    ``no_tags`` (a forced call), a free string may not hold one of ``TAGS`` (unless it has a
    ``pattern`` of its own, which a schema cannot combine with another) and an object with
    properties takes no others unless it says so (as the XML format's arguments)."""
    if not isinstance(schema, dict) or _depth > _MAX_DEPTH:
        return schema
    out = dict(schema)
    t = out.get("type")
    if max_chars and (t == "integer" or (isinstance(t, list) and "integer" in t)):
        out.setdefault("minimum", -SAFE_INT)
        out.setdefault("maximum", SAFE_INT)
    if no_tags and isinstance(out.get("properties"), dict) and "additionalProperties" not in out \
            and "patternProperties" not in out:
        out["additionalProperties"] = False
    if _is_free_string(out):  # no pattern of its own: the tag rule can be one
        if max_chars:
            floor = _pattern_floor(out["pattern"]) if "pattern" in out else 0
            cap = max(max_chars, int(out.get("minLength") or 0), floor or 0)
            if not isinstance(out.get("maxLength"), int) or out["maxLength"] > cap:
                out["maxLength"] = cap
        if no_tags and "pattern" not in out:
            out["pattern"] = NO_TAGS_PATTERN
    for key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
        if isinstance(out.get(key), dict):
            out[key] = {k: bound_schema(v, max_chars, no_tags, _depth + 1) for k, v in out[key].items()}
    for key in ("items", "additionalProperties", "contains", "not", "if", "then", "else", "propertyNames"):
        if isinstance(out.get(key), dict):
            out[key] = bound_schema(out[key], max_chars, no_tags, _depth + 1)
    for key in ("items", "prefixItems", "anyOf", "oneOf", "allOf"):
        if isinstance(out.get(key), list):
            out[key] = [bound_schema(v, max_chars, no_tags, _depth + 1) for v in out[key]]
    return out


class ToolGrammarError(ValueError):
    """A tool or choice the grammar cannot express; the message says which and why."""


def tool_format(chat_template: str | None) -> str:
    """Which call format the model's template teaches: XML when it shows ``<function=``."""
    return XML if chat_template and "<function=" in chat_template else JSON


def _lit(s: str) -> str:
    return json.dumps(s)


def _schema(tool: m.ToolSpec) -> dict:
    p = tool.parameters
    return p if isinstance(p, dict) and p else {"type": "object", "properties": {}}


def _lark_pattern(pattern: object) -> str | None:
    """A JSON Schema ``pattern`` as a Lark regex matching the whole value (JSON Schema
    patterns search; ``^``/``$`` anchor), or None when llguidance cannot read it."""
    if not isinstance(pattern, str) or not pattern:
        return None
    inner = pattern
    head = "" if inner.startswith("^") else "(.|\\n)*"
    inner = inner[1:] if inner.startswith("^") else inner
    tail = "" if inner.endswith("$") and not inner.endswith("\\$") else "(.|\\n)*"
    inner = inner[:-1] if not tail else inner
    try:
        body = llguidance.regex_to_lark(inner, "dw")
        lark = f"/{head}(?:{body}){tail}/"
        check_lark(f"start: X\nX: {lark}\n")
    except (ValueError, ToolGrammarError):
        return None
    return lark


def _text_token(sub: dict) -> str:
    """The Lark token of a text parameter's value: its length bounds (maxLength after
    bound_schema), its pattern where llguidance reads it, never one of the format's tags."""
    lo = sub.get("minLength") if isinstance(sub.get("minLength"), int) and sub.get("minLength") >= 0 else 0
    hi = sub.get("maxLength") if isinstance(sub.get("maxLength"), int) and sub.get("maxLength") >= lo else None
    length = f"/(.|\\n){{{lo},{'' if hi is None else hi}}}/" if (lo or hi is not None) else "/(.|\\n)*/"
    parts = [length, _NO_TAGS_LARK]
    pattern = _lark_pattern(sub.get("pattern"))
    if pattern:
        parts.append(pattern)
    return " & ".join(parts)


def _xml_call(i: int, tool: m.ToolSpec, max_chars: int) -> list[str]:
    schema = _schema(tool)
    props = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    defs = {k: bound_schema(schema[k], max_chars, True) for k in ("$defs", "definitions") if k in schema}
    rules, parts = [], []
    end = _lit(chr(10) + "</parameter>" + chr(10))
    for j, (name, sub) in enumerate(props.items()):
        if not isinstance(sub, dict):
            raise ToolGrammarError(f"tool {tool.name!r}: parameters.properties.{name} must be a schema object")
        open_tag = _lit(f"<parameter={name}>\n")
        choices = sub.get("enum", [sub["const"]] if "const" in sub else None)
        if is_text_param(sub) and choices:  # one of the constants, bare
            rules.append(f"p{i}_{j}: {open_tag} ({' | '.join(_lit(c) for c in choices)}) {end}")
        elif is_text_param(sub):
            # Bounded text without the format's tags; lazy, so the first "\n</parameter>\n"
            # ends it, as the parser reads it.
            text = {k: v for k, v in sub.items() if k not in ("format", "enum", "const")}
            sub = bound_schema({**text, "type": "string"}, max_chars, False)
            rules.append(f"S{i}_{j}: {_text_token(sub)}")
            rules.append(f"v{i}_{j}[lazy]: S{i}_{j} {end}")
            rules.append(f"p{i}_{j}: {open_tag} v{i}_{j}")
        else:
            bounded = bound_schema(sub, max_chars, True)
            rules.append(f"p{i}_{j}: {open_tag} %json {json.dumps({**bounded, **defs})} {end}")
        parts.append(f"p{i}_{j}" + ("" if name in required else "?"))
    head = _lit(f"<tool_call>\n<function={tool.name}>\n")
    tail = _lit("</function>\n</tool_call>")
    rules.append(f"call{i}: {head} {' '.join(parts)} {tail}")
    return rules


def _json_call(i: int, tool: m.ToolSpec, max_chars: int) -> list[str]:
    args = bound_schema(_schema(tool), max_chars, True)
    schema = {"type": "object", "properties": {"name": {"const": tool.name}, "arguments": args},
              "required": ["name", "arguments"], "additionalProperties": False}
    return [f"call{i}: {_lit('<tool_call>' + chr(10))} %json {json.dumps(schema)} {_lit(chr(10) + '</tool_call>')}"]


def tool_call_lark(tools: list[m.ToolSpec], choice, parallel: bool, fmt: str, thinking: bool,
                   max_chars: int = 0) -> str:
    """The Lark grammar admitting only tool calls (one, or several when ``parallel``) of
    ``tools`` (of the named one for a NamedToolChoice), optionally after a think block;
    free strings at most ``max_chars`` characters (0: no cap)."""
    if isinstance(choice, m.NamedToolChoice):
        chosen = [t for t in tools if t.name == choice.name]
        if not chosen:
            raise ToolGrammarError(f"tool_choice names {choice.name!r}, which is not among the tools")
    else:
        chosen = list(tools)
    if not chosen:
        raise ToolGrammarError("tool_choice 'required' needs at least one tool")
    rules = []
    for i, tool in enumerate(chosen):
        rules += _xml_call(i, tool, max_chars) if fmt == XML else _json_call(i, tool, max_chars)
    rules.append("call: " + " | ".join(f"call{i}" for i in range(len(chosen))))
    rules.append('calls: call ("\\n" call)*' if parallel else "calls: call")
    if thinking:
        rules.append("THINK_TEXT: /(.|\\n)*/")
        rules.append('think[lazy]: THINK_TEXT "</think>"')
        rules.append("start: (think /\\n*/)? calls")
    else:
        rules.append("start: calls")
    return "%llguidance {}\n" + "\n".join(rules) + "\n"


def check_lark(lark: str) -> None:
    """Raise ToolGrammarError with llguidance's own message when it cannot compile ``lark``."""
    try:
        grammar = llguidance.grammar_from("lark", lark)
        error = llguidance.LLMatcher.validate_grammar(grammar)
    except Exception as exc:  # noqa: BLE001 - the compiler's message is the answer
        error = str(exc)
    if error:
        raise ToolGrammarError(f"the tools' parameter schemas cannot be enforced: {error.splitlines()[0]}")


def tool_constraint(msg: m.Generate, chat_template: str | None, max_chars: int = 0) -> m.Constraint | None:
    """The constraint that enforces ``msg``'s tool_choice, or None when it needs none
    (auto, none, no tools); free strings at most ``max_chars`` characters (0: no cap).
    Raises ToolGrammarError for a choice it cannot enforce."""
    tools = msg.option_tools()
    choice = msg.option_tool_choice()
    if isinstance(choice, m.NamedToolChoice) and not tools:
        raise ToolGrammarError(f"tool_choice names {choice.name!r} but the request has no tools")
    if choice == "required" and not tools:
        raise ToolGrammarError("tool_choice 'required' needs at least one tool")
    if not tools or choice in ("auto", "none"):
        return None
    parallel = msg.parallel_tool_calls is not False  # UNSET: true
    thinking = bool(chat_template) and "<think>" in chat_template
    chosen = [t for t in tools if not isinstance(choice, m.NamedToolChoice) or t.name == choice.name]
    slots = max((string_slots(_schema(t)) for t in chosen), default=1)
    cap = budget_cap(max_chars, msg.max_tokens, slots)
    lark = tool_call_lark(tools, choice, parallel, tool_format(chat_template), thinking, cap)
    check_lark(lark)
    return m.Constraint(kind="lark", value=lark)
