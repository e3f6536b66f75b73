"""Tool calls parsed out of a model's answer text, whole or as it streams.

Two formats, both inside ``<tool_call>`` ... ``</tool_call>``, told apart by the body:
- Qwen3.5 / Qwen3-Coder XML::

      <tool_call>
      <function=NAME>
      <parameter=P>
      VALUE
      </parameter>
      </function>
      </tool_call>

  A parameter's VALUE is text; where the tool's schema types the parameter as something
  other than a string, it is read as JSON (falling back to the text when it is not JSON).
- Hermes-style JSON (Qwen2.5, Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

The answer becomes segments: text, call, text, call, ... Whitespace between text and a call
belongs to neither (models put newlines around calls). A call that does not parse (bad JSON,
an unknown function, an unclosed tag at the end) stays text, tags and all: malformed output
is shown, never dropped and never a crash.

Streaming (``ToolCallStream``) gives exactly what parsing the whole text gives
(``parse_tool_calls``), however the text is chunked, and never sends a part of a tag as
text: a tail that could still become ``<tool_call>`` is held back until it is decided.
Pure Python: the daemon runs it on the engine thread, tests run it alone.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from protocol import messages as m

OPEN = "<tool_call>"
CLOSE = "</tool_call>"

_FUNCTION_RE = re.compile(r"\A\s*<function=([^>\n]+)>\n?(.*?)</function>\s*\Z", re.S)
_PARAM_RE = re.compile(r"\s*<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


def is_text_param(schema: object) -> bool:
    """Whether an XML parameter of this schema is written as bare text (a string, or one of
    string constants), not as JSON. The grammar (tool_grammar.py) uses the same rule."""
    if not isinstance(schema, dict):
        return False
    choices = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if choices is not None:
        return bool(choices) and all(isinstance(c, str) for c in choices)
    t = schema.get("type")
    return t == "string" or (isinstance(t, list) and "string" in t)


def _param_types(tools: list[m.ToolSpec]) -> dict[str, dict[str, bool]]:
    """function name -> parameter name -> whether its value is bare text."""
    out: dict[str, dict[str, bool]] = {}
    for tool in tools:
        props = tool.parameters.get("properties") if isinstance(tool.parameters, dict) else None
        out[tool.name] = {k: is_text_param(v) for k, v in (props or {}).items()}
    return out


def _xml_value(raw: str, text: bool | None):
    """A parameter's value: bare text for text parameters and for ones the schema does not
    name; otherwise JSON, or the text when it is not JSON."""
    if text or text is None:
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


@dataclass
class CallParser:
    """Turns one ``<tool_call>`` body into (name, arguments JSON text), or None."""

    types: dict[str, dict[str, bool]]

    def parse(self, body: str) -> tuple[str, str] | None:
        stripped = body.strip()
        if stripped.startswith("{"):
            return self._json(stripped)
        return self._xml(body)

    def _known(self, name: str) -> bool:
        return not self.types or name in self.types

    def _json(self, body: str) -> tuple[str, str] | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models send the arguments as JSON text
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict) or not self._known(obj["name"]):
            return None
        return obj["name"], json.dumps(args, ensure_ascii=False)

    def _xml(self, body: str) -> tuple[str, str] | None:
        fm = _FUNCTION_RE.match(body)
        if fm is None:
            return None
        name, inner = fm.group(1).strip(), fm.group(2)
        if not name or not self._known(name):
            return None
        types = self.types.get(name, {})
        args: dict = {}
        pos = 0
        for pm in _PARAM_RE.finditer(inner):
            if pm.start() != pos:
                return None  # something other than parameters between them
            args[pm.group(1).strip()] = _xml_value(pm.group(2), types.get(pm.group(1).strip()))
            pos = pm.end()
        if inner[pos:].strip():
            return None
        return name, json.dumps(args, ensure_ascii=False)


def _prefix_hold(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolCallStream:
    """Feed answer text as it comes; get back (text safe to send, calls completed).

    ``call_id(i)`` names the i-th call of the request (the same ids streamed and in Done)."""

    def __init__(self, tools: list[m.ToolSpec], call_id):
        self.parser = CallParser(_param_types(tools))
        self.call_id = call_id
        self.buf = ""          # undecided text (outside a call) or the open call's body
        self.inside = False
        self.after_call = False  # drop whitespace right after a call
        self.ws_before = ""      # whitespace before the open call: dropped if it parses
        self.calls: list[m.ToolCall] = []

    def feed(self, text: str, final: bool = False) -> tuple[str, list[m.ToolCall]]:
        self.buf += text
        out: list[str] = []
        new_calls: list[m.ToolCall] = []
        while True:
            if self.inside:
                i = self.buf.find(CLOSE)
                if i < 0:
                    if final:  # never closed: it was text after all
                        out.append(self.ws_before + OPEN + self.buf)
                        self.buf, self.inside = "", False
                    break
                body, self.buf = self.buf[:i], self.buf[i + len(CLOSE):]
                self.inside = False
                parsed = self.parser.parse(body)
                if parsed is None:
                    out.append(self.ws_before + OPEN + body + CLOSE)
                    self.after_call = False
                    continue
                call = m.ToolCall(id=self.call_id(len(self.calls)), name=parsed[0], arguments=parsed[1])
                self.calls.append(call)
                new_calls.append(call)
                self.after_call = True  # whitespace around a call belongs to neither side
                continue
            if self.after_call:
                stripped = self.buf.lstrip()
                if not stripped:
                    self.buf = ""
                    break
                self.buf, self.after_call = stripped, False
            i = self.buf.find(OPEN)
            if i >= 0:
                before = self.buf[:i]
                core = before.rstrip()
                out.append(core)
                self.ws_before = before[len(core):]
                self.buf, self.inside = self.buf[i + len(OPEN):], True
                continue
            if final:
                out.append(self.buf)
                self.buf = ""
                break
            # Hold what may still become the open tag, and trailing whitespace (a call may follow).
            hold = _prefix_hold(self.buf, OPEN)
            cut = len(self.buf[: len(self.buf) - hold].rstrip())
            out.append(self.buf[:cut])
            self.buf = self.buf[cut:]
            break
        return "".join(out), new_calls

    def finish(self) -> tuple[str, list[m.ToolCall]]:
        return self.feed("", final=True)


def parse_tool_calls(text: str, tools: list[m.ToolSpec], call_id) -> tuple[str, list[m.ToolCall]]:
    """The text around the calls, and the calls, of a whole answer."""
    stream = ToolCallStream(tools, call_id)
    return stream.finish() if not text else _join(stream.feed(text), stream.finish())


def _join(a: tuple[str, list[m.ToolCall]], b: tuple[str, list[m.ToolCall]]) -> tuple[str, list[m.ToolCall]]:
    return a[0] + b[0], a[1] + b[1]
