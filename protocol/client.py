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

This module imports pyzmq and msgspec only (never mlx).
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections import deque
from typing import Any, Callable, Iterable, Mapping

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from . import messages as m
from .codec import DEFAULT_MAX_FRAME_BYTES, ProtocolError, decode_client, decode_daemon, encode
from .paths import default_endpoint

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

# The largest frame a client accepts from the daemon (ZMQ_MAXMSGSIZE on the DEALER socket and
# the bound given to decode_daemon). A Done carries the full text; 64 MiB is far above any
# max_tokens a daemon allows.
MAX_DAEMON_FRAME_BYTES = 64 << 20
# Until the Welcome announces the daemon's interval.
DEFAULT_HEARTBEAT_INTERVAL_S = 1.0
SOCKET_LINGER_MS = 100


# ---------------------------------------------------------------------------- errors


class CouncilError(Exception):
    """An Error the daemon sent (``code`` is the wire code), or a local failure with the
    same shape. Subclasses group the codes by what a caller does about them."""

    def __init__(self, code: str, message: str, retry_after_s: float | None = None, request_id: str | None = None):
        text = f"{code}: {message}"
        if request_id is not None:
            text += f" [request {request_id}]"
        if retry_after_s is not None:
            text += f" (retry after {retry_after_s:g} s)"
        super().__init__(text)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s
        self.request_id = request_id


class InvalidRequest(CouncilError):
    """The request is wrong and retrying it unchanged will fail again."""


class Overloaded(CouncilError):
    """The daemon cannot take the work now (``overloaded``, ``shutting_down``); try later,
    after ``retry_after_s`` when it is given."""


class RequestAborted(CouncilError):
    """The request was accepted but ended without a Done (deadline, slow consumer, client gone)."""


class DaemonError(CouncilError):
    """A bug or failure inside the daemon (``internal``), or a code this client does not know."""


class DaemonUnavailable(CouncilError):
    """Nothing was heard from the daemon within ``timeout_s``. Not a wire code: ``code`` is
    ``"unavailable"`` and ``endpoint`` names where the client looked."""

    def __init__(self, endpoint: str, message: str, request_id: str | None = None):
        super().__init__("unavailable", message, request_id=request_id)
        self.endpoint = endpoint


_FAMILIES: dict[str, type[CouncilError]] = {
    "bad_frame": InvalidRequest,
    "frame_too_large": InvalidRequest,
    "unsupported_version": InvalidRequest,
    "unknown_type": InvalidRequest,
    "invalid_request": InvalidRequest,
    "duplicate_request": InvalidRequest,
    "not_found": InvalidRequest,
    "prompt_too_long": InvalidRequest,
    "overloaded": Overloaded,
    "shutting_down": Overloaded,
    "deadline_exceeded": RequestAborted,
    "slow_consumer": RequestAborted,
    "client_gone": RequestAborted,
    "internal": DaemonError,
}


def error_from_wire(err: m.Error) -> CouncilError:
    """The exception for an Error message, of the subclass of its code's family."""
    cls = _FAMILIES.get(err.code, DaemonError)
    return cls(err.code, err.message, err.retry_after_s, err.request_id)


# ---------------------------------------------------------------------------- building requests


def new_request_id() -> str:
    """A random id: the daemon keys requests by (seat, request_id), so ids must not collide
    between the processes sharing a seat."""
    return uuid.uuid4().hex


def _check(msg: Any, max_frame_bytes: int) -> bytes:
    """Encode ``msg`` and run the daemon's own decoder over it, so a request the daemon would
    reject fails here, before it is sent, with the same code and message."""
    frame = encode(msg)
    try:
        decode_client(frame, max_frame_bytes)
    except ProtocolError as exc:
        raise InvalidRequest(exc.code, exc.message, request_id=getattr(msg, "request_id", None)) from None
    return frame


# Generate fields a caller may pass to ``generate`` as keyword arguments beyond the ones it
# names (sampling options, logprobs); they are validated with the rest by the daemon's decoder.
SAMPLING_OPTIONS = tuple(m.SAMPLING_DEFAULTS)


def _build_generate(
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
) -> tuple[m.Generate, bytes]:
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
        chat_template_kwargs=dict(chat_template_kwargs) if chat_template_kwargs is not None else None,
    )
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
    if limits is not None and max_tokens > limits.max_tokens:
        raise InvalidRequest(
            "invalid_request", f"max_tokens {max_tokens} exceeds this daemon's limit of {limits.max_tokens}", request_id=rid
        )
    frame = _check(msg, limits.max_frame_bytes if limits is not None else DEFAULT_MAX_FRAME_BYTES)
    return msg, frame


def _as_key(key: str | bytes) -> bytes:
    return key.encode("ascii") if isinstance(key, str) else bytes(key)


def _setup_socket(sock: zmq.Socket, timeout_s: float, curve_server_key, curve_keys) -> None:
    sock.setsockopt(zmq.LINGER, SOCKET_LINGER_MS)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_DAEMON_FRAME_BYTES)
    # Sends are bounded too: a full queue to an absent daemon must not block forever.
    sock.setsockopt(zmq.SNDTIMEO, max(1, int(timeout_s * 1000)))
    if curve_server_key is not None:
        public, secret = curve_keys if curve_keys is not None else zmq.curve_keypair()
        sock.setsockopt(zmq.CURVE_SERVERKEY, _as_key(curve_server_key))
        sock.setsockopt(zmq.CURVE_PUBLICKEY, _as_key(public))
        sock.setsockopt(zmq.CURVE_SECRETKEY, _as_key(secret))


def _close_socket(sock, monitor, linger: int) -> None:
    if monitor is not None:
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass
        monitor.close(linger=0)
    sock.close(linger=linger)


def _disconnected(frames: list[bytes]) -> bool:
    try:
        return parse_monitor_message(frames)["event"] == zmq.EVENT_DISCONNECTED
    except Exception:  # pragma: no cover - malformed monitor message
        return False


_LOST = ("lost the connection (the daemon exited or restarted); requests in flight there are gone")

_REQUEST_REPLIES = (m.Accepted, m.Tokens, m.Done, m.Error)


# ---------------------------------------------------------------------------- streams


class _StreamState:
    """What one request has received so far; shared by the sync and async streams."""

    def __init__(self, request: m.Generate):
        self.request = request
        self.request_id: str = request.request_id
        self.accepted: m.Accepted | None = None
        self.done: m.Done | None = None
        self.error: BaseException | None = None
        self.token_ids: list[int] = []
        self.chunks: list[str] = []
        # Thinking text streamed apart from the answer (PROTOCOL.md 4.1); iteration yields
        # the answer's chunks only.
        self.reasoning_chunks: list[str] = []
        self.cancel_requested = False
        self._next_seq = 0

    @property
    def finished(self) -> bool:
        """True once the terminal message (Done or Error) has been consumed, or the stream failed."""
        return self.done is not None or self.error is not None

    @property
    def text(self) -> str:
        """The full text once done (Done.text, after stop strings), else the chunks so far."""
        if self.done is not None:
            return self.done.text
        return "".join(self.chunks)

    @property
    def reasoning(self) -> str:
        """The thinking text: Done.reasoning once done, else the reasoning chunks so far."""
        if self.done is not None:
            return self.done.reasoning
        return "".join(self.reasoning_chunks)

    def _apply(self, msg: Any) -> str | None:
        """Consume one routed message; returns a text chunk to hand out, raises on Error."""
        if isinstance(msg, m.Tokens):
            if msg.seq != self._next_seq:
                self.error = DaemonError(
                    "internal", f"stream out of order: expected seq {self._next_seq}, got {msg.seq}", request_id=self.request_id
                )
                raise self.error
            self._next_seq += 1
            self.token_ids.extend(msg.token_ids)
            if msg.reasoning:
                self.reasoning_chunks.append(msg.reasoning)
            if msg.text:
                self.chunks.append(msg.text)
                return msg.text
            return None
        if isinstance(msg, m.Accepted):
            self.accepted = msg
            return None
        if isinstance(msg, m.Done):
            self.done = msg
            return None
        if isinstance(msg, m.Error):
            self.error = error_from_wire(msg)
            raise self.error
        if isinstance(msg, BaseException):  # the client failed every pending stream
            self.error = msg
            raise msg
        return None  # pragma: no cover - the router only queues the types above

    def __repr__(self) -> str:
        state = "done" if self.done else "failed" if self.error else "pending"
        return f"<{type(self).__name__} {self.request_id} {state} chunks={len(self.chunks)}>"


class Stream(_StreamState):
    """One request on a sync Client: iterate it for text chunks (str, in order; chunks whose
    text is empty are not handed out but their token ids are kept). Afterwards ``.done`` is
    the Done message, ``.accepted`` the Accepted, ``.text`` the full text, ``.token_ids`` the
    streamed ids. A terminal Error raises a CouncilError subclass from the iteration."""

    def __init__(self, client: "Client", request: m.Generate):
        super().__init__(request)
        self._client = client
        self._queue: deque = deque()

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> str:
        while True:
            if self._queue:
                chunk = self._apply(self._queue.popleft())
                if self.done is not None:
                    raise StopIteration
                if chunk:
                    return chunk
                continue
            if self.done is not None:
                raise StopIteration
            if self.error is not None:
                raise self.error
            self._client._pump_until(lambda: bool(self._queue), what=f"request {self.request_id}")

    def result(self) -> m.Done:
        """Consume the rest of the stream and return the Done (raises on a terminal Error)."""
        for _ in self:
            pass
        assert self.done is not None
        return self.done

    def cancel(self) -> None:
        """Send Cancel. The stream then ends with Done(finish_reason="cancelled"), or with the
        terminal it already had; keep iterating (or call ``result()``) to see it."""
        if self.cancel_requested or self.request_id not in self._client._streams:
            return
        self.cancel_requested = True
        self._client._send(m.Cancel(request_id=self.request_id))

    def close(self) -> None:
        """Cancel if still running and stop buffering this stream's messages."""
        self.cancel()
        self._client._streams.pop(self.request_id, None)

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        if not self.finished:
            self.close()


# ---------------------------------------------------------------------------- sync client


class Client:
    """A sync councild client on one DEALER socket.

    Not thread-safe: use one Client per thread (they are cheap; ZeroMQ sockets must not be
    shared between threads). Heartbeats are sent only while a call on this client is waiting,
    so a stream left unread for longer than the daemon's ``heartbeat_timeout_s`` is ended by
    the daemon with ``client_gone``; iterate streams promptly, or use AsyncClient, whose
    background task keeps the connection alive.

    ``timeout_s`` bounds every wait: for a reply to Hello/Status/Ping/GovernorCommand in
    total, and for a stream, the longest silence (Pongs count, so a request that waits in a
    long queue is fine while the daemon answers pings).
    """

    def __init__(
        self,
        endpoint: str | None = None,
        seat: str = "default",
        timeout_s: float = 30.0,
        curve_server_key: str | bytes | None = None,
        curve_keys: tuple[str | bytes, str | bytes] | None = None,
        *,
        client_name: str = "",
        context: zmq.Context | None = None,
    ):
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self.endpoint = endpoint or default_endpoint()
        self.seat = seat
        self.timeout_s = float(timeout_s)
        self._hello_frame = _check(m.Hello(seat=seat, client=client_name), DEFAULT_MAX_FRAME_BYTES)
        self._curve = (curve_server_key, curve_keys)
        self._ctx = context or zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._welcome: m.Welcome | None = None
        self._streams: dict[str, Stream] = {}
        self._replies: dict[type, deque] = {m.StatusReply: deque(), m.GovernorReply: deque()}
        self._control_errors: deque[m.Error] = deque()
        self._ping_waiters: dict[int, float | None] = {}
        self.stray: deque[Any] = deque(maxlen=64)  # messages no caller was waiting for
        self._nonce = itertools.count(1)
        self._last_sent = 0.0
        self._last_heard = 0.0
        self._closed = False
        self._open()

    # -------------------------------------------------------------- connection
    def _open(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        try:
            _setup_socket(sock, self.timeout_s, *self._curve)
            sock.connect(self.endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise ValueError(f"cannot connect to {self.endpoint!r}: {exc}") from None
        self._sock = sock
        # A dropped connection (the daemon exited or restarted) fails what waits at once:
        # a restarted daemon would answer our pings but know nothing of our requests.
        self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._welcome = None
        self._send_frame(self._hello_frame)

    def _reset(self, exc: BaseException) -> None:
        """Drop the socket (and whatever it had queued) and fail every pending request."""
        if self._sock is not None:
            _close_socket(self._sock, self._monitor, 0)
            self._sock = self._monitor = None
        self._welcome = None
        for stream in list(self._streams.values()):
            stream._queue.append(exc)
        self._streams.clear()
        for q in self._replies.values():
            q.clear()
        self._control_errors.clear()
        self._ping_waiters.clear()

    def _unavailable_error(self, reason: str) -> DaemonUnavailable:
        return DaemonUnavailable(
            self.endpoint,
            f"councild at {self.endpoint} is unavailable: {reason} (timeout {self.timeout_s:g} s); "
            "is the daemon running? (`councild service status`)",
        )

    def _unavailable(self, reason: str) -> None:
        exc = self._unavailable_error(reason)
        self._reset(exc)
        raise exc

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Client is closed")
        if self._sock is None:
            self._open()

    @property
    def welcome(self) -> m.Welcome:
        """The daemon's Welcome (seat, server, model, capabilities, limits); waits for it."""
        return self._ensure_welcome()

    @property
    def limits(self) -> m.Limits:
        return self._ensure_welcome().limits

    def _ensure_welcome(self) -> m.Welcome:
        self._check_open()
        if self._welcome is None:
            self._pump_until(lambda: self._welcome is not None, deadline=time.monotonic() + self.timeout_s, what="Welcome")
        assert self._welcome is not None
        return self._welcome

    def _heartbeat_interval(self) -> float:
        if self._welcome is not None:
            return self._welcome.limits.heartbeat_interval_s
        return min(DEFAULT_HEARTBEAT_INTERVAL_S, self.timeout_s)

    # -------------------------------------------------------------- sending
    def _send_frame(self, frame: bytes) -> None:
        assert self._sock is not None
        try:
            self._sock.send(frame)
        except zmq.Again:
            self._unavailable("could not queue a message for the daemon")
        self._last_sent = time.monotonic()

    def _send(self, msg: Any) -> None:
        self._check_open()
        # The daemon forgets the seat of a connection it has not heard from for a while:
        # say Hello again first (in order, so the request lands in the right seat).
        if self._welcome is not None and time.monotonic() - self._last_sent >= self._heartbeat_interval():
            self._send_frame(self._hello_frame)
        self._send_frame(encode(msg))

    # -------------------------------------------------------------- receiving
    def _pump_until(self, ready: Callable[[], bool], deadline: float | None = None, what: str = "a reply") -> None:
        """Receive and route messages until ``ready()``; ping while waiting; never unbounded."""
        start = time.monotonic()
        while not ready():
            if self._sock is None:  # pragma: no cover - every pending wait was failed by the reset
                raise self._unavailable_error("the connection was reset")
            now = time.monotonic()
            silent = now - max(self._last_heard, start)
            if silent >= self.timeout_s:
                self._unavailable(f"nothing heard for {silent:.1f} s while waiting for {what}")
            if deadline is not None and now >= deadline:
                self._unavailable(f"no reply to {what} within {self.timeout_s:g} s")
            interval = self._heartbeat_interval()
            if now - self._last_sent >= interval:
                self._send_frame(encode(m.Ping(nonce=next(self._nonce))))
                now = time.monotonic()
            wait = min(interval - (now - self._last_sent), self.timeout_s - silent)
            if deadline is not None:
                wait = min(wait, deadline - now)
            events = dict(self._poller.poll(max(1, int(wait * 1000) + 1)))
            if self._sock in events:
                self._drain()
            if self._monitor in events and self._connection_lost():
                self._drain()  # what arrived before the drop still counts
                exc = self._unavailable_error(_LOST)
                self._reset(exc)
                if not ready():
                    raise exc

    def _connection_lost(self) -> bool:
        lost = False
        while True:
            try:
                lost |= _disconnected(self._monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return lost

    def _drain(self) -> None:
        assert self._sock is not None
        while True:
            try:
                frame = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._last_heard = time.monotonic()
            self._route(decode_daemon(frame, MAX_DAEMON_FRAME_BYTES))

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
            stream._queue.append(msg)
            if isinstance(msg, m.TERMINAL_TYPES):
                del self._streams[msg.request_id]
        elif isinstance(msg, m.Pong):
            if msg.nonce in self._ping_waiters:
                self._ping_waiters[msg.nonce] = time.monotonic()
        elif isinstance(msg, m.Welcome):
            self._welcome = msg
        elif isinstance(msg, (m.StatusReply, m.GovernorReply)):
            self._replies[type(msg)].append(msg)
        elif isinstance(msg, m.Error):
            self._control_errors.append(msg)
            self.stray.append(msg)

    # -------------------------------------------------------------- public calls
    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: Iterable[m.ChatMessage | Mapping[str, str]] | None = None,
        prompt_tokens: Iterable[int] | None = None,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: Iterable[str] | str | None = None,
        priority: str | None = None,
        deadline_ms: int | None = None,
        speculation: str | None = None,
        request_id: str | None = None,
        stream: bool = True,
        chat_template_kwargs: Mapping[str, str | bool | int | float] | None = None,
        **options: Any,
    ) -> Stream:
        """Send a Generate and return its Stream (nothing is read until you iterate).
        Arguments are validated here with the daemon's own decoder: a bad one raises
        InvalidRequest before anything is sent. ``messages`` items may be ChatMessage or
        ``{"role": ..., "content": ...}`` dicts. Further keyword arguments are the sampling
        options of SAMPLING_OPTIONS (min_p, penalties, logit_bias, logprobs, top_logprobs)."""
        welcome = self._ensure_welcome()
        msg, frame = _build_generate(
            prompt, messages, prompt_tokens, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            seed=seed, stop=stop, priority=priority, deadline_ms=deadline_ms, speculation=speculation,
            request_id=request_id, stream=stream, limits=welcome.limits, chat_template_kwargs=chat_template_kwargs,
            options=options,
        )
        if msg.request_id in self._streams:
            raise InvalidRequest("duplicate_request", "this id is already in flight on this client", request_id=msg.request_id)
        s = Stream(self, msg)
        self._streams[msg.request_id] = s
        if time.monotonic() - self._last_sent >= self._heartbeat_interval():
            self._send_frame(self._hello_frame)
        self._send_frame(frame)
        return s

    def complete(self, prompt: str | None = None, **kwargs: Any) -> m.Done:
        """Generate without streaming (``stream=False``) and return the Done; ``.text`` holds
        the whole completion. Takes the same arguments as ``generate``."""
        kwargs.setdefault("stream", False)
        return self.generate(prompt, **kwargs).result()

    def _call(self, msg: Any, reply_type: type) -> Any:
        self._check_open()
        q = self._replies[reply_type]
        q.clear()
        self._control_errors.clear()
        self._send(msg)
        self._pump_until(lambda: bool(q or self._control_errors), deadline=time.monotonic() + self.timeout_s,
                         what=msg.__struct_config__.tag)
        if q:
            return q.popleft()
        raise error_from_wire(self._control_errors.popleft())

    def status(self) -> m.StatusReply:
        return self._call(m.Status(), m.StatusReply)

    def governor(self, action: str, depth: int | None = None) -> m.GovernorReply:
        """Operator override: ``pin_depth`` (with ``depth``), ``evict_head``, ``load_head``, ``auto``."""
        msg = m.GovernorCommand(action=action, depth=depth)
        _check(msg, DEFAULT_MAX_FRAME_BYTES)
        return self._call(msg, m.GovernorReply)

    def ping(self) -> float:
        """Round-trip time to the daemon in seconds."""
        self._check_open()
        nonce = next(self._nonce)
        self._ping_waiters[nonce] = None
        t0 = time.monotonic()
        try:
            self._send(m.Ping(nonce=nonce))
            self._pump_until(lambda: self._ping_waiters.get(nonce) is not None, deadline=t0 + self.timeout_s, what="ping")
            return self._ping_waiters[nonce] - t0  # type: ignore[operator]
        finally:
            self._ping_waiters.pop(nonce, None)

    def close(self) -> None:
        """Cancel requests still in flight (so the daemon stops spending on them) and close
        the socket with a short linger."""
        if self._closed:
            return
        self._closed = True
        if self._sock is not None:
            for rid in list(self._streams):
                try:
                    self._sock.send(encode(m.Cancel(request_id=rid)), zmq.NOBLOCK)
                except zmq.ZMQError:
                    break
            _close_socket(self._sock, self._monitor, SOCKET_LINGER_MS)
            self._sock = self._monitor = None
        exc = RequestAborted("client_gone", "the Client was closed before the request finished")
        for stream in self._streams.values():
            stream._queue.append(exc)
        self._streams.clear()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        sock = getattr(self, "_sock", None)
        if sock is not None and not sock.closed:
            _close_socket(sock, getattr(self, "_monitor", None), 0)


# ---------------------------------------------------------------------------- async client


class AsyncStream(_StreamState):
    """One request on an AsyncClient. ``async for chunk in stream`` (sends the Generate on
    first use), or ``stream = await client.generate(...)`` to send it now. Afterwards
    ``.done``, ``.accepted``, ``.text``, ``.token_ids`` as on Stream."""

    def __init__(self, client: "AsyncClient", request: m.Generate, frame: bytes):
        super().__init__(request)
        self._client = client
        self._frame = frame
        self._queue: asyncio.Queue = asyncio.Queue()
        self._started = False

    async def start(self) -> "AsyncStream":
        """Send the Generate (once); raises what sending raised, and so does every later use."""
        if not self._started:
            self._started = True
            try:
                await self._client._start(self)
            except asyncio.CancelledError:
                if self.request_id not in self._client._streams:
                    self._started = False  # never sent: may be started again
                raise
            except BaseException as exc:
                if self.error is None:
                    self.error = exc
                raise
        elif self.error is not None and self._queue.empty():
            raise self.error
        return self

    def __await__(self):
        return self.start().__await__()

    def __aiter__(self) -> "AsyncStream":
        return self

    async def __anext__(self) -> str:
        await self.start()
        while True:
            if self.done is not None:
                raise StopAsyncIteration
            if self.error is not None and self._queue.empty():
                raise self.error
            chunk = self._apply(await self._queue.get())
            if self.done is not None:
                raise StopAsyncIteration
            if chunk:
                return chunk

    async def next_message(self) -> m.Accepted | m.Tokens | m.Done | None:
        """The next message of this request as it arrived (Accepted, Tokens, then Done), or
        None after the Done; a terminal Error raises. For callers that need more than the
        text (token ids, logprobs, the Accepted's prompt size). Do not mix with iteration."""
        await self.start()
        if self.done is not None:
            return None
        if self.error is not None and self._queue.empty():
            raise self.error
        msg = await self._queue.get()
        self._apply(msg)
        return msg

    async def result(self) -> m.Done:
        async for _ in self:
            pass
        assert self.done is not None
        return self.done

    async def cancel(self) -> None:
        """Send Cancel; the stream then ends with Done(finish_reason="cancelled")."""
        if not self._started or self.cancel_requested or self.request_id not in self._client._streams:
            return
        self.cancel_requested = True
        await self._client._send(m.Cancel(request_id=self.request_id))

    async def aclose(self) -> None:
        await self.cancel()
        self._client._streams.pop(self.request_id, None)

    async def __aenter__(self) -> "AsyncStream":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        if not self.finished:
            await self.aclose()


class AsyncClient:
    """The asyncio client (zmq.asyncio). One background reader task routes every incoming
    message to its request's queue or its caller's future; one heartbeat task pings every
    ``heartbeat_interval_s`` while anything is outstanding and fails everything with
    DaemonUnavailable after ``timeout_s`` of silence. Use from one event loop."""

    def __init__(
        self,
        endpoint: str | None = None,
        seat: str = "default",
        timeout_s: float = 30.0,
        curve_server_key: str | bytes | None = None,
        curve_keys: tuple[str | bytes, str | bytes] | None = None,
        *,
        client_name: str = "",
        context: zmq.asyncio.Context | None = None,
    ):
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self.endpoint = endpoint or default_endpoint()
        self.seat = seat
        self.timeout_s = float(timeout_s)
        self._hello_frame = _check(m.Hello(seat=seat, client=client_name), DEFAULT_MAX_FRAME_BYTES)
        self._curve = (curve_server_key, curve_keys)
        self._ctx = context
        self._sock: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._welcome: m.Welcome | None = None
        self._welcome_fut: asyncio.Future | None = None
        self._streams: dict[str, AsyncStream] = {}
        self._control: deque[tuple[type, asyncio.Future]] = deque()
        self._ping_waiters: dict[int, asyncio.Future] = {}
        self.stray: deque[Any] = deque(maxlen=64)
        self._nonce = itertools.count(1)
        self._last_sent = 0.0
        self._last_heard = 0.0
        self._busy_since: float | None = None
        self._closed = False

    # -------------------------------------------------------------- connection
    async def __aenter__(self) -> "AsyncClient":
        await self.connect()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def connect(self) -> m.Welcome:
        """Connect (if not yet), say Hello and wait for the Welcome."""
        return await self._ensure_welcome()

    @property
    def welcome(self) -> m.Welcome | None:
        """The Welcome, once ``connect()`` (or any call) has received it."""
        return self._welcome

    def _open(self) -> None:
        if self._closed:
            raise RuntimeError("this AsyncClient is closed")
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context.shadow(zmq.Context.instance())
        sock = self._ctx.socket(zmq.DEALER)
        try:
            _setup_socket(sock, self.timeout_s, *self._curve)
            sock.connect(self.endpoint)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise ValueError(f"cannot connect to {self.endpoint!r}: {exc}") from None
        self._sock = sock
        self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._welcome = None
        loop = asyncio.get_running_loop()
        self._welcome_fut = loop.create_future()
        self._control.append((m.Welcome, self._welcome_fut))
        self._tasks = [
            loop.create_task(self._read_loop(sock)),
            loop.create_task(self._heartbeat_loop(sock)),
            loop.create_task(self._monitor_loop(sock, self._monitor)),
        ]

    async def _ensure_welcome(self) -> m.Welcome:
        if self._sock is None:
            self._open()
            self._busy_since = time.monotonic()
            await self._send_frame(self._hello_frame)
        if self._welcome is not None:
            return self._welcome
        assert self._welcome_fut is not None
        return await asyncio.shield(self._welcome_fut)

    def _heartbeat_interval(self) -> float:
        if self._welcome is not None:
            return self._welcome.limits.heartbeat_interval_s
        return min(DEFAULT_HEARTBEAT_INTERVAL_S, self.timeout_s)

    def _outstanding(self) -> bool:
        return bool(self._streams or self._control or self._ping_waiters)

    def _mark_busy(self) -> None:
        if not self._outstanding():
            self._busy_since = time.monotonic()

    def _fail(self, exc: BaseException) -> None:
        """Close the socket and hand ``exc`` to everything that waits; the next call reconnects."""
        sock, self._sock = self._sock, None
        monitor, self._monitor = self._monitor, None
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()
        self._tasks = []
        if sock is not None:
            _close_socket(sock, monitor, 0)
        self._welcome = None
        for stream in self._streams.values():
            stream._queue.put_nowait(exc)
        self._streams.clear()
        for _, fut in self._control:
            if not fut.done():
                fut.set_exception(exc)
        self._control.clear()
        for fut in self._ping_waiters.values():
            if not fut.done():
                fut.set_exception(exc)
        self._ping_waiters.clear()

    def _unavailable(self, reason: str) -> DaemonUnavailable:
        exc = DaemonUnavailable(
            self.endpoint,
            f"councild at {self.endpoint} is unavailable: {reason} (timeout {self.timeout_s:g} s); "
            "is the daemon running? (`councild service status`)",
        )
        self._fail(exc)
        return exc

    async def _monitor_loop(self, sock: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket) -> None:
        """Fail what waits as soon as the connection drops (a restarted daemon would answer
        pings but know nothing of our requests)."""
        while True:
            try:
                frames = await monitor.recv_multipart()
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            if not _disconnected(frames) or self._sock is not sock:
                continue
            raw = zmq.Socket.shadow(sock.underlying)  # what arrived before the drop still counts
            while True:
                try:
                    frame = raw.recv(zmq.NOBLOCK)
                except zmq.ZMQError:
                    break
                try:
                    self._route(decode_daemon(frame, MAX_DAEMON_FRAME_BYTES))
                except ProtocolError as exc:
                    self.stray.append(exc)
            self._unavailable(_LOST)
            return

    # -------------------------------------------------------------- background tasks
    async def _read_loop(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            try:
                frame = await sock.recv()
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            self._last_heard = time.monotonic()
            try:
                msg = decode_daemon(frame, MAX_DAEMON_FRAME_BYTES)
            except ProtocolError as exc:
                # A daemon speaking another version answers Hello with frames we cannot read.
                if self._welcome_fut is not None and not self._welcome_fut.done():
                    self._welcome_fut.set_exception(InvalidRequest(exc.code, f"the daemon's reply: {exc.message}"))
                self.stray.append(exc)
                continue
            self._route(msg)

    def _take_control(self, reply_type: type | None) -> asyncio.Future | None:
        """The oldest caller waiting for ``reply_type`` (any caller when None)."""
        for entry in list(self._control):
            rtype, fut = entry
            if fut.done():  # its caller gave up
                self._control.remove(entry)
            elif reply_type is None or rtype is reply_type:
                self._control.remove(entry)
                return fut
        return None

    def _route(self, msg: Any) -> None:
        if isinstance(msg, _REQUEST_REPLIES) and msg.request_id is not None:
            if isinstance(msg, m.Error) and msg.code == "not_found":
                self.stray.append(msg)
                return
            stream = self._streams.get(msg.request_id)
            if stream is None:
                self.stray.append(msg)
                return
            stream._queue.put_nowait(msg)
            if isinstance(msg, m.TERMINAL_TYPES):
                del self._streams[msg.request_id]
        elif isinstance(msg, m.Pong):
            fut = self._ping_waiters.pop(msg.nonce, None)
            if fut is not None and not fut.done():
                fut.set_result(time.monotonic())
        elif isinstance(msg, m.Welcome):
            self._welcome = msg
            fut = self._take_control(m.Welcome)
            if fut is not None:
                fut.set_result(msg)
        elif isinstance(msg, (m.StatusReply, m.GovernorReply)):
            fut = self._take_control(type(msg))
            if fut is not None:
                fut.set_result(msg)
            else:
                self.stray.append(msg)
        elif isinstance(msg, m.Error):
            self.stray.append(msg)
            fut = self._take_control(None)
            if fut is not None:
                fut.set_exception(error_from_wire(msg))

    async def _heartbeat_loop(self, sock: zmq.asyncio.Socket) -> None:
        try:
            while self._sock is sock:
                interval = self._heartbeat_interval()
                await asyncio.sleep(max(0.005, min(interval, self.timeout_s) / 4))
                if self._sock is not sock:
                    return
                now = time.monotonic()
                if not self._outstanding():
                    self._busy_since = None
                    continue
                ref = max(self._last_heard, self._busy_since or now)
                if now - ref >= self.timeout_s:
                    self._unavailable(f"nothing heard for {now - ref:.1f} s")
                    return
                if now - self._last_sent >= interval:
                    await self._send_frame(encode(m.Ping(nonce=next(self._nonce))))
        except asyncio.CancelledError:
            return
        except DaemonUnavailable:
            return

    # -------------------------------------------------------------- sending
    async def _send_frame(self, frame: bytes) -> None:
        sock = self._sock
        if sock is None:
            raise self._unavailable("the connection was reset")
        try:
            await asyncio.wait_for(sock.send(frame), self.timeout_s)
        except (asyncio.TimeoutError, zmq.Again):
            raise self._unavailable("could not queue a message for the daemon") from None
        self._last_sent = time.monotonic()

    async def _send(self, msg: Any) -> None:
        if self._sock is None:
            await self._ensure_welcome()
        if self._welcome is not None and time.monotonic() - self._last_sent >= self._heartbeat_interval():
            await self._send_frame(self._hello_frame)  # the daemon may have forgotten our seat
        await self._send_frame(encode(msg))

    # -------------------------------------------------------------- public calls
    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: Iterable[m.ChatMessage | Mapping[str, str]] | None = None,
        prompt_tokens: Iterable[int] | None = None,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: Iterable[str] | str | None = None,
        priority: str | None = None,
        deadline_ms: int | None = None,
        speculation: str | None = None,
        request_id: str | None = None,
        stream: bool = True,
        chat_template_kwargs: Mapping[str, str | bool | int | float] | None = None,
        **options: Any,
    ) -> AsyncStream:
        """Validate now (InvalidRequest before anything is sent) and return the AsyncStream;
        the Generate goes out when the stream is first iterated or awaited."""
        if self._closed:
            raise RuntimeError("this AsyncClient is closed")
        msg, frame = _build_generate(
            prompt, messages, prompt_tokens, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            seed=seed, stop=stop, priority=priority, deadline_ms=deadline_ms, speculation=speculation,
            request_id=request_id, stream=stream, limits=self._welcome.limits if self._welcome else None,
            chat_template_kwargs=chat_template_kwargs,
            options=options,
        )
        return AsyncStream(self, msg, frame)

    async def _start(self, stream: AsyncStream) -> None:
        welcome = await self._ensure_welcome()
        if stream.request.max_tokens > welcome.limits.max_tokens:
            raise InvalidRequest("invalid_request", f"max_tokens {stream.request.max_tokens} exceeds this daemon's "
                                 f"limit of {welcome.limits.max_tokens}", request_id=stream.request_id)
        if len(stream._frame) > welcome.limits.max_frame_bytes:
            raise InvalidRequest(
                "frame_too_large", f"frame of {len(stream._frame)} bytes exceeds the limit of {welcome.limits.max_frame_bytes}",
                request_id=stream.request_id)
        if stream.request_id in self._streams:
            raise InvalidRequest("duplicate_request", "this id is already in flight on this client",
                                 request_id=stream.request_id)
        self._mark_busy()
        self._streams[stream.request_id] = stream
        await self._send_frame(stream._frame)

    async def complete(self, prompt: str | None = None, **kwargs: Any) -> m.Done:
        """Generate without streaming and return the Done (same arguments as ``generate``)."""
        kwargs.setdefault("stream", False)
        return await self.generate(prompt, **kwargs).result()

    async def _call(self, msg: Any, reply_type: type) -> Any:
        await self._ensure_welcome()
        fut = asyncio.get_running_loop().create_future()
        self._mark_busy()
        self._control.append((reply_type, fut))
        try:
            await self._send(msg)
            return await asyncio.wait_for(asyncio.shield(fut), self.timeout_s)
        except asyncio.TimeoutError:
            raise self._unavailable(f"no reply to {msg.__struct_config__.tag} within {self.timeout_s:g} s") from None
        finally:
            try:
                self._control.remove((reply_type, fut))
            except ValueError:
                pass

    async def status(self) -> m.StatusReply:
        return await self._call(m.Status(), m.StatusReply)

    async def governor(self, action: str, depth: int | None = None) -> m.GovernorReply:
        msg = m.GovernorCommand(action=action, depth=depth)
        _check(msg, DEFAULT_MAX_FRAME_BYTES)
        return await self._call(msg, m.GovernorReply)

    async def ping(self) -> float:
        """Round-trip time to the daemon in seconds."""
        await self._ensure_welcome()
        nonce = next(self._nonce)
        fut = asyncio.get_running_loop().create_future()
        self._mark_busy()
        self._ping_waiters[nonce] = fut
        t0 = time.monotonic()
        try:
            await self._send(m.Ping(nonce=nonce))
            return await asyncio.wait_for(asyncio.shield(fut), self.timeout_s) - t0
        except asyncio.TimeoutError:
            raise self._unavailable(f"no Pong within {self.timeout_s:g} s") from None
        finally:
            self._ping_waiters.pop(nonce, None)

    async def close(self) -> None:
        """Cancel requests in flight, stop the background tasks, close the socket (short linger)."""
        if self._closed:
            return
        self._closed = True
        sock = self._sock
        if sock is not None:
            for rid in list(self._streams):
                try:
                    await sock.send(encode(m.Cancel(request_id=rid)), zmq.NOBLOCK)
                except zmq.ZMQError:
                    break
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except BaseException:
                pass
        self._tasks = []
        self._sock = None
        monitor, self._monitor = self._monitor, None
        if sock is not None:
            _close_socket(sock, monitor, SOCKET_LINGER_MS)
        exc = RequestAborted("client_gone", "the AsyncClient was closed before the request finished")
        for stream in self._streams.values():
            stream._queue.put_nowait(exc)
        self._streams.clear()
        for _, fut in self._control:
            if not fut.done():
                fut.set_exception(exc)
        self._control.clear()
