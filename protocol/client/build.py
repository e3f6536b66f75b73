"""Building requests: ids, the Generate message, and the local check against the daemon's
own decoder, so a request the daemon would reject fails before anything is sent."""

from __future__ import annotations

import uuid
from typing import Any, Iterable, Mapping

import msgspec

from .. import messages as m
from ..codec import DEFAULT_MAX_FRAME_BYTES, ProtocolError, UnencodableMessage, decode_client, encode
from .errors import InvalidRequest

# Generate fields a caller may pass to ``generate`` as keyword arguments beyond the ones it
# names (sampling options, logprobs); they are validated with the rest by the daemon's decoder.
SAMPLING_OPTIONS = tuple(m.SAMPLING_DEFAULTS)
# Generate fields beyond the sampling options that ``generate`` takes as keyword arguments, as
# structs or as plain dicts/lists (converted here): constrained decoding and tool calling.
REQUEST_EXTRAS = ("constraint", "tools", "tool_choice", "parallel_tool_calls", "count_only", "string_max_chars")


def new_request_id() -> str:
    """A random id: the daemon keys requests by (seat, request_id), so ids must not collide
    between the processes sharing a seat."""
    return uuid.uuid4().hex


def check_frame(msg: Any, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    """Encode ``msg`` and run the daemon's own decoder over it, so a request the daemon would
    reject fails here, before it is sent, with the same code and message. A string that is
    not valid Unicode (a lone surrogate) fails here too, as invalid_request naming the field."""
    try:
        frame = encode(msg)
    except UnencodableMessage as exc:
        raise InvalidRequest("invalid_request", str(exc), request_id=getattr(msg, "request_id", None)) from None
    try:
        decode_client(frame, max_frame_bytes)
    except ProtocolError as exc:
        raise InvalidRequest(exc.code, exc.message, request_id=getattr(msg, "request_id", None)) from None
    return frame


def check_max_tokens(msg: m.Generate, limits: m.Limits) -> None:
    if msg.max_tokens > limits.max_tokens:
        raise InvalidRequest(
            "invalid_request", f"max_tokens {msg.max_tokens} exceeds this daemon's limit of {limits.max_tokens}",
            request_id=msg.request_id,
        )


def check_limits(msg: m.Generate, frame: bytes, limits: m.Limits) -> None:
    """Check a Generate built before the Welcome (AsyncClient) against the daemon's limits."""
    check_max_tokens(msg, limits)
    if len(frame) > limits.max_frame_bytes:
        raise InvalidRequest(
            "frame_too_large", f"frame of {len(frame)} bytes exceeds the limit of {limits.max_frame_bytes}",
            request_id=msg.request_id,
        )


def build_generate(
    prompt: str | None,
    messages: Iterable[m.ChatMessage | Mapping[str, str]] | None,
    prompt_tokens: Iterable[int] | None,
    *,
    max_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int | None,
    stop: Iterable[str] | str | None,
    priority: str | None,
    deadline_ms: int | None,
    speculation: str | None,
    request_id: str | None,
    stream: bool,
    limits: m.Limits | None,
    chat_template_kwargs: Mapping[str, str | bool | int | float] | None = None,
    options: Mapping[str, Any] | None = None,
    session: str | None = None,
) -> tuple[m.Generate, bytes]:
    """The Generate for ``generate``'s arguments and its encoded frame; raises InvalidRequest
    (TypeError for an unknown keyword) before anything is sent. ``limits`` (from the Welcome,
    when known) bounds max_tokens and the frame size."""
    rid = request_id if request_id is not None else new_request_id()
    chat = None
    if messages is not None:
        try:
            chat = [c if isinstance(c, m.ChatMessage) else msgspec.convert(c, m.ChatMessage) for c in messages]
        except msgspec.ValidationError as exc:
            raise InvalidRequest("invalid_request", f"messages: {exc}", request_id=rid) from None
    if isinstance(stop, str):
        stop = [stop]
    msg = m.Generate(
        request_id=rid,
        prompt=prompt,
        messages=chat,
        prompt_tokens=list(prompt_tokens) if prompt_tokens is not None else None,
        max_tokens=max_tokens,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=top_k,
        seed=seed,
        stop=list(stop) if stop else [],
        stream=stream,
        priority=priority,
        deadline_ms=deadline_ms,
        speculation=speculation,
        chat_template_kwargs=dict(chat_template_kwargs) if chat_template_kwargs is not None else msgspec.UNSET,
        session=session if session is not None else msgspec.UNSET,
    )
    options = dict(options or {})
    extras = {k: options.pop(k) for k in REQUEST_EXTRAS if k in options}
    extras = {k: v for k, v in extras.items() if v is not None}  # None: not used, left out of the frame
    if extras:
        try:  # convert dicts to the fields' types (ToolSpec, Constraint, ...), with their bounds
            typed = msgspec.convert({"request_id": rid, "prompt": "-", **extras}, m.Generate)
        except msgspec.ValidationError as exc:
            raise InvalidRequest("invalid_request", str(exc), request_id=rid) from None
        msg = msgspec.structs.replace(msg, **{k: getattr(typed, k) for k in extras})
    if options:
        unknown = sorted(set(options) - set(SAMPLING_OPTIONS))
        if unknown:
            raise TypeError(f"unknown sampling option(s): {', '.join(unknown)}")
        # Options at their defaults stay unset (not encoded), so a daemon that predates them
        # accepts the request.
        given = {k: v for k, v in options.items() if v != m.SAMPLING_DEFAULTS[k]}
        try:
            msg = msgspec.structs.replace(msg, **given)
        except TypeError as exc:
            raise InvalidRequest("invalid_request", str(exc), request_id=rid) from None
    if msg.prompt_kind() is None:
        raise InvalidRequest("invalid_request", "give exactly one of prompt, messages, prompt_tokens", request_id=rid)
    if msg.prompt == "" or msg.messages == [] or msg.prompt_tokens == []:
        raise InvalidRequest("invalid_request", "the prompt is empty", request_id=rid)
    if limits is not None:
        check_max_tokens(msg, limits)
    frame = check_frame(msg, limits.max_frame_bytes if limits is not None else DEFAULT_MAX_FRAME_BYTES)
    return msg, frame
