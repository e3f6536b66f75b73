"""The part of a councild client that does no I/O: one connection's state and the reply router.

``Client`` (sync) and ``AsyncClient`` subclass ``ClientCore`` and add only how they send,
receive and wait. Everything about *what* a reply means lives here, once: which stream a
message belongs to and when that stream is finished, which caller a control reply answers,
what is stray, and the Welcome/Pong bookkeeping.

A waiting caller is represented by a waiter with the ``asyncio.Future`` surface (``done``,
``set_result``, ``set_exception``): AsyncClient passes futures, Client passes ``Reply``
slots that its pump loop polls.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from typing import Any

from .. import messages as m
from ..codec import decode_daemon, encode
from ..paths import default_endpoint
from .build import check_frame
from .errors import DaemonUnavailable, InvalidRequest, error_from_wire
from .liveness import Liveness
from .stream_state import StreamState
from .transport import MAX_DAEMON_FRAME_BYTES

_REQUEST_REPLIES = (m.Accepted, m.Tokens, m.Done, m.Error)
_CONTROL_REPLIES = (m.StatusReply, m.GovernorReply)


class Reply:
    """A reply slot for a sync caller: the asyncio.Future surface without an event loop."""

    __slots__ = ("_done", "_value", "_exc")

    def __init__(self) -> None:
        self._done = False
        self._value: Any = None
        self._exc: BaseException | None = None

    def done(self) -> bool:
        return self._done

    def set_result(self, value: Any) -> None:
        self._value, self._done = value, True

    def set_exception(self, exc: BaseException) -> None:
        self._exc, self._done = exc, True

    def result(self) -> Any:
        if self._exc is not None:
            raise self._exc
        return self._value


class ClientCore:
    """State shared by both clients: endpoint and seat, the Welcome, the streams and control
    callers waiting for replies, stray messages, and the liveness clock."""

    def __init__(self, endpoint, seat, timeout_s, curve_server_key, curve_keys, client_name):
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self.endpoint = endpoint or default_endpoint()
        self.seat = seat
        self.timeout_s = float(timeout_s)
        self._hello_frame = check_frame(m.Hello(seat=seat, client=client_name))
        self._curve = (curve_server_key, curve_keys)
        self._sock = None
        self._monitor = None
        self._welcome: m.Welcome | None = None
        self._streams: dict[str, StreamState] = {}
        # Callers waiting for a control reply (Welcome, StatusReply, GovernorReply), oldest
        # first: the daemon answers a connection's control messages in order.
        self._control: deque[tuple[type, Any]] = deque()
        self._ping_waiters: dict[int, Any] = {}
        self.stray: deque[Any] = deque(maxlen=64)  # messages no caller was waiting for
        self._nonce = itertools.count(1)
        self._live = Liveness(self.timeout_s)
        self._closed = False

    # -------------------------------------------------------------- liveness
    def _heartbeat_interval(self) -> float:
        return self._live.interval_s(self._welcome.limits.heartbeat_interval_s if self._welcome is not None else None)

    def _hello_due(self) -> bool:
        """Say Hello again before the next message: after a quiet spell the daemon may have
        forgotten this connection's seat (sent in order, so the request lands in the right seat)."""
        return self._welcome is not None and self._live.quiet(time.monotonic(), self._heartbeat_interval())

    def _ping_frame(self) -> bytes:
        """A heartbeat Ping; its Pong has no waiter and only counts as hearing from the daemon."""
        return encode(m.Ping(nonce=next(self._nonce)))

    def _outstanding(self) -> bool:
        return bool(self._streams or self._control or self._ping_waiters)

    def _unavailable_error(self, reason: str) -> DaemonUnavailable:
        return DaemonUnavailable(
            self.endpoint,
            f"councild at {self.endpoint} is unavailable: {reason} (timeout {self.timeout_s:g} s); "
            "is the daemon running? (`councild service status`)",
        )

    # -------------------------------------------------------------- waiting callers
    def _add_stream(self, stream: StreamState) -> None:
        if stream.request_id in self._streams:
            raise InvalidRequest("duplicate_request", "this id is already in flight on this client",
                                 request_id=stream.request_id)
        self._live.start_busy(time.monotonic(), self._outstanding())
        self._streams[stream.request_id] = stream

    def _expect(self, reply_type: type, waiter: Any) -> None:
        self._live.start_busy(time.monotonic(), self._outstanding())
        self._control.append((reply_type, waiter))

    def _forget(self, reply_type: type, waiter: Any) -> None:
        try:
            self._control.remove((reply_type, waiter))
        except ValueError:
            pass

    def _expect_pong(self, waiter: Any) -> int:
        nonce = next(self._nonce)
        self._live.start_busy(time.monotonic(), self._outstanding())
        self._ping_waiters[nonce] = waiter
        return nonce

    def _fail_waiters(self, exc: BaseException) -> None:
        """Hand ``exc`` to every stream and caller still waiting (the connection is gone)."""
        for stream in self._streams.values():
            stream._deliver(exc)
        self._streams.clear()
        for waiter in [w for _, w in self._control] + list(self._ping_waiters.values()):
            if not waiter.done():
                waiter.set_exception(exc)
        self._control.clear()
        self._ping_waiters.clear()

    # -------------------------------------------------------------- routing
    def _receive(self, frame: bytes) -> None:
        """Route one frame from the daemon; raises ProtocolError for one it cannot decode."""
        self._live.heard(time.monotonic())
        self._route(decode_daemon(frame, MAX_DAEMON_FRAME_BYTES))

    def _bad_frame(self, exc: Exception) -> None:
        # A daemon speaking another version answers Hello with frames we cannot read.
        waiter = self._take_control(m.Welcome)
        if waiter is not None:
            waiter.set_exception(InvalidRequest(exc.code, f"the daemon's reply: {exc.message}"))
        self.stray.append(exc)

    def _take_control(self, reply_type: type | None) -> Any:
        """The oldest caller waiting for ``reply_type`` (any caller when None)."""
        for entry in list(self._control):
            rtype, waiter = entry
            if waiter.done():  # its caller gave up
                self._control.remove(entry)
            elif reply_type is None or rtype is reply_type:
                self._control.remove(entry)
                return waiter
        return None

    def _route(self, msg: Any) -> None:
        if isinstance(msg, _REQUEST_REPLIES) and msg.request_id is not None:
            # not_found answers a Cancel that came too late: never a stream's terminal.
            if isinstance(msg, m.Error) and msg.code == "not_found":
                self.stray.append(msg)
                return
            stream = self._streams.get(msg.request_id)
            if stream is None:
                self.stray.append(msg)
                return
            stream._deliver(msg)
            if isinstance(msg, m.TERMINAL_TYPES):
                del self._streams[msg.request_id]
        elif isinstance(msg, m.Pong):
            waiter = self._ping_waiters.pop(msg.nonce, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(time.monotonic())
        elif isinstance(msg, m.Welcome):
            self._welcome = msg
            waiter = self._take_control(m.Welcome)
            if waiter is not None:
                waiter.set_result(msg)
        elif isinstance(msg, _CONTROL_REPLIES):
            waiter = self._take_control(type(msg))
            if waiter is not None:
                waiter.set_result(msg)
            else:
                self.stray.append(msg)
        elif isinstance(msg, m.Error):
            # An Error without a request id answers the oldest control message.
            self.stray.append(msg)
            waiter = self._take_control(None)
            if waiter is not None:
                waiter.set_exception(error_from_wire(msg))
