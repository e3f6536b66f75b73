"""OpenAI's Responses API over councild: POST /v1/responses.

The request becomes the same Generate the chat route sends: ``instructions`` (and any
system/developer messages that open ``input``) the system turn; ``input`` a string (one user
turn) or a list of items: messages (``input_text`` / ``output_text`` parts), ``function_call``
items (an assistant turn's tool_calls) and ``function_call_output`` items (``tool`` turns);
function ``tools`` and ``tool_choice`` exactly as on chat (the daemon renders the tools and
parses calls); ``text.format`` json_schema / json_object the Generate's constraint. The Done
becomes output items (``reasoning`` where the template marks thinking, a ``message`` with one
``output_text`` part, one ``function_call`` per call) with ``status`` completed, or incomplete
(``incomplete_details.reason: "max_output_tokens"``) when max_output_tokens cut it. A stream
becomes the Responses event sequence (response.created, response.in_progress, then per item
output_item.added / content_part.added / *.delta / *.done / output_item.done, and one terminal
event: response.completed, response.incomplete or response.failed), each an SSE ``event:``
with its ``sequence_number``.

Nothing is stored: ``previous_response_id``, ``conversation``, item references and background
responses are refused with a 400 saying so (send the whole conversation in ``input``), as are
hosted tools (web_search, file_search, ...) and non-text input. Errors keep OpenAI's shape
({"error": {"message", "type", "param", "code"}}), with the same statuses as the chat route.

The shared machinery (seats, daemon clients, metrics, the start of a generation) is the
Front's, handed in by front/app.py, which imports this module and not the reverse; the error
type is front/errors.py's.
"""

from __future__ import annotations

import json
import time
from contextlib import suppress
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from protocol import messages as m
from protocol.client import CouncilError

from .body import ClientGone
from .daemon_link import DaemonUnreachable
from .errors import HTTPError, from_council, from_unreachable
from .schema import BadRequest, number_field

# Accepted and without effect here: ids, storage and routing hints of the hosted API.
HARMLESS = {"model", "user", "metadata", "store", "service_tier", "prompt_cache_key", "prompt_cache_retention",
            "safety_identifier"}
MAPPED = {"input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
          "parallel_tool_calls", "text", "stream", "stream_options", "reasoning", "include", "truncation",
          "top_logprobs", "max_tool_calls",
          # councild extras (the openai client's extra_body), as on the chat route
          "priority", "speculation", "deadline_ms", "top_k", "min_p", "repetition_penalty", "seed",
          "chat_template_kwargs"}
# Known fields of the hosted API that need what councild does not have (stored responses,
# conversations, prompt templates, background jobs): a 400 that says so.
NEEDS_STORAGE = {"previous_response_id", "conversation", "prompt", "background", "background_options",
                 "context_management", "continuation_id", "compact_threshold", "comparison_response_id"}
HARMLESS_INCLUDE = {"reasoning.encrypted_content"}  # there is none to return: reasoning comes back as text


def _bad(message: str, param: str | None = None, code: str | None = None) -> BadRequest:
    return BadRequest(message, param, code)


def _unsupported(message: str, param: str) -> BadRequest:
    return BadRequest(message, param, "unsupported_parameter")


def _text_parts(content: Any, where: str) -> str:
    """A message's content: a string, or a list of input_text / output_text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or a list of content parts", where)
    out = []
    for j, part in enumerate(content):
        w = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text"):
            if not isinstance(part.get("text"), str):
                raise _bad(f"{w}.text must be a string", f"{w}.text")
            out.append(part["text"])
        elif kind == "refusal":
            if not isinstance(part.get("refusal"), str):
                raise _bad(f"{w}.refusal must be a string", f"{w}.refusal")
            out.append(part["refusal"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise _unsupported(f"{w}: {kind} content is not supported (councild serves a text model); send "
                               "input_text", w)
        else:
            raise _bad(f"{w}: content part type {kind!r} is not one of input_text, output_text", w)
    return "".join(out)


def _input(raw: Any, instructions: str | None) -> list[dict]:
    """``instructions`` + ``input`` -> protocol ChatMessage dicts."""
    out: list[dict] = []
    system: list[str] = [instructions] if instructions else []
    if isinstance(raw, str):
        if not raw:
            raise _bad("'input' is empty", "input")
        items: list = [{"role": "user", "content": raw}]
    elif isinstance(raw, list) and raw:
        items = raw
    else:
        raise _bad("'input' must be a non-empty string or a non-empty list of input items", "input")
    calls_by_id: dict[str, str] = {}  # call_id -> function name, of the function_call items so far
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _bad(f"{where}.role must be one of user, assistant, system, developer, not {role!r}",
                           f"{where}.role")
            text = _text_parts(item.get("content"), f"{where}.content")
            if role in ("system", "developer"):
                if not out:  # leading system turns join the instructions: one system turn first
                    system.append(text)
                    continue
                role = "system"
            out.append({"role": role, "content": text})
        elif kind == "function_call":
            call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments")
            if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not name \
                    or not isinstance(args, str):
                raise _bad(f"{where}: a function_call item needs string 'call_id', 'name' and 'arguments' (JSON text)",
                           where)
            calls_by_id[call_id] = name
            call = {"id": call_id, "name": name, "arguments": args}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":  # calls of the same assistant turn
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise _bad(f"{where}: a function_call_output item needs a string 'call_id'", f"{where}.call_id")
            if call_id not in calls_by_id:
                raise _bad(f"{where}: no function_call item with call_id {call_id!r} comes before this output "
                           "(councild stores no responses: send the call in 'input' too)", f"{where}.call_id")
            output = _text_parts(item.get("output"), f"{where}.output")
            out.append({"role": "tool", "content": output, "tool_call_id": call_id, "name": calls_by_id[call_id]})
        elif kind == "reasoning":
            continue  # earlier thinking is not shown to the model again (Qwen's templates drop it too)
        elif kind == "item_reference":
            raise _unsupported(f"{where}: item references need stored responses, which councild does not keep; "
                               "send the item itself", where)
        else:
            raise _unsupported(f"{where}: input item type {kind!r} is not supported (message, function_call, "
                               "function_call_output and reasoning are)", f"{where}.type")
    if system:
        out.insert(0, {"role": "system", "content": "\n\n".join(system)})
    if not any(msg["role"] != "system" for msg in out):
        raise _bad("'input' holds no user, assistant or tool turn", "input")
    return out


def _tools(raw: Any) -> tuple[list[dict] | None, list[dict]]:
    """(the daemon's ToolSpec dicts, the tools as the response echoes them)."""
    if raw is None or raw == []:
        return None, []
    if not isinstance(raw, list):
        raise _bad("'tools' must be a list", "tools")
    specs, echo = [], []
    for i, tool in enumerate(raw):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise _unsupported(f"tools[{i}]: {kind!r} tools are not supported by councild (hosted tools such as "
                               "web_search, file_search, code_interpreter or computer use need OpenAI's servers); "
                               "only function tools are", f"tools[{i}].type")
        params = tool.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(tool.get("name"), str) or not tool["name"] or not isinstance(params, dict):
            raise _bad(f"tools[{i}]: a function tool needs a string 'name' and an object 'parameters'", f"tools[{i}]")
        desc = tool.get("description") or ""
        if not isinstance(desc, str):
            raise _bad(f"tools[{i}].description must be a string", f"tools[{i}].description")
        specs.append({"name": tool["name"], "description": desc, "parameters": params})
        echo.append({"type": "function", "name": tool["name"], "description": desc or None, "parameters": params,
                     "strict": tool.get("strict")})
    return specs, echo


def _tool_choice(raw: Any, tools: list[dict] | None):
    if raw is None:
        return None
    if raw in ("auto", "none", "required"):
        if raw == "required" and not tools:
            raise _bad("'tool_choice' \"required\" needs 'tools'", "tool_choice")
        return raw
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == "function":
        name = raw.get("name")
        if not isinstance(name, str) or not any(t["name"] == name for t in tools or []):
            raise _bad(f"'tool_choice' names {name!r}, which is not among the tools", "tool_choice")
        return {"name": name}
    if kind is not None:
        raise _unsupported(f"'tool_choice' of type {kind!r} is not supported (\"auto\", \"none\", \"required\" or "
                           "{\"type\": \"function\", \"name\": ...} are)", "tool_choice")
    raise _bad("'tool_choice' must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"name\": ...}",
               "tool_choice")


def _text_format(raw: Any) -> tuple[dict | None, dict]:
    """``text`` -> (a protocol Constraint dict or None, the text config as the response echoes it)."""
    if raw is None:
        return None, {"format": {"type": "text"}}
    if not isinstance(raw, dict) or set(raw) - {"format", "verbosity"}:
        raise _bad("'text' must be an object with 'format'", "text")
    if raw.get("verbosity") not in (None, "medium"):
        raise _unsupported("'text.verbosity' is not supported (the model's output length is its own; bound it with "
                           "max_output_tokens)", "text.verbosity")
    fmt = raw.get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None, {"format": {"type": "text"}}
    if kind == "json_object":
        return {"kind": "json_object", "value": ""}, {"format": {"type": "json_object"}}
    if kind == "json_schema":
        if not isinstance(fmt.get("name"), str) or not fmt["name"]:
            raise _bad("'text.format.name' is required for json_schema", "text.format.name")
        if not isinstance(fmt.get("schema"), dict):
            raise _bad("'text.format.schema' must be a JSON Schema object", "text.format.schema")
        echo = {"type": "json_schema", "name": fmt["name"], "schema": fmt["schema"], "strict": fmt.get("strict"),
                "description": fmt.get("description")}
        return {"kind": "json_schema", "value": json.dumps(fmt["schema"])}, {"format": echo}
    raise _bad("'text.format.type' must be text, json_object or json_schema", "text.format.type")


def parse_responses_request(body: Any) -> tuple[dict, bool, dict]:
    """(AsyncClient.generate keyword arguments without max_tokens' default, stream, what the
    response echoes) of a Responses API body; raise BadRequest naming the first bad field."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    for key in sorted(NEEDS_STORAGE & set(body)):
        if body[key] not in (None, False):
            raise _unsupported(f"'{key}' is not supported: councild stores no responses or conversations; send the "
                               "whole conversation in 'input'", key)
    unknown = sorted(set(body) - HARMLESS - MAPPED - NEEDS_STORAGE)
    if unknown:
        raise _bad(f"unrecognized request argument(s): {', '.join(unknown)}", unknown[0], "unknown_parameter")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("'instructions' must be a string", "instructions")
    gen: dict[str, Any] = {"messages": _input(body.get("input"), instructions)}
    specs, tools_echo = _tools(body.get("tools"))
    choice = _tool_choice(body.get("tool_choice"), specs)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    max_calls = body.get("max_tool_calls")
    if max_calls is not None:
        if isinstance(max_calls, bool) or not isinstance(max_calls, int) or max_calls < 1:
            raise _bad("'max_tool_calls' must be an integer >= 1", "max_tool_calls")
        if max_calls > 1:
            raise _unsupported("'max_tool_calls' above 1 is not supported (leave it out, or 1: one call per turn)",
                               "max_tool_calls")
        parallel = False
    gen["tools"] = specs
    gen["tool_choice"] = choice if specs else None
    gen["parallel_tool_calls"] = parallel if specs else None
    constraint, text_echo = _text_format(body.get("text"))
    if constraint is not None and specs and choice not in (None, "none", "auto"):
        raise _bad("'text.format' json and a forced 'tool_choice' exclude each other", "text.format")
    gen["constraint"] = constraint

    max_tokens = number_field(body, "max_output_tokens", int, 1, m.MAX_TOKENS_CEILING)
    if max_tokens is not None:
        gen["max_tokens"] = max_tokens
    gen["temperature"] = number_field(body, "temperature", float, 0.0, 2.0, 1.0)  # OpenAI's default and range
    gen["top_p"] = number_field(body, "top_p", float, 0.0, 1.0, 1.0)
    if gen["top_p"] <= 0.0:
        raise _bad("'top_p' must be above 0", "top_p")
    gen["top_k"] = number_field(body, "top_k", int, 0, 1 << 20, 0)
    gen["min_p"] = number_field(body, "min_p", float, 0.0, 1.0, 0.0)
    gen["repetition_penalty"] = number_field(body, "repetition_penalty", float, 0.0, 10.0, 1.0)
    if gen["repetition_penalty"] <= 0.0:
        raise _bad("'repetition_penalty' must be above 0", "repetition_penalty")
    gen["seed"] = number_field(body, "seed", int, 0, (1 << 63) - 1)
    gen["deadline_ms"] = number_field(body, "deadline_ms", int, 1, 7 * 24 * 3600 * 1000)
    for key, allowed in (("priority", ("interactive", "normal", "background")),
                         ("speculation", ("off", "exact", "fast"))):
        v = body.get(key)
        if v is not None and v not in allowed:
            raise _bad(f"'{key}' must be one of {', '.join(allowed)}, not {v!r}", key)
        gen[key] = v
    if number_field(body, "top_logprobs", int, 0, 20, 0):
        raise _unsupported("'top_logprobs' is not supported on /v1/responses (chat completions has logprobs)",
                           "top_logprobs")
    include = body.get("include")
    if include is not None:
        if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
            raise _bad("'include' must be a list of strings", "include")
        extra = sorted(set(include) - HARMLESS_INCLUDE)
        if extra:
            raise _unsupported(f"'include' {extra[0]!r} is not supported", "include")
    if body.get("truncation") not in (None, "disabled"):
        raise _unsupported("'truncation' \"auto\" is not supported: councild never drops input; a prompt too long "
                           "is a 400", "truncation")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise _bad("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    kwargs = dict(kwargs or {})
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict) or set(reasoning) - {"effort", "summary", "generate_summary"}:
            raise _bad("'reasoning' must be an object with 'effort' (and 'summary')", "reasoning")
        effort = reasoning.get("effort")
        if effort not in (None, "none", "minimal", "low", "medium", "high", "xhigh"):
            raise _bad(f"'reasoning.effort' {effort!r} is not one of none, minimal, low, medium, high, xhigh",
                       "reasoning.effort")
        if effort is not None:  # thinking on or off: the template's switch (Qwen3.5: enable_thinking)
            kwargs.setdefault("enable_thinking", effort not in ("none", "minimal"))
    if kwargs:
        gen["chat_template_kwargs"] = kwargs
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("'stream' must be true or false", "stream")
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or set(opts) - {"include_obfuscation"}):
        raise _unsupported("'stream_options' supports only include_obfuscation", "stream_options")
    echo = {"instructions": instructions, "tools": tools_echo, "text": text_echo,
            "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": parallel if parallel is not None else True,
            "temperature": gen["temperature"], "top_p": gen["top_p"], "metadata": body.get("metadata") or {},
            "user": body.get("user"), "reasoning": reasoning}
    return gen, stream, echo


# ------------------------------------------------------------------------------ replies


def usage(u: m.Usage) -> dict:
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def status_of(done: m.Done) -> tuple[str, dict | None]:
    """(the response's status, its incomplete_details)."""
    if done.finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if done.finish_reason == "cancelled":
        return "incomplete", {"reason": None}
    return "completed", None


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ResponseShape:
    """The Response objects of one request (ids, timestamps, the fields it echoes)."""

    def __init__(self, request_id: str, model: str, echo: dict, max_output_tokens: int):
        self.rid = request_id
        self.id = "resp_" + request_id
        self.model = model
        self.echo = echo
        self.max_output_tokens = max_output_tokens
        self.created = int(time.time())

    def item_id(self, prefix: str, index: int) -> str:
        return f"{prefix}_{self.rid}_{index}"

    def response(self, status: str, output: list[dict], done: m.Done | None = None,
                 incomplete: dict | None = None, error: dict | None = None) -> dict:
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "completed_at": int(time.time()) if status == "completed" else None, "error": error,
                "incomplete_details": incomplete, "instructions": self.echo["instructions"],
                "max_output_tokens": self.max_output_tokens, "model": self.model, "output": output,
                "parallel_tool_calls": self.echo["parallel_tool_calls"], "previous_response_id": None,
                "reasoning": self.echo["reasoning"], "store": False, "temperature": self.echo["temperature"],
                "text": self.echo["text"], "tool_choice": self.echo["tool_choice"], "tools": self.echo["tools"],
                "top_p": self.echo["top_p"], "truncation": "disabled",
                "usage": usage(done.usage) if done is not None else None, "user": self.echo["user"],
                "metadata": self.echo["metadata"]}

    def full(self, done: m.Done) -> dict:
        """The non-streamed response: reasoning, then the message, then the calls."""
        status, incomplete = status_of(done)
        output: list[dict] = []
        if done.reasoning:
            output.append({"id": self.item_id("rs", len(output)), "type": "reasoning", "summary": [],
                           "content": [{"type": "reasoning_text", "text": done.reasoning}], "status": "completed"})
        if done.text or not done.tool_calls:
            output.append({"id": self.item_id("msg", len(output)), "type": "message", "role": "assistant",
                           "status": "completed", "content": [_text_part(done.text)]})
        for call in done.tool_calls:
            output.append({"id": self.item_id("fc", len(output)), "type": "function_call", "call_id": call.id,
                           "name": call.name, "arguments": call.arguments, "status": "completed"})
        if status == "incomplete":
            output[-1]["status"] = "incomplete"  # what was cut is the last item
        return self.response(status, output, done, incomplete)


def event(data: dict) -> str:
    return f"event: {data['type']}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


class ResponseEvents:
    """The Responses stream events of one request. One item is open at a time (reasoning,
    a message, or a function call); it is closed when another opens or the request ends, with
    the status the end gives it."""

    def __init__(self, shape: ResponseShape):
        self.shape = shape
        self.seq = 0
        self.items: list[dict] = []
        self.open: dict | None = None
        self.buffer = ""  # the open item's text (message, reasoning)
        self.call_ids: set[str] = set()

    def _ev(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event(data)

    def start(self) -> list[str]:
        resp = self.shape.response("in_progress", [])
        return [self._ev("response.created", response=resp), self._ev("response.in_progress", response=resp)]

    def _open(self, item: dict) -> list[str]:
        out = self.close()
        prefix = {"message": "msg", "reasoning": "rs", "function_call": "fc"}[item["type"]]
        item = {"id": self.shape.item_id(prefix, len(self.items)), **item}
        self.items.append(item)
        self.open = item
        self.buffer = ""
        out.append(self._ev("response.output_item.added", output_index=len(self.items) - 1, item=dict(item)))
        if item["type"] == "message":
            out.append(self._ev("response.content_part.added", item_id=item["id"], output_index=len(self.items) - 1,
                                content_index=0, part=_text_part("")))
        elif item["type"] == "reasoning":
            out.append(self._ev("response.content_part.added", item_id=item["id"], output_index=len(self.items) - 1,
                                content_index=0, part={"type": "reasoning_text", "text": ""}))
        return out

    def close(self, status: str = "completed") -> list[str]:
        item = self.open
        if item is None:
            return []
        self.open = None
        index = len(self.items) - 1
        where = {"item_id": item["id"], "output_index": index}
        out = []
        if item["type"] == "message":
            part = _text_part(self.buffer)
            out.append(self._ev("response.output_text.done", **where, content_index=0, text=self.buffer, logprobs=[]))
            out.append(self._ev("response.content_part.done", **where, content_index=0, part=part))
            item["content"] = [part]
        elif item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": self.buffer}
            out.append(self._ev("response.reasoning_text.done", **where, content_index=0, text=self.buffer))
            out.append(self._ev("response.content_part.done", **where, content_index=0, part=part))
            item["content"] = [part]
        else:
            out.append(self._ev("response.function_call_arguments.done", **where, name=item["name"],
                                arguments=item["arguments"]))
        item["status"] = status
        out.append(self._ev("response.output_item.done", output_index=index, item=item))
        return out

    def _call(self, call: m.ToolCall) -> list[str]:
        self.call_ids.add(call.id)
        out = self._open({"type": "function_call", "call_id": call.id, "name": call.name, "arguments": "",
                          "status": "in_progress"})
        out.append(self._ev("response.function_call_arguments.delta", item_id=self.open["id"],
                            output_index=len(self.items) - 1, delta=call.arguments))
        self.open["arguments"] = call.arguments
        return out

    def chunk(self, msg: m.Tokens) -> list[str]:
        out: list[str] = []
        if msg.reasoning:
            if self.open is None or self.open["type"] != "reasoning":
                out += self._open({"type": "reasoning", "summary": [], "content": [], "status": "in_progress"})
            self.buffer += msg.reasoning
            out.append(self._ev("response.reasoning_text.delta", item_id=self.open["id"],
                                output_index=len(self.items) - 1, content_index=0, delta=msg.reasoning))
        if msg.text:
            if self.open is None or self.open["type"] != "message":
                out += self._open({"type": "message", "role": "assistant", "status": "in_progress", "content": []})
            self.buffer += msg.text
            out.append(self._ev("response.output_text.delta", item_id=self.open["id"],
                                output_index=len(self.items) - 1, content_index=0, delta=msg.text, logprobs=[]))
        for call in msg.tool_calls or ():
            out += self._call(call)
        return out

    def finish(self, done: m.Done) -> list[str]:
        """Close what is open and send the one terminal event."""
        status, incomplete = status_of(done)
        out: list[str] = []
        for call in done.tool_calls:  # a call the Done holds but no chunk carried (a call cut at the end)
            if call.id not in self.call_ids:
                out += self._call(call)
        if not self.items:  # no output at all: one empty message, as the non-streamed response has
            out += self._open({"type": "message", "role": "assistant", "status": "in_progress", "content": []})
        out += self.close("incomplete" if status == "incomplete" else "completed")
        kind = "response.completed" if status == "completed" else "response.incomplete"
        out.append(self._ev(kind, response=self.shape.response(status, self.items, done, incomplete)))
        return out

    def failed(self, message: str, code: str) -> str:
        if self.open is not None:
            self.open["status"] = "incomplete"
        return self._ev("response.failed", response=self.shape.response(
            "failed", self.items, error={"code": code, "message": message}))


class ResponsesAPI:
    """The Responses API route of one Front (front/app.py's, which mounts them);
    each request's work starts at ``front.start_generation``."""

    def __init__(self, front):
        self.front = front

    def routes(self) -> list[Route]:
        return [Route("/v1/responses", self.create, methods=["POST"])]

    async def create(self, request: Request) -> Response:
        route, seat = "responses", "-"
        received = time.monotonic()
        try:
            seat = self.front.seat_for(request)
            body = await self.front.json_body(request)
            try:
                gen, stream_it, echo = parse_responses_request(body)
            except BadRequest as exc:
                raise HTTPError(400, exc.message, exc.param, exc.code) from None
            client, welcome = await self.front.connected_client(seat)
            if "max_tokens" not in gen:
                gen["max_tokens"] = min(self.front.cfg.default_max_tokens, welcome.limits.max_tokens)
            model = self.front.cfg.model_name or welcome.model
            stream, reply = await self.front.start_generation(request, client, gen, stream_it, route, seat)
            if reply is None:
                return Response(status_code=499)
            shape = ResponseShape(stream.request_id, model, echo, gen["max_tokens"])
            if stream_it:
                return StreamingResponse(self._events(stream, reply, shape, route, seat, received),
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            self.front.metrics.request(route, seat, 200, reply.finish_reason)
            return JSONResponse(shape.full(reply))
        except HTTPError as exc:
            self.front.metrics.request(route, seat, exc.status, exc.code or "error")
            return exc.response()
        except ClientGone:
            self.front.metrics.request(route, seat, 499, "disconnected")
            return Response(status_code=499)
        except DaemonUnreachable as exc:
            err = from_unreachable(exc)
            self.front.metrics.request(route, seat, err.status, err.code)
            return err.response()
        except CouncilError as exc:
            err = from_council(exc)
            if exc.code == "overloaded":
                st = await self.front.status()
                if st is not None and st.detail.get("state") == "loading":  # not ready, not busy (as on chat)
                    err = HTTPError(503, exc.message, code="model_loading", retry_after=exc.retry_after_s or 2.0)
            self.front.metrics.request(route, seat, err.status, exc.code)
            return err.response()

    async def _events(self, stream, first, shape: ResponseShape, route: str, seat: str, received: float):
        ended = False
        events = ResponseEvents(shape)
        first_token = True
        try:
            for chunk in events.start():
                yield chunk
            msg = first
            while True:
                if isinstance(msg, m.Tokens):
                    if first_token and (msg.text or msg.reasoning or msg.tool_calls):
                        self.front.metrics.ttft.observe(time.monotonic() - received)
                        first_token = False
                    for chunk in events.chunk(msg):
                        yield chunk
                elif isinstance(msg, m.Done):
                    ended = True
                    for chunk in events.finish(msg):
                        yield chunk
                    self.front.metrics.request(route, seat, 200, msg.finish_reason)
                    return
                elif msg is None:  # the stream ended without a Done: still one terminal event
                    ended = True
                    yield events.failed("the daemon ended the stream without a result", "server_error")
                    self.front.metrics.request(route, seat, 500, "no_done")
                    return
                msg = await stream.next_message()
        except CouncilError as exc:
            # Headers are gone: the error travels in the stream, as response.failed.
            ended = True
            err = from_council(exc)
            self.front.metrics.request(route, seat, err.status, exc.code)
            yield events.failed(err.message, "rate_limit_exceeded" if err.status == 429 else "server_error")
        except Exception as exc:  # a fault of the front's own: still one terminal event, and the work stopped
            ended = True
            self.front.metrics.request(route, seat, 500, "internal")
            yield events.failed(f"the front failed: {type(exc).__name__}", "server_error")
            with anyio.CancelScope(shield=True):
                with suppress(Exception):
                    await stream.cancel()
        finally:
            if not ended:  # the client went away (or the response was torn down): stop the work
                self.front.metrics.request(route, seat, 499, "disconnected")
                with anyio.CancelScope(shield=True):
                    with suppress(Exception):
                        await stream.cancel()
