"""A request's JSON body, read and decoded the same way on every route, within documented limits.

- size: at most ``http.max_body_bytes``: 413 ``request_too_large`` (read_body says when);
- decoding: msgspec's JSON decoder (strict RFC 8259: UTF-8, no NaN or Infinity literals,
  nothing after the value): otherwise 400 ``invalid_json`` with the decoder's reason;
- nesting: at most MAX_DEPTH levels of objects and arrays: 400 ``json_too_deep``;
- text: every string valid Unicode. A lone UTF-16 surrogate written as a JSON escape
  (``"a\\udcffb"``: a client that cut an emoji in half) or bytes that are not UTF-8 are a 400
  ``invalid_unicode`` whose ``param`` names the field (the protocol cannot carry such text;
  refusing it, rather than replacing it, keeps the prompt the model sees the one sent).

msgspec refuses a lone surrogate while decoding and reports only a byte offset, so to name
the field the refused body is decoded once more, by the standard library (which keeps lone
surrogates; invalid bytes become surrogates by ``surrogateescape``), and walked. That second
decode runs only for a body msgspec refused that holds a surrogate escape or invalid UTF-8.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec
from starlette.requests import ClientDisconnect, Request

from protocol.unencodable import find_lone_surrogate

from .errors import HTTPError

# Objects and arrays inside one another, the body itself being level 1. Real requests stay far
# below it (a tool's JSON Schema nested ten properties deep is ~25 levels).
MAX_DEPTH = 64
_decoder = msgspec.json.Decoder()
_CONTAINERS = frozenset((dict, list))
# A JSON escape of a UTF-16 surrogate (\uD800..\uDFFF), paired or not.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


class ClientGone(Exception):
    """The client went away before its body arrived (the route answers 499, as for any
    client that leaves)."""


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The raw body, at most ``max_bytes``; 413 beyond. A body up to twice the limit is read
    to its end (and dropped) before the 413, as nginx's lingering close does: a server that
    answers and closes while the client is still sending resets the connection, and the
    client sees the reset instead of the answer. A longer one is answered at once."""
    declared = request.headers.get("content-length")
    declared_size = int(declared) if declared is not None and declared.isdigit() and len(declared) < 19 else None
    if declared_size is not None and declared_size > 2 * max_bytes:
        raise too_large(max_bytes)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > 2 * max_bytes:
                break
            if size <= max_bytes:
                chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone() from None
    if size > max_bytes:
        raise too_large(max_bytes)
    return b"".join(chunks)


def too_large(max_bytes: int) -> HTTPError:
    return HTTPError(413, f"the request body is larger than {max_bytes} bytes, this server's limit "
                          "(http.max_body_bytes)", code="request_too_large")


def _too_deep(value: Any, limit: int) -> bool:
    """Whether objects and arrays in ``value`` nest more than ``limit`` levels (no recursion)."""
    if type(value) is not dict and type(value) is not list:
        return False
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > limit:
            return True
        items = v.values() if type(v) is dict else v
        if len(items) > 32 and _CONTAINERS.isdisjoint(map(type, items)):
            continue  # a long array of numbers or strings (token ids), passed over at C speed
        for item in items:
            kind = type(item)
            if kind is dict or kind is list:
                stack.append((item, depth + 1))
    return False


def _deep() -> HTTPError:
    return HTTPError(400, f"the request body nests objects and arrays more than {MAX_DEPTH} levels deep",
                     code="json_too_deep")


def _bad_text(raw: bytes, reason: str) -> HTTPError:
    """The 400 for a body msgspec refused: naming the field whose string is not valid Unicode
    when that is why, else msgspec's reason."""
    try:
        raw.decode("utf-8")
        utf8 = True
    except UnicodeDecodeError:
        utf8 = False
    if utf8 and not _SURROGATE_ESCAPE.search(raw):
        return HTTPError(400, f"the request body is not valid JSON: {reason}", code="invalid_json")
    try:
        value = json.loads(raw.decode("utf-8", "surrogateescape"))
    except RecursionError:
        return _deep()
    except ValueError:
        return HTTPError(400, f"the request body is not valid JSON: {reason}", code="invalid_json")
    if _too_deep(value, MAX_DEPTH):
        return _deep()
    found = find_lone_surrogate(value)
    if found is None:  # the surrogate escapes were pairs: msgspec's reason was something else
        return HTTPError(400, f"the request body is not valid JSON: {reason}", code="invalid_json")
    if not utf8 and 0xDC80 <= found.code_point <= 0xDCFF:  # surrogateescape's stand-in for a byte
        where = found.path or "the body"
        message = (f"{where}: {'an object key' if found.in_key else 'the string'} is not valid UTF-8 (byte "
                   f"0x{found.code_point - 0xDC00:02x} at character {found.index})")
    else:
        message = found.describe()
    return HTTPError(400, message, param=found.path or None, code="invalid_unicode")


def decode_json(raw: bytes) -> Any:
    """The body's JSON value, within the limits above; HTTPError (400) otherwise."""
    if not raw.strip():
        raise HTTPError(400, "the request body is empty; send a JSON object", code="invalid_json")
    try:
        value = _decoder.decode(raw)
    except RecursionError:  # msgspec's own nesting limit (deeper than MAX_DEPTH)
        raise _deep() from None
    except msgspec.DecodeError as exc:
        raise _bad_text(raw, str(exc)) from None
    except msgspec.MsgspecError as exc:  # a number out of range (1e400)
        raise HTTPError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if _too_deep(value, MAX_DEPTH):
        raise _deep()
    return value


async def read_json(request: Request, max_bytes: int) -> Any:
    """Read and decode a request body (every /v1 route that takes one reads it here)."""
    return decode_json(await read_body(request, max_bytes))
