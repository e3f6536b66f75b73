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
belongs to neither (models put newlines around calls). Nothing of the format's markup ever
stays in the text (a client would get template tags as prose):
- a call that does not parse strictly (bad JSON, a stray line between parameters) is read
  leniently: its function name and the parameters that parse; one whose name is missing or
  names no tool of the request is dropped, tags and all;
- a call that never closes (cut by max_tokens or a stop string) is reported as a call with
  the arguments as far as they were generated (a partial string value as written so far, a
  partial JSON value closed where it can be, else left out); where its name was cut too,
  the one tool a forced choice allows (a named function, or "required" with one tool), or
  the one tool whose name starts with what was written;
- ``<function=...>`` without ``<tool_call>`` opens a call too (some models drop the outer
  tag), and stray ``</tool_call>``, ``</function>``, ``</parameter>``, ``<parameter=...>``
  outside a call are dropped; at the end, a tail that began one of the tags is dropped (a
  forced call cut inside its first tag is still reported, as above).

Streaming (``ToolCallStream``) gives exactly what parsing the whole text gives
(``parse_tool_calls``), however the text is chunked, and never sends a part of a tag as
text: a tail that could still become a tag is held back until it is decided.
Pure Python: the daemon runs it on the engine thread, tests run it alone.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from protocol import messages as m

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
FUNC_OPEN = "<function="
FUNC_CLOSE = "</function>"
PARAM_OPEN = "<parameter="
# Closing tags that mean nothing outside a call: dropped from the text.
STRAY_CLOSERS = ("</tool_call>", "</function>", "</parameter>")
MARKERS = (OPEN, FUNC_OPEN, PARAM_OPEN) + STRAY_CLOSERS

_FUNCTION_RE = re.compile(r"\A\s*<function=([^>\n]+)>\n?(.*?)</function>\s*\Z", re.S)
_PARAM_RE = re.compile(r"\s*<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)
# Lenient reading: a function head (its ">" may be missing: the name was cut), and each
# parameter, closed or running to the end of the text.
_FUNC_HEAD_RE = re.compile(r"\s*<function=([^>\n]*)(>?)", re.S)
_PARAM_ANY_RE = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)(\n?</parameter>|\Z)", re.S)
_TOOL_NAME_RE = re.compile(r"\A[A-Za-z0-9_.\-]{1,64}\Z")  # protocol.messages.ToolName
_PARAM_END = "\n</parameter>"


def is_text_param(schema: object) -> bool:
    """Whether an XML parameter of this schema is written as bare text (a string, or one of
    string constants), not as JSON. The grammar (tool_grammar.py) uses the same rule."""
    if not isinstance(schema, dict):
        return False
    choices = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if choices is not None:  # an enum that is not an array (a malformed schema) is not text
        return isinstance(choices, list) and bool(choices) and all(isinstance(c, str) for c in choices)
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


_NOTHING = object()


def close_json(text: str, attempts: int = 64):
    """The value of the longest usable prefix of JSON text cut anywhere (``{"a": [1, "x``
    -> ``{"a": [1, "x"]}``): open strings and containers closed, a member or item that
    cannot be completed left out. ``_NOTHING`` when no prefix makes a value."""
    text = text.strip()
    # One pass: at each place a cut can go (the end, before a comma, after an opening
    # bracket) the closers the prefix needs.
    stack: list[str] = []
    in_str = esc = False
    cuts: list[tuple[int, str]] = []
    for i, ch in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
            cuts.append((i + 1, "".join(reversed(stack))))
        elif ch in "}]":
            if stack:
                stack.pop()
        elif ch == ",":
            cuts.append((i, "".join(reversed(stack))))
    body = text
    if in_str:  # end inside a string: drop a half escape, close the string
        body = re.sub(r"\\(u[0-9a-fA-F]{0,3})?\Z", "", body) + '"'
    cuts.append((len(text), "".join(reversed(stack))))
    tried = 0
    for end, closers in reversed(cuts):
        prefix = body if end == len(text) else text[:end]
        for candidate in (prefix + closers, prefix.rstrip().rstrip(",:") + closers):
            try:
                return json.loads(candidate)
            except ValueError:
                pass
        tried += 1
        if tried >= attempts:
            break
    return _NOTHING


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

    # ---------------------------------------------------------------- lenient
    def _name(self, written: str | None, whole: bool, forced: str | None) -> str | None:
        """The call's function: as written when whole and known; for a cut or missing
        name, the forced one, else the one known tool that starts with what was written."""
        if written is not None and whole:
            return written if _TOOL_NAME_RE.match(written) and self._known(written) else None
        if forced is not None:
            return forced
        if written and self.types:
            fits = [n for n in self.types if n.startswith(written)]
            return fits[0] if len(fits) == 1 else None
        return None

    def lenient(self, body: str, forced: str | None = None) -> tuple[str, str] | None:
        """What can be read of a malformed or cut call: its name (``_name``) and the
        parameters that parse, a cut last one as far as it goes; None without a name."""
        s = body.lstrip()
        if s.startswith("{"):
            obj = close_json(s)
            obj = obj if isinstance(obj, dict) else {}
            written = obj.get("name") if isinstance(obj.get("name"), str) else None
            # A name is whole once the text goes on past it (a cut string was closed here).
            whole = written is not None and json.dumps(written) in s
            name = self._name(written, whole, forced)
            args = obj.get("arguments", obj.get("parameters", {}))
            if isinstance(args, str):
                args = close_json(args)
            if name is None:
                return None
            return name, json.dumps(args if isinstance(args, dict) else {}, ensure_ascii=False)
        fm = _FUNC_HEAD_RE.match(s)
        if fm is None:
            name = self._name(None, False, forced)
            return None if name is None else (name, "{}")
        name = self._name(fm.group(1).strip(), bool(fm.group(2)), forced)
        if name is None:
            return None
        types = self.types.get(name, {})
        inner = s[fm.end():] if fm.group(2) else ""
        end = inner.find(FUNC_CLOSE)
        inner = inner if end < 0 else inner[:end]
        args: dict = {}
        for pm in _PARAM_ANY_RE.finditer(inner):
            key, raw, closed = pm.group(1).strip(), pm.group(2), bool(pm.group(3))
            if not closed:  # cut: drop what had begun the closing tag
                raw = raw[: len(raw) - _prefix_hold(raw, _PARAM_END)]
            text = types.get(key)
            if text or text is None:
                args[key] = raw
                continue
            try:
                args[key] = json.loads(raw)
            except ValueError:
                value = raw if closed else close_json(raw)
                if value is not _NOTHING and (closed or raw.strip()):
                    args[key] = value
        return name, json.dumps(args, ensure_ascii=False)


def _prefix_hold(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _markers_hold(text: str) -> int:
    """How much of the end of ``text`` may still become a tag. A dropped stray tag joins
    what was before it to what comes after, so a tag's beginning before another's counts too."""
    total = 0
    while True:
        n = max(_prefix_hold(text[: len(text) - total], mk) for mk in MARKERS)
        if not n:
            return total
        total += n


def _first_marker(text: str) -> tuple[int, str]:
    """Where the first of MARKERS begins in ``text`` (-1 if none), and which."""
    best, which = -1, ""
    for mk in MARKERS:
        i = text.find(mk)
        if i >= 0 and (best < 0 or i < best):
            best, which = i, mk
    return best, which


class ToolCallStream:
    """Feed answer text as it comes; get back (text safe to send, calls completed).

    ``call_id(i)`` names the i-th call of the request (the same ids streamed and in Done).
    ``forced``: the one function a forced tool_choice allows, if it allows one (names a call
    whose own name was cut)."""

    def __init__(self, tools: list[m.ToolSpec], call_id, forced: str | None = None):
        self.parser = CallParser(_param_types(tools))
        self.call_id = call_id
        self.forced = forced
        self.buf = ""          # undecided text (outside a call) or the open call's body
        self.inside = ""       # "" outside a call; else the tag that opened it (OPEN, FUNC_OPEN)
        self.after_call = False  # drop whitespace right after a call
        self.calls: list[m.ToolCall] = []

    def _add(self, parsed: tuple[str, str] | None, new_calls: list[m.ToolCall]) -> None:
        if parsed is None:
            return
        call = m.ToolCall(id=self.call_id(len(self.calls)), name=parsed[0], arguments=parsed[1])
        self.calls.append(call)
        new_calls.append(call)

    def feed(self, text: str, final: bool = False) -> tuple[str, list[m.ToolCall]]:
        self.buf += text
        out: list[str] = []
        new_calls: list[m.ToolCall] = []
        while True:
            if self.inside:
                closer = CLOSE if self.inside == OPEN else FUNC_CLOSE
                head = "" if self.inside == OPEN else FUNC_OPEN
                i = self.buf.find(closer)
                if i < 0:
                    if final:  # never closed: a cut call, as far as it goes
                        self._add(self.parser.lenient(head + self.buf, self.forced), new_calls)
                        self.buf, self.inside = "", ""
                    break
                body = head + self.buf[:i] + ("" if self.inside == OPEN else FUNC_CLOSE)
                self.buf, self.inside = self.buf[i + len(closer):], ""
                self._add(self.parser.parse(body) or self.parser.lenient(body), new_calls)
                self.after_call = True  # whitespace around a call belongs to neither side
                continue
            if self.after_call:
                stripped = self.buf.lstrip()
                if not stripped:
                    self.buf = ""
                    break
                self.buf, self.after_call = stripped, False
            i, marker = _first_marker(self.buf)
            if i >= 0:
                before = self.buf[:i]
                if marker in (OPEN, FUNC_OPEN):
                    out.append(before.rstrip())  # whitespace before a call belongs to neither side
                    self.buf, self.inside = self.buf[i + len(marker):], marker
                    continue
                # A stray tag: dropped (a parameter tag through its ">"), and the text around
                # it scanned again, as one (what it split may join into a tag).
                if marker == PARAM_OPEN:
                    ends = [j for j in (self.buf.find(">", i), self.buf.find("\n", i)) if j >= 0]
                    if not ends:
                        if not final:
                            break  # its end is still to come
                        self.buf = before
                        continue
                    self.buf = before + self.buf[min(ends) + 1:]
                    continue
                self.buf = before + self.buf[i + len(marker):]
                continue
            if final:
                hold = _markers_hold(self.buf)
                if hold and self.forced and not self.calls and not self.buf[:-hold].strip():
                    self._add((self.forced, "{}"), new_calls)  # a forced call cut in its first tag
                    hold = len(self.buf)
                elif hold < 2:
                    hold = 0  # a lone "<" is text
                out.append(self.buf[: len(self.buf) - hold].rstrip() if hold else self.buf)
                self.buf = ""
                break
            # Hold what may still become a tag, and trailing whitespace (a call may follow).
            hold = _markers_hold(self.buf)
            cut = len(self.buf[: len(self.buf) - hold].rstrip())
            out.append(self.buf[:cut])
            self.buf = self.buf[cut:]
            break
        return "".join(out), new_calls

    def finish(self) -> tuple[str, list[m.ToolCall]]:
        return self.feed("", final=True)


def parse_tool_calls(text: str, tools: list[m.ToolSpec], call_id, forced: str | None = None
                     ) -> tuple[str, list[m.ToolCall]]:
    """The text around the calls, and the calls, of a whole answer."""
    stream = ToolCallStream(tools, call_id, forced)
    return stream.finish() if not text else _join(stream.feed(text), stream.finish())


def _join(a: tuple[str, list[m.ToolCall]], b: tuple[str, list[m.ToolCall]]) -> tuple[str, list[m.ToolCall]]:
    return a[0] + b[0], a[1] + b[1]
