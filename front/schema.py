"""OpenAI request bodies -> councild Generate arguments, and councild replies -> OpenAI bodies.

Every field of the OpenAI request is either mapped, accepted as harmless (listed in
HARMLESS), or refused with a 400 that names it: an option councild cannot honour is never
dropped in silence. councild's own extras (priority, speculation, top_k, min_p,
repetition_penalty, deadline_ms) ride in the same body, as the openai client's
``extra_body`` sends them.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from protocol import messages as m


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


# Accepted and without effect here: end-user ids, storage and routing hints of the hosted API.
HARMLESS = {"model", "user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"}
COMMON = {"max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "presence_penalty",
          "frequency_penalty", "logit_bias", "n", "logprobs",
          # councild extras
          "priority", "speculation", "top_k", "min_p", "repetition_penalty", "deadline_ms", "string_max_chars"}
CHAT_ONLY = {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "functions",
             "function_call", "parallel_tool_calls", "response_format", "modalities",
             # councild (and vLLM) extra: variables for the chat template, e.g. enable_thinking
             "chat_template_kwargs"}
COMPLETION_ONLY = {"prompt", "echo", "best_of", "suffix"}


@dataclass
class Parsed:
    """What one OpenAI request asks of councild."""

    generate: dict[str, Any]  # keyword arguments of AsyncClient.generate
    stream: bool
    include_usage: bool
    chat: bool
    logprobs: bool
    extra: dict[str, Any] = field(default_factory=dict)


def number_field(body: dict, key: str, kind: type, lo: float | None = None, hi: float | None = None, default=None):
    """``body[key]`` as ``kind`` within [lo, hi]; ``default`` when absent or null; a 400 naming
    the field otherwise (the chat, completions and Responses routes all read numbers so)."""
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)):
        raise BadRequest(f"'{key}' must be {'an integer' if kind is int else 'a number'}, not {v!r}", key)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise BadRequest(f"'{key}' must be in [{lo}, {hi}], not {v!r}", key)
    return kind(v)


def _unsupported(body: dict, key: str, allowed) -> None:
    if key in body and body[key] is not None and body[key] not in allowed:
        raise BadRequest(f"'{key}' = {body[key]!r} is not supported by councild (it serves one completion per request, "
                         f"text only); leave it out", key, "unsupported_parameter")


def _content(value: Any, where: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # content parts: text only
        out = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRequest(f"{where}: only text content parts are supported, not {kind!r}", where,
                                 "unsupported_parameter")
            out.append(part["text"])
        return "".join(out)
    raise BadRequest(f"{where} must be a string or a list of text parts", where)


def _tool_calls(raw: Any, where: str) -> list[dict]:
    """An assistant message's tool_calls (OpenAI's shape) -> protocol ToolCall dicts."""
    if not isinstance(raw, list):
        raise BadRequest(f"{where} must be a list", where)
    out = []
    for j, call in enumerate(raw):
        w = f"{where}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or call.get("type", "function") != "function" or not isinstance(call.get("id"), str):
            raise BadRequest(f"{w} must be {{\"id\": ..., \"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}", w)
        args = fn.get("arguments", "{}")
        if not isinstance(fn.get("name"), str) or not isinstance(args, str):
            raise BadRequest(f"{w}.function needs a string 'name' and 'arguments' (JSON text)", f"{w}.function")
        out.append({"id": call["id"], "name": fn["name"], "arguments": args})
    return out


def _messages(raw: Any) -> list[dict[str, str]]:
    if not isinstance(raw, list) or not raw:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    out = []
    for i, msg in enumerate(raw):
        if not isinstance(msg, dict):
            raise BadRequest(f"messages[{i}] must be an object", f"messages[{i}]")
        role = msg.get("role")
        if role == "developer":  # the newer name of the system role
            role = "system"
        if role not in ("system", "user", "assistant", "tool"):
            raise BadRequest(f"messages[{i}].role {msg.get('role')!r} is not one of system, developer, user, "
                             "assistant, tool", f"messages[{i}].role")
        item: dict[str, Any] = {"role": role, "content": _content(msg.get("content"), f"messages[{i}].content")}
        if msg.get("tool_calls"):
            if role != "assistant":
                raise BadRequest(f"messages[{i}].tool_calls: only assistant messages make tool calls",
                                 f"messages[{i}].tool_calls")
            item["tool_calls"] = _tool_calls(msg["tool_calls"], f"messages[{i}].tool_calls")
        if role == "tool":
            if not isinstance(msg.get("tool_call_id"), str) or not msg["tool_call_id"]:
                raise BadRequest(f"messages[{i}].tool_call_id is required for a tool message", f"messages[{i}].tool_call_id")
            item["tool_call_id"] = msg["tool_call_id"]
        if role in ("tool", "user", "assistant") and isinstance(msg.get("name"), str) and msg["name"]:
            item["name"] = msg["name"]
        out.append(item)
    return out


def _tools(raw: Any) -> list[dict] | None:
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list):
        raise BadRequest("'tools' must be a list", "tools")
    out = []
    for i, tool in enumerate(raw):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type") != "function":
            raise BadRequest(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}; only function tools "
                             "are supported", f"tools[{i}]", "unsupported_parameter")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(fn.get("name"), str) or not isinstance(params, dict):
            raise BadRequest(f"tools[{i}].function needs a string 'name' and an object 'parameters'", f"tools[{i}].function")
        out.append({"name": fn["name"], "description": fn.get("description") or "", "parameters": params})
    return out


def _tool_choice(raw: Any, tools: list[dict] | None):
    if raw is None:
        return None
    if raw in ("auto", "none", "required"):
        return raw
    fn = raw.get("function") if isinstance(raw, dict) and raw.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise BadRequest("'tool_choice' must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", "
                         "\"function\": {\"name\": ...}}", "tool_choice")
    if not any(t["name"] == fn["name"] for t in tools or []):
        raise BadRequest(f"'tool_choice' names {fn['name']!r}, which is not among the tools", "tool_choice")
    return {"name": fn["name"]}


def _response_format(raw: Any) -> dict | None:
    """response_format -> a protocol Constraint (dict), None for plain text."""
    if raw is None:
        return None
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"kind": "json_object", "value": ""}
    if kind == "json_schema":
        spec = raw.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise BadRequest("'response_format.json_schema.schema' must be a JSON Schema object",
                             "response_format.json_schema.schema")
        return {"kind": "json_schema", "value": json.dumps(schema)}
    raise BadRequest("'response_format.type' must be text, json_object or json_schema", "response_format.type",
                     "unsupported_parameter")


def _stop(raw: Any) -> list[str]:
    if raw is None:
        return []
    stops = [raw] if isinstance(raw, str) else raw
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise BadRequest("'stop' must be a string or a list of strings", "stop")
    if len(stops) > m.MAX_STOP_STRINGS:
        raise BadRequest(f"'stop' holds {len(stops)} strings; at most {m.MAX_STOP_STRINGS}", "stop")
    if any(not s for s in stops):
        raise BadRequest("'stop' strings must not be empty", "stop")
    return stops


def _logit_bias(raw: Any) -> dict[int, float] | None:
    if raw is None or raw == {}:
        return None
    if not isinstance(raw, dict):
        raise BadRequest("'logit_bias' must be an object of token id -> bias", "logit_bias")
    out = {}
    for k, v in raw.items():
        try:
            tid = int(k)
        except (TypeError, ValueError):
            raise BadRequest(f"'logit_bias' key {k!r} is not a token id", "logit_bias") from None
        if tid < 0 or isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise BadRequest(f"'logit_bias' entry {k!r}: {v!r} must be a number in [-100, 100] for a token id >= 0",
                             "logit_bias")
        out[tid] = float(v)
    return out


def parse_request(body: Any, chat: bool, default_max_tokens: int) -> Parsed:
    """Validate an OpenAI request body; raise BadRequest naming the first bad or unsupported field."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    known = HARMLESS | COMMON | (CHAT_ONLY if chat else COMPLETION_ONLY)
    unknown = sorted(set(body) - known)
    if unknown:
        raise BadRequest(f"unrecognized request argument(s): {', '.join(unknown)}", unknown[0], "unsupported_parameter")
    _unsupported(body, "n", (1,))
    _unsupported(body, "best_of", (1,))
    _unsupported(body, "echo", (False,))
    _unsupported(body, "suffix", ("",))
    _unsupported(body, "function_call", ("none",))
    _unsupported(body, "modalities", (["text"],))
    if body.get("functions"):
        raise BadRequest("the legacy 'functions' parameter is not supported; use 'tools'", "functions",
                         "unsupported_parameter")

    gen: dict[str, Any] = {}
    if chat:
        gen["messages"] = _messages(body.get("messages"))
        tools = _tools(body.get("tools"))
        choice = _tool_choice(body.get("tool_choice"), tools)
        if choice not in (None, "none", "auto") and not tools:
            raise BadRequest(f"'tool_choice' {body.get('tool_choice')!r} needs 'tools'", "tool_choice")
        gen["tools"] = tools
        gen["tool_choice"] = choice if tools else None
        parallel = body.get("parallel_tool_calls")
        if parallel is not None and not isinstance(parallel, bool):
            raise BadRequest("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
        gen["parallel_tool_calls"] = parallel if tools else None
        gen["constraint"] = _response_format(body.get("response_format"))
        if gen["constraint"] is not None and choice not in (None, "none", "auto") and tools:
            raise BadRequest("'response_format' and a forced 'tool_choice' exclude each other", "response_format")
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # one prompt in a list
        if isinstance(prompt, str):
            if not prompt:
                raise BadRequest("'prompt' is empty", "prompt")
            gen["prompt"] = prompt
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            gen["prompt_tokens"] = prompt
        elif isinstance(prompt, list) and len(prompt) > 1:
            raise BadRequest("several prompts in one request are not supported; send one request per prompt", "prompt",
                             "unsupported_parameter")
        else:
            raise BadRequest("'prompt' must be a non-empty string or a list of token ids", "prompt")

    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = number_field(body, key, int, 1, m.MAX_TOKENS_CEILING)
    gen["max_tokens"] = max_tokens if max_tokens is not None else default_max_tokens
    # OpenAI's default temperature is 1; councild's greedy (and exact speculation) is temperature 0.
    gen["temperature"] = number_field(body, "temperature", float, 0.0, 100.0, 1.0)
    gen["top_p"] = number_field(body, "top_p", float, 0.0, 1.0, 1.0)
    if gen["top_p"] <= 0.0:
        raise BadRequest("'top_p' must be above 0", "top_p")
    gen["top_k"] = number_field(body, "top_k", int, 0, 1 << 20, 0)
    gen["seed"] = number_field(body, "seed", int, 0, (1 << 63) - 1)
    gen["stop"] = _stop(body.get("stop"))
    gen["min_p"] = number_field(body, "min_p", float, 0.0, 1.0, 0.0)
    gen["repetition_penalty"] = number_field(body, "repetition_penalty", float, 0.0, 10.0, 1.0)
    if gen["repetition_penalty"] <= 0.0:
        raise BadRequest("'repetition_penalty' must be above 0", "repetition_penalty")
    gen["presence_penalty"] = number_field(body, "presence_penalty", float, -2.0, 2.0, 0.0)
    gen["frequency_penalty"] = number_field(body, "frequency_penalty", float, -2.0, 2.0, 0.0)
    gen["logit_bias"] = _logit_bias(body.get("logit_bias"))
    gen["deadline_ms"] = number_field(body, "deadline_ms", int, 1, 7 * 24 * 3600 * 1000)
    # Cap on free strings in forced tool calls and json_schema answers (0: none); absent: the daemon's.
    gen["string_max_chars"] = number_field(body, "string_max_chars", int, 0, m.MAX_STRING_CHARS)
    for key, allowed in (("priority", ("interactive", "normal", "background")), ("speculation", ("off", "exact", "fast"))):
        v = body.get(key)
        if v is not None and v not in allowed:
            raise BadRequest(f"'{key}' must be one of {', '.join(allowed)}, not {v!r}", key)
        gen[key] = v

    if chat and body.get("chat_template_kwargs") is not None:
        kw = body["chat_template_kwargs"]
        if not isinstance(kw, dict):
            raise BadRequest("'chat_template_kwargs' must be an object", "chat_template_kwargs")
        gen["chat_template_kwargs"] = kw  # checked by the protocol's own validation
    if chat:
        want = body.get("logprobs")
        if want is not None and not isinstance(want, bool):
            raise BadRequest("'logprobs' must be true or false", "logprobs")
        top = number_field(body, "top_logprobs", int, 0, m.MAX_TOP_LOGPROBS, 0)
        if top and not want:
            raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        logprobs = bool(want)
    else:
        top = number_field(body, "logprobs", int, 0, 5)  # the legacy API: an int, the alternatives per token
        logprobs = top is not None
        top = top or 0
    gen["logprobs"] = logprobs
    gen["top_logprobs"] = top

    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false", "stream")
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}):
        raise BadRequest("'stream_options' supports only include_usage", "stream_options", "unsupported_parameter")
    include_usage = bool(opts and opts.get("include_usage"))
    return Parsed(generate=gen, stream=stream, include_usage=include_usage, chat=chat, logprobs=logprobs)


# ------------------------------------------------------------------------------ responses


def usage(u: m.Usage) -> dict:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


# The floor OpenAI's API reports for a token of no probability. A logprob of -inf (a token a
# constraint or top-k/top-p excludes, listed among the alternatives) is not JSON.
LOGPROB_FLOOR = -9999.0


def finite_logprob(lp: float) -> float:
    return lp if lp >= LOGPROB_FLOOR else LOGPROB_FLOOR  # NaN compares False: the floor too


def chat_logprobs(entries: list[m.TokenLogprob]) -> dict:
    def one(token: str, lp: float) -> dict:
        return {"token": token, "logprob": finite_logprob(lp), "bytes": list(token.encode("utf-8"))}

    return {"content": [
        {**one(e.token, e.logprob), "top_logprobs": [one(t.token, t.logprob) for t in e.top_logprobs]}
        for e in entries
    ]}


def completion_logprobs(entries: list[m.TokenLogprob], offset: int = 0) -> dict:
    offsets, pos = [], offset
    for e in entries:
        offsets.append(pos)
        pos += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [finite_logprob(e.logprob) for e in entries],
        "top_logprobs": [{t.token: finite_logprob(t.logprob) for t in e.top_logprobs} for e in entries],
        "text_offset": offsets,
    }


def finish_reason(done: m.Done) -> str:
    return done.finish_reason if done.finish_reason in ("length", "tool_calls") else "stop"


def openai_tool_call(call: m.ToolCall, index: int | None = None) -> dict:
    out = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    if index is not None:  # stream deltas carry the call's position
        out = {"index": index, **out}
    return out


class ResponseShape:
    """Builds the bodies of one request's response (ids, timestamps, object names)."""

    def __init__(self, parsed: Parsed, request_id: str, model: str):
        self.p = parsed
        self.id = ("chatcmpl-" if parsed.chat else "cmpl-") + request_id
        self.model = model
        self.created = int(time.time())
        self.text_offset = 0
        self.calls_sent = 0

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, done: m.Done) -> dict:
        lps = done.logprobs or []
        if self.p.chat:
            message = {"role": "assistant", "content": done.text}
            if done.tool_calls:
                message["content"] = done.text or None
                message["tool_calls"] = [openai_tool_call(c) for c in done.tool_calls]
            if done.reasoning:  # thinking apart from the answer, as vLLM and DeepSeek name it
                message["reasoning_content"] = done.reasoning
            choice = {"index": 0, "message": message,
                      "logprobs": chat_logprobs(lps) if self.p.logprobs else None, "finish_reason": finish_reason(done)}
            body = self._base("chat.completion")
        else:
            choice = {"index": 0, "text": done.text, "logprobs": completion_logprobs(lps) if self.p.logprobs else None,
                      "finish_reason": finish_reason(done)}
            body = self._base("text_completion")
        body["choices"] = [choice]
        body["usage"] = usage(done.usage)
        body["system_fingerprint"] = None
        return body

    def chunk(self, text: str | None, lps: list[m.TokenLogprob] | None, finish: str | None = None,
              first: bool = False, reasoning: str = "", tool_calls: list[m.ToolCall] | None = None) -> dict:
        if self.p.chat:
            delta: dict = {}
            if first:
                delta["role"] = "assistant"
            if reasoning:
                delta["reasoning_content"] = reasoning
            if text is not None and (text or not (reasoning or tool_calls)):
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = [openai_tool_call(c, self.calls_sent + i) for i, c in enumerate(tool_calls)]
                self.calls_sent += len(tool_calls)
            choice = {"index": 0, "delta": delta,
                      "logprobs": chat_logprobs(lps) if (self.p.logprobs and lps) else None, "finish_reason": finish}
            body = self._base("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text or "",
                      "logprobs": completion_logprobs(lps, self.text_offset) if (self.p.logprobs and lps) else None,
                      "finish_reason": finish}
            self.text_offset += len(text or "")
            body = self._base("text_completion")
        body["choices"] = [choice]
        if self.p.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, done: m.Done) -> dict:
        body = self._base("chat.completion.chunk" if self.p.chat else "text_completion")
        body["choices"] = []
        body["usage"] = usage(done.usage)
        return body
