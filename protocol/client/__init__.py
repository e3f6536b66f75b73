"""Client library for councild: a sync ``Client`` and an ``AsyncClient`` with the same surface.

Socket pattern (PROTOCOL.md has the whole contract): one ZeroMQ DEALER socket connected to
the daemon's ROUTER; every message is one frame holding one msgpack-encoded message. Several
requests may be in flight on one connection; replies are routed by ``request_id`` into
per-request buffers, so streams can be consumed interleaved and nothing is dropped.

Liveness (zguide): no wait is ever unbounded. While a call waits, the client sends ``Ping``
every ``heartbeat_interval_s`` (announced in ``Welcome.limits``), which also keeps the daemon
from declaring the connection gone. A daemon that says nothing at all (not even ``Pong``) for
``timeout_s`` raises ``DaemonUnavailable``; the socket is then closed and a fresh one is made
on the next call (Lazy Pirate), so queued stale messages never reach a later daemon.

    with Client(seat="planner") as client:
        stream = client.generate("Name three rivers.", max_tokens=64)
        for chunk in stream:
            print(chunk, end="", flush=True)
        print(stream.done.finish_reason, stream.done.usage.completion_tokens)

    async with AsyncClient(seat="critic") as client:
        async for chunk in client.generate("Name three rivers."):
            ...

One implementation, two shells. The modules, each readable in one sitting:
  errors        CouncilError and its families; error_from_wire
  build         request ids, the Generate builder, the local check with the daemon's decoder
  stream_state  what one request has received (shared by Stream and AsyncStream)
  liveness      when to ping, re-Hello, or give up (a policy over times passed in)
  core          ClientCore: one connection's state and the reply router (no I/O)
  transport     the DEALER socket: options, CURVE, close, disconnect events
  sync          Client and Stream: a poll loop that only sends, receives and waits
  aio           AsyncClient and AsyncStream: read, heartbeat and monitor tasks

This package imports pyzmq and msgspec only (never mlx).
"""

from .aio import AsyncClient, AsyncStream
from .build import SAMPLING_OPTIONS, new_request_id
from .build import build_generate as _build_generate  # noqa: F401 - tests build requests offline
from .errors import (
    CouncilError,
    DaemonError,
    DaemonUnavailable,
    InvalidRequest,
    Overloaded,
    RequestAborted,
    error_from_wire,
)
from .errors import FAMILIES as _FAMILIES  # noqa: F401 - tests check every wire code has a family
from .liveness import DEFAULT_HEARTBEAT_INTERVAL_S  # noqa: F401
from .sync import Client, Stream
from .transport import MAX_DAEMON_FRAME_BYTES, SOCKET_LINGER_MS  # noqa: F401

__all__ = [
    "Client",
    "AsyncClient",
    "Stream",
    "AsyncStream",
    "CouncilError",
    "InvalidRequest",
    "Overloaded",
    "RequestAborted",
    "DaemonError",
    "DaemonUnavailable",
    "error_from_wire",
    "new_request_id",
    "MAX_DAEMON_FRAME_BYTES",
]

# The public classes keep the module path they had when this package was one file, so
# tracebacks, reprs and pickles still say protocol.client.InvalidRequest.
for _cls in (Client, AsyncClient, Stream, AsyncStream, CouncilError, InvalidRequest, Overloaded, RequestAborted,
             DaemonError, DaemonUnavailable):
    _cls.__module__ = __name__
del _cls
