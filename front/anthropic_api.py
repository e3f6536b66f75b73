"""Anthropic's Messages API over councild: /v1/messages and /v1/messages/count_tokens.

The request becomes the same Generate the OpenAI routes send (system prompt first, content
blocks flattened: ``tool_use`` blocks -> an assistant turn's tool_calls, ``tool_result``
blocks -> ``tool`` turns); the Done becomes content blocks (thinking, text, tool_use) and a
``stop_reason``; a stream becomes Anthropic's event sequence (message_start,
content_block_start / _delta / _stop, message_delta, message_stop). Errors keep their HTTP
status and take Anthropic's shape ({"type": "error", "error": {"type", "message"}}).

Seats come from the API key exactly as on the OpenAI side (Anthropic's clients send it as
``x-api-key``). The shared machinery (seat lookup, daemon clients, metrics, the start of a
generation) is the Front's, handed in by front/app.py, which imports this module and not the
reverse; the error type is front/errors.py's.
"""

from __future__ import annotations

import json
import logging
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
from .errors import HTTPError, from_council
from .schema import BadRequest

ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
              404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
              504: "api_error"}
log = logging.getLogger("councild.http")
STOP_REASON = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "cancelled": "end_turn"}
KNOWN = {"model", "messages", "max_tokens", "system", "temperature", "top_p", "top_k", "stop_sequences", "stream",
         "metadata", "tools", "tool_choice", "thinking", "service_tier",
         # councild extras, as on the OpenAI routes
         "priority", "speculation", "deadline_ms", "string_max_chars"}


def _text_blocks(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        out = []
        for i, block in enumerate(value):
            if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
                kind = block.get("type") if isinstance(block, dict) else type(block).__name__
                raise BadRequest(f"{where}[{i}]: only text blocks are supported here, not {kind!r}", f"{where}[{i}]")
            out.append(block["text"])
        return "".join(out)
    raise BadRequest(f"{where} must be a string or a list of text blocks", where)


def _messages(body: dict) -> list[dict]:
    out: list[dict] = []
    if body.get("system") is not None:
        out.append({"role": "system", "content": _text_blocks(body["system"], "system")})
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise BadRequest("messages: a non-empty list is required", "messages")
    for i, msg in enumerate(raw):
        where = f"messages.{i}"
        if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant"):
            raise BadRequest(f"{where}.role must be 'user' or 'assistant'", f"{where}.role")
        content = msg.get("content")
        if isinstance(content, str):
            out.append({"role": msg["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise BadRequest(f"{where}.content must be a string or a list of content blocks", f"{where}.content")
        text, calls = [], []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            bw = f"{where}.content.{j}"
            if kind == "text" and isinstance(block.get("text"), str):
                text.append(block["text"])
            elif kind in ("thinking", "redacted_thinking") and msg["role"] == "assistant":
                continue  # earlier thinking is not shown to the model again (Qwen's templates drop it too)
            elif kind == "tool_use" and msg["role"] == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) \
                        or not isinstance(block.get("input", {}), dict):
                    raise BadRequest(f"{bw}: tool_use needs 'id', 'name' and an object 'input'", bw)
                calls.append({"id": block["id"], "name": block["name"],
                              "arguments": json.dumps(block.get("input", {}), ensure_ascii=False)})
            elif kind == "tool_result" and msg["role"] == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise BadRequest(f"{bw}: tool_result needs 'tool_use_id'", bw)
                result = _text_blocks(block.get("content", ""), f"{bw}.content")
                if block.get("is_error"):
                    result = f"Error: {result}"
                out.append({"role": "tool", "content": result, "tool_call_id": block["tool_use_id"]})
            else:
                raise BadRequest(f"{bw}: content block {kind!r} is not supported in a {msg['role']} message "
                                 "(text, tool_use, tool_result and thinking are)", bw)
        if text or calls or not any(b.get("type") == "tool_result" for b in content if isinstance(b, dict)):
            item: dict = {"role": msg["role"], "content": "".join(text)}
            if calls:
                item["tool_calls"] = calls
            out.append(item)
    return out


def _tools(body: dict) -> tuple[list[dict] | None, Any, bool | None]:
    raw = body.get("tools")
    tools = None
    if raw:
        if not isinstance(raw, list):
            raise BadRequest("tools must be a list", "tools")
        tools = []
        for i, t in enumerate(raw):
            if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not isinstance(t.get("input_schema"), dict):
                raise BadRequest(f"tools.{i}: a custom tool needs 'name' and an object 'input_schema' (server tools "
                                 "are not supported)", f"tools.{i}")
            tools.append({"name": t["name"], "description": t.get("description") or "", "parameters": t["input_schema"]})
    choice_raw = body.get("tool_choice")
    if choice_raw is None:
        return tools, None, None
    if not isinstance(choice_raw, dict):
        raise BadRequest("tool_choice must be an object with 'type' (auto, any, tool or none)", "tool_choice")
    kind = choice_raw.get("type")
    parallel = None if not choice_raw.get("disable_parallel_tool_use") else False
    if kind == "auto" or kind == "none":
        return tools, kind, parallel
    if kind == "any":
        if not tools:
            raise BadRequest("tool_choice 'any' needs tools", "tool_choice")
        return tools, "required", parallel
    if kind == "tool":
        name = choice_raw.get("name")
        if not any(t["name"] == name for t in tools or []):
            raise BadRequest(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        return tools, {"name": name}, parallel
    raise BadRequest("tool_choice.type must be auto, any, tool or none", "tool_choice")


def parse_messages_request(body: Any, counting: bool = False) -> tuple[dict, bool]:
    """(AsyncClient.generate keyword arguments, stream) of a Messages API body."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - KNOWN)
    if unknown:
        raise BadRequest(f"{unknown[0]}: Extra inputs are not permitted", unknown[0])
    gen: dict[str, Any] = {"messages": _messages(body)}
    tools, choice, parallel = _tools(body)
    gen.update(tools=tools, tool_choice=choice if tools else None, parallel_tool_calls=parallel if tools else None)
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") in ("enabled", "disabled"):
        gen["chat_template_kwargs"] = {"enable_thinking": thinking["type"] == "enabled"}
    elif thinking is not None:
        raise BadRequest("thinking.type must be 'enabled' or 'disabled'", "thinking")
    if counting:
        return gen, False
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= m.MAX_TOKENS_CEILING:
        raise BadRequest("max_tokens: an integer >= 1 is required", "max_tokens")
    gen["max_tokens"] = max_tokens
    for key, lo, hi, default in (("temperature", 0.0, 1.0, 1.0), ("top_p", 0.0, 1.0, 1.0)):
        v = body.get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
            raise BadRequest(f"{key}: a number in [{lo}, {hi}] is required", key)
        gen[key] = float(v)
    if gen["top_p"] <= 0:
        raise BadRequest("top_p must be above 0", "top_p")
    top_k = body.get("top_k", 0)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise BadRequest("top_k: an integer >= 0 is required", "top_k")
    gen["top_k"] = top_k
    stops = body.get("stop_sequences") or []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > m.MAX_STOP_STRINGS:
        raise BadRequest(f"stop_sequences: at most {m.MAX_STOP_STRINGS} non-empty strings", "stop_sequences")
    gen["stop"] = stops
    for key in ("priority", "speculation", "deadline_ms"):
        if body.get(key) is not None:
            gen[key] = body[key]
    cap = body.get("string_max_chars")
    if cap is not None:
        if isinstance(cap, bool) or not isinstance(cap, int) or not 0 <= cap <= m.MAX_STRING_CHARS:
            raise BadRequest(f"string_max_chars: an integer in [0, {m.MAX_STRING_CHARS}] is required",
                             "string_max_chars")
        gen["string_max_chars"] = cap
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be true or false", "stream")
    return gen, stream


def usage(u: m.Usage) -> dict:
    return {"input_tokens": u.prompt_tokens, "output_tokens": u.completion_tokens,
            "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0}


def content_blocks(done: m.Done) -> list[dict]:
    blocks: list[dict] = []
    if done.reasoning:
        blocks.append({"type": "thinking", "thinking": done.reasoning, "signature": ""})
    if done.text or not done.tool_calls:
        blocks.append({"type": "text", "text": done.text})
    for call in done.tool_calls:
        blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": json.loads(call.arguments)})
    return blocks


def event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


class MessageEvents:
    """Anthropic's stream events of one response: open blocks as kinds change."""

    def __init__(self):
        self.index = -1
        self.open: str | None = None

    def _switch(self, kind: str, start: dict) -> list[str]:
        out = self.close()
        self.index += 1
        self.open = kind
        out.append(event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                 "content_block": start}))
        return out

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _delta(self, delta: dict) -> str:
        return event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def chunk(self, msg: m.Tokens) -> list[str]:
        out: list[str] = []
        if msg.reasoning:
            if self.open != "thinking":
                out += self._switch("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": msg.reasoning}))
        if msg.text:
            if self.open != "text":
                out += self._switch("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": msg.text}))
        for call in msg.tool_calls or ():
            out += self._switch("tool_use", {"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
            out.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments}))
            out += self.close()
        return out


class AnthropicAPI:
    """The Messages API routes of one Front (front/app.py's, which mounts them);
    each request's work starts at ``front.start_generation``."""

    def __init__(self, front):
        self.front = front

    def routes(self) -> list[Route]:
        return [Route("/v1/messages", self.messages, methods=["POST"]),
                Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"])]

    def error(self, status: int, message: str, headers: dict | None = None) -> JSONResponse:
        kind = ERROR_TYPE.get(status, "api_error")
        return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status_code=status,
                            headers=headers)

    def _error_response(self, exc) -> JSONResponse:
        resp = exc.response()  # the OpenAI-shaped one, for its status and Retry-After
        headers = {k: v for k, v in resp.headers.items() if k.lower() == "retry-after"}
        return self.error(exc.status, exc.message, headers)

    async def _start(self, request: Request, counting: bool):
        seat = self.front.seat_for(request)
        body = await self.front.json_body(request)
        try:
            gen, stream = parse_messages_request(body, counting)
        except BadRequest as exc:
            raise HTTPError(400, exc.message, exc.param) from None
        client, welcome = await self.front.connected_client(seat)
        if counting:
            gen.update(max_tokens=1, count_only=True)
        return seat, client, welcome, gen, stream, body

    async def count_tokens(self, request: Request) -> Response:
        try:
            _, client, _, gen, _, _ = await self._start(request, counting=True)
            done = await self.front.link.guard(client.generate(**gen, stream=False).result())
            return JSONResponse({"input_tokens": done.usage.prompt_tokens})
        except HTTPError as exc:
            return self._error_response(exc)
        except ClientGone:
            return Response(status_code=499)
        except DaemonUnreachable as exc:
            return self._unreachable(exc)
        except CouncilError as exc:
            return self._error_response(from_council(exc))

    async def messages(self, request: Request) -> Response:
        route, seat = "messages", "-"
        try:
            seat, client, welcome, gen, stream_it, body = await self._start(request, counting=False)
            if gen["max_tokens"] > welcome.limits.max_tokens:
                raise HTTPError(400, f"max_tokens: {gen['max_tokens']} > {welcome.limits.max_tokens}, this "
                                          "server's limit")
            model = self.front.cfg.model_name or welcome.model
            stream, reply = await self.front.start_generation(request, client, gen, stream_it, route, seat)
            if reply is None:
                return Response(status_code=499)
            msg_id = "msg_" + stream.request_id
            if stream_it:
                prompt_tokens = reply.prompt_tokens if isinstance(reply, m.Accepted) else 0
                return StreamingResponse(self._events(stream, msg_id, model, prompt_tokens, route, seat),
                                         media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            self.front.metrics.request(route, seat, 200, reply.finish_reason)
            return JSONResponse({"id": msg_id, "type": "message", "role": "assistant", "model": model,
                                 "content": content_blocks(reply), "stop_reason": STOP_REASON[reply.finish_reason],
                                 "stop_sequence": None, "usage": usage(reply.usage)})
        except HTTPError as exc:
            self.front.metrics.request(route, seat, exc.status, exc.code or "error")
            return self._error_response(exc)
        except ClientGone:
            self.front.metrics.request(route, seat, 499, "disconnected")
            return Response(status_code=499)
        except CouncilError as exc:
            err = from_council(exc)
            self.front.metrics.request(route, seat, err.status, exc.code)
            return self._error_response(err)
        except DaemonUnreachable as exc:
            self.front.metrics.request(route, seat, 503, "daemon_unavailable")
            return self._unreachable(exc)

    def _unreachable(self, exc: DaemonUnreachable) -> JSONResponse:
        """503 in Anthropic's shape, with Retry-After, while the daemon does not answer."""
        return self.error(503, exc.message, {"Retry-After": f"{exc.retry_after:g}"})

    async def _events(self, stream, msg_id: str, model: str, prompt_tokens: int, route: str, seat: str):
        ended = False
        blocks = MessageEvents()
        try:
            yield event("message_start", {"type": "message_start", "message": {
                "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [],
                "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}})
            while True:
                msg = await stream.next_message()
                if isinstance(msg, m.Tokens):
                    for chunk in blocks.chunk(msg):
                        yield chunk
                elif isinstance(msg, m.Done):
                    ended = True
                    if not blocks.index >= 0:  # no output at all: one empty text block, as Anthropic sends
                        for chunk in blocks._switch("text", {"type": "text", "text": ""}):
                            yield chunk
                    for chunk in blocks.close():
                        yield chunk
                    yield event("message_delta", {"type": "message_delta",
                                                  "delta": {"stop_reason": STOP_REASON[msg.finish_reason],
                                                            "stop_sequence": None},
                                                  "usage": usage(msg.usage)})
                    yield event("message_stop", {"type": "message_stop"})
                    self.front.metrics.request(route, seat, 200, msg.finish_reason)
                    return
                elif msg is None:
                    ended = True
                    return
        except CouncilError as exc:
            ended = True
            err = from_council(exc)
            self.front.metrics.request(route, seat, err.status, exc.code)
            yield event("error", {"type": "error", "error": {"type": ERROR_TYPE.get(err.status, "api_error"),
                                                             "message": err.message}})
        except Exception as exc:  # a fault of the front's own: the work stopped, still one error event
            ended = True
            self.front.metrics.request(route, seat, 500, "internal")
            log.exception("http.unexpected_error path=/v1/messages error=%s (mid-stream)", type(exc).__name__)
            with anyio.CancelScope(shield=True):
                with suppress(Exception):
                    await stream.cancel()
            yield event("error", {"type": "error", "error": {"type": "api_error", "message":
                                                             f"the front failed mid-stream ({type(exc).__name__})"}})
        finally:
            if not ended:  # the client went away: stop the work
                self.front.metrics.request(route, seat, 499, "disconnected")
                with anyio.CancelScope(shield=True):
                    with suppress(Exception):
                        await stream.cancel()
