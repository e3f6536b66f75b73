"""The grammar that makes a model call a tool: tool_choice "required" or a named function.

Built as llguidance's Lark dialect (``Generate.constraint`` kind ``lark``) in the format the
model's chat template teaches it (daemon/tool_calls.py parses the same two): Qwen3.5 /
Qwen3-Coder XML, where each parameter is its own element, or Hermes JSON inside
``<tool_call>``. Arguments follow each tool's JSON Schema: in JSON, the whole arguments
object is one ``%json`` schema; in XML, a typed parameter's value is ``%json`` of its
property schema and a string parameter is text without ``</`` (so its closing tag ends it).
A thinking model may think first: the grammar lets a ``</think>``-terminated block come
before the calls, so reasoning stays free and only the answer is constrained.

Pure string building plus llguidance's grammar check (no tokenizer, no mlx): a schema that
llguidance cannot compile is refused here, naming the construct, before any work starts.
"""

from __future__ import annotations

import json

import llguidance

from protocol import messages as m

from .tool_calls import is_text_param

XML, JSON = "xml", "json"


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


def _xml_call(i: int, tool: m.ToolSpec) -> list[str]:
    schema = _schema(tool)
    props = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    rules, parts = [], []
    for j, (name, sub) in enumerate(props.items()):
        if not isinstance(sub, dict):
            raise ToolGrammarError(f"tool {tool.name!r}: parameters.properties.{name} must be a schema object")
        open_tag = _lit(f"<parameter={name}>\n")
        choices = sub.get("enum", [sub["const"]] if "const" in sub else None)
        if is_text_param(sub) and choices:  # one of the constants, bare
            rules.append(f"p{i}_{j}: {open_tag} ({' | '.join(_lit(c) for c in choices)}) "
                         f"{_lit(chr(10) + '</parameter>' + chr(10))}")
        elif is_text_param(sub):
            # Any text (length and pattern bounds are not enforced in this format); lazy, so
            # the first "\n</parameter>\n" ends it, as the parser reads it.
            rules.append(f"v{i}_{j}[lazy]: STRING_TEXT {_lit(chr(10) + '</parameter>' + chr(10))}")
            rules.append(f"p{i}_{j}: {open_tag} v{i}_{j}")
        else:
            rules.append(f"p{i}_{j}: {open_tag} %json {json.dumps({**sub, **defs})} {_lit(chr(10) + '</parameter>' + chr(10))}")
        parts.append(f"p{i}_{j}" + ("" if name in required else "?"))
    head = _lit(f"<tool_call>\n<function={tool.name}>\n")
    tail = _lit("</function>\n</tool_call>")
    rules.append(f"call{i}: {head} {' '.join(parts)} {tail}")
    return rules


def _json_call(i: int, tool: m.ToolSpec) -> list[str]:
    schema = {"type": "object", "properties": {"name": {"const": tool.name}, "arguments": _schema(tool)},
              "required": ["name", "arguments"], "additionalProperties": False}
    return [f"call{i}: {_lit('<tool_call>' + chr(10))} %json {json.dumps(schema)} {_lit(chr(10) + '</tool_call>')}"]


def tool_call_lark(tools: list[m.ToolSpec], choice, parallel: bool, fmt: str, thinking: bool) -> str:
    """The Lark grammar admitting only tool calls (one, or several when ``parallel``) of
    ``tools`` (of the named one for a NamedToolChoice), optionally after a think block."""
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
        rules += _xml_call(i, tool) if fmt == XML else _json_call(i, tool)
    if fmt == XML:
        rules.append("STRING_TEXT: /(.|\\n)*/")
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


def tool_constraint(msg: m.Generate, chat_template: str | None) -> m.Constraint | None:
    """The constraint that enforces ``msg``'s tool_choice, or None when it needs none
    (auto, none, no tools). Raises ToolGrammarError for a choice it cannot enforce."""
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
    lark = tool_call_lark(tools, choice, parallel, tool_format(chat_template), thinking)
    check_lark(lark)
    return m.Constraint(kind="lark", value=lark)
