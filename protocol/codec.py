"""Frames to messages and back, checking in a fixed order before anything is trusted.

Order: size, then envelope (a msgpack map with ``type`` and ``v``), then version, then type,
then schema. Each failure is a ProtocolError carrying the wire error code, so the server
turns any bad frame into a typed Error reply without special cases.
"""

from __future__ import annotations

from typing import Any

import msgspec

from .unencodable import find_huge_int, find_lone_surrogate
from .messages import PROTOCOL_VERSION, ClientMessage, DaemonMessage

DEFAULT_MAX_FRAME_BYTES = 8 << 20


class ProtocolError(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class UnencodableMessage(ValueError):
    """A message that cannot be encoded: a string holding a lone UTF-16 surrogate (UTF-8 has
    no encoding for one), an integer outside msgpack's range (the message names the field of
    either), or values nested too deeply for the encoder."""


class _Envelope(msgspec.Struct):
    # Unknown fields are the schema's business, not the envelope's.
    type: str
    v: int


class _RequestId(msgspec.Struct):
    request_id: Any = None


_RequestIdOnly = msgspec.msgpack.Decoder(_RequestId)
_encoder = msgspec.msgpack.Encoder()
_envelope = msgspec.msgpack.Decoder(_Envelope)
_client = msgspec.msgpack.Decoder(ClientMessage)
_daemon = msgspec.msgpack.Decoder(DaemonMessage)

CLIENT_TYPES = frozenset(t.__struct_config__.tag for t in ClientMessage.__args__)
DAEMON_TYPES = frozenset(t.__struct_config__.tag for t in DaemonMessage.__args__)


def encode(message: Any) -> bytes:
    """The frame of ``message``; UnencodableMessage (a ValueError naming the field) when a
    string in it is not valid Unicode, an integer is out of range, or it nests too deeply."""
    try:
        return _encoder.encode(message)
    except UnicodeEncodeError:
        found = find_lone_surrogate(message)
        raise UnencodableMessage(found.describe() if found else "a string is not valid Unicode") from None
    except OverflowError:
        raise UnencodableMessage(find_huge_int(message) or "an integer is outside -2**63 .. 2**64-1") from None
    except RecursionError:
        raise UnencodableMessage("the message is nested too deeply to encode") from None


def _decode(frame: bytes, decoder: msgspec.msgpack.Decoder, known: frozenset[str], max_bytes: int):
    if len(frame) > max_bytes:
        raise ProtocolError("frame_too_large", f"frame of {len(frame)} bytes exceeds the limit of {max_bytes}")
    try:
        env = _envelope.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError("bad_frame", f"not a msgpack map with 'type' (str) and 'v' (int): {exc}") from None
    except RecursionError:  # msgspec's nesting limit: a small frame of nested arrays
        raise ProtocolError("bad_frame", "nested too deeply") from None
    if env.v != PROTOCOL_VERSION:
        raise ProtocolError("unsupported_version", f"protocol version {env.v} is not supported; this side speaks {PROTOCOL_VERSION}")
    if env.type not in known:
        raise ProtocolError("unknown_type", f"unknown message type {env.type[:64]!r}; expected one of {sorted(known)}")
    try:
        return decoder.decode(frame)
    except msgspec.ValidationError as exc:
        raise ProtocolError("invalid_request", str(exc)) from None
    except msgspec.DecodeError as exc:
        # The envelope parsed, so the frame is msgpack; what fails now is a value, in
        # practice a string that is not valid UTF-8 (a prompt cut mid-character, say). That
        # is the request's fault, answered with its id like any other invalid field.
        raise ProtocolError("invalid_request", f"{exc} (every string must be valid UTF-8)") from None
    except RecursionError:  # pragma: no cover - the envelope's skip recurses first
        raise ProtocolError("bad_frame", "nested too deeply") from None


def decode_client(frame: bytes, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> ClientMessage:
    """Decode a frame a council process sent; raise ProtocolError with the wire code."""
    return _decode(frame, _client, CLIENT_TYPES, max_bytes)


def decode_daemon(frame: bytes, max_bytes: int = 64 << 20) -> DaemonMessage:
    """Decode a frame the daemon sent."""
    return _decode(frame, _daemon, DAEMON_TYPES, max_bytes)


def peek_request_id(frame: bytes) -> str | None:
    """Best-effort request id of a frame that failed validation, so its error can be routed
    to the right stream. Never raises."""
    # Only request_id is read; the other fields are skipped unparsed, so one that is broken
    # (a string with invalid UTF-8, say) does not hide the id.
    try:
        rid = _RequestIdOnly.decode(frame).request_id
    except Exception:
        return None
    if isinstance(rid, str) and 0 < len(rid) <= 128:
        return rid
    return None
