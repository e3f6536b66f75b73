"""The sync shell: ``Client`` and its ``Stream``. It only sends, polls and waits; what a
reply means is ClientCore's, when to ping and when to give up is Liveness's."""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable, Iterable, Mapping

import zmq

from .. import messages as m
from ..codec import encode
from .build import build_generate, check_frame
from .core import ClientCore, Reply
from .errors import RequestAborted
from .stream_state import StreamState
from .transport import LOST, SOCKET_LINGER_MS, close_socket, connect_dealer, disconnected, recv_nowait, send_cancels


class Stream(StreamState):
    """One request on a sync Client: iterate it for text chunks (str, in order; chunks whose
    text is empty are not handed out but their token ids are kept). Afterwards ``.done`` is
    the Done message, ``.accepted`` the Accepted, ``.text`` the full text, ``.token_ids`` the
    streamed ids. A terminal Error raises a CouncilError subclass from the iteration."""

    def __init__(self, client: "Client", request: m.Generate):
        super().__init__(request)
        self._client = client
        self._queue: deque = deque()

    def _deliver(self, item: Any) -> None:
        self._queue.append(item)

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


class Client(ClientCore):
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
        super().__init__(endpoint, seat, timeout_s, curve_server_key, curve_keys, client_name)
        self._ctx = context or zmq.Context.instance()
        self._open()

    # -------------------------------------------------------------- connection
    def _open(self) -> None:
        self._sock, self._monitor = connect_dealer(self._ctx, self.endpoint, self.timeout_s, *self._curve)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._welcome = None
        self._send_frame(self._hello_frame)

    def _reset(self, exc: BaseException) -> None:
        """Drop the socket (and whatever it had queued) and fail every pending request; the
        next call opens a fresh socket (Lazy Pirate)."""
        if self._sock is not None:
            close_socket(self._sock, self._monitor, 0)
            self._sock = self._monitor = None
        self._welcome = None
        self._fail_waiters(exc)

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

    # -------------------------------------------------------------- sending
    def _send_frame(self, frame: bytes) -> None:
        assert self._sock is not None
        try:
            self._sock.send(frame)
        except zmq.Again:
            self._unavailable("could not queue a message for the daemon")
        self._live.sent(time.monotonic())

    def _send_request(self, frame: bytes) -> None:
        if self._hello_due():
            self._send_frame(self._hello_frame)
        self._send_frame(frame)

    def _send(self, msg: Any) -> None:
        self._check_open()
        self._send_request(encode(msg))

    # -------------------------------------------------------------- receiving
    def _pump_until(self, ready: Callable[[], bool], deadline: float | None = None, what: str = "a reply") -> None:
        """Receive and route messages until ``ready()``; ping while waiting; never unbounded."""
        start = time.monotonic()
        while not ready():
            if self._sock is None:  # pragma: no cover - every pending wait was failed by the reset
                raise self._unavailable_error("the connection was reset")
            now = time.monotonic()
            silent = self._live.silence(now, start)
            if silent >= self.timeout_s:
                self._unavailable(f"nothing heard for {silent:.1f} s while waiting for {what}")
            if deadline is not None and now >= deadline:
                self._unavailable(f"no reply to {what} within {self.timeout_s:g} s")
            interval = self._heartbeat_interval()
            if self._live.quiet(now, interval):
                self._send_frame(self._ping_frame())
                now = time.monotonic()
            wait = self._live.poll_s(now, interval, silent, deadline)
            events = dict(self._poller.poll(max(1, int(wait * 1000) + 1)))
            if self._sock in events:
                self._drain()
            if self._monitor in events and self._connection_lost():
                self._drain()  # what arrived before the drop still counts
                exc = self._unavailable_error(LOST)
                self._reset(exc)
                if not ready():
                    raise exc

    def _connection_lost(self) -> bool:
        lost = False
        while True:
            try:
                lost |= disconnected(self._monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return lost

    def _drain(self) -> None:
        assert self._sock is not None
        for frame in recv_nowait(self._sock):
            self._receive(frame)

    def _wait_reply(self, waiter: Reply, deadline: float, what: str) -> Any:
        self._pump_until(waiter.done, deadline=deadline, what=what)
        return waiter.result()

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
        session: str | None = None,
        **options: Any,
    ) -> Stream:
        """Send a Generate and return its Stream (nothing is read until you iterate).
        Arguments are validated here with the daemon's own decoder: a bad one raises
        InvalidRequest before anything is sent. ``messages`` items may be ChatMessage or
        ``{"role": ..., "content": ...}`` dicts. Further keyword arguments are the sampling
        options of SAMPLING_OPTIONS (min_p, penalties, logit_bias, logprobs, top_logprobs)."""
        welcome = self._ensure_welcome()
        msg, frame = build_generate(
            prompt, messages, prompt_tokens, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            seed=seed, stop=stop, priority=priority, deadline_ms=deadline_ms, speculation=speculation,
            request_id=request_id, stream=stream, limits=welcome.limits, chat_template_kwargs=chat_template_kwargs,
            options=options, session=session,
        )
        s = Stream(self, msg)
        self._add_stream(s)
        self._send_request(frame)
        return s

    def complete(self, prompt: str | None = None, **kwargs: Any) -> m.Done:
        """Generate without streaming (``stream=False``) and return the Done; ``.text`` holds
        the whole completion. Takes the same arguments as ``generate``."""
        kwargs.setdefault("stream", False)
        return self.generate(prompt, **kwargs).result()

    def _call(self, msg: Any, reply_type: type) -> Any:
        self._check_open()
        waiter = Reply()
        self._expect(reply_type, waiter)
        try:
            self._send(msg)
            return self._wait_reply(waiter, time.monotonic() + self.timeout_s, msg.__struct_config__.tag)
        finally:
            self._forget(reply_type, waiter)

    def status(self) -> m.StatusReply:
        return self._call(m.Status(), m.StatusReply)

    def governor(self, action: str, depth: int | None = None) -> m.GovernorReply:
        """Operator override: ``pin_depth`` (with ``depth``), ``evict_head``, ``load_head``, ``auto``."""
        msg = m.GovernorCommand(action=action, depth=depth)
        check_frame(msg)
        return self._call(msg, m.GovernorReply)

    def ping(self) -> float:
        """Round-trip time to the daemon in seconds."""
        self._check_open()
        waiter = Reply()
        nonce = self._expect_pong(waiter)
        t0 = time.monotonic()
        try:
            self._send(m.Ping(nonce=nonce))
            return self._wait_reply(waiter, t0 + self.timeout_s, "ping") - t0
        finally:
            self._ping_waiters.pop(nonce, None)

    def close(self) -> None:
        """Cancel requests still in flight (so the daemon stops spending on them) and close
        the socket with a short linger."""
        if self._closed:
            return
        self._closed = True
        if self._sock is not None:
            send_cancels(self._sock, self._streams)
            close_socket(self._sock, self._monitor, SOCKET_LINGER_MS)
            self._sock = self._monitor = None
        self._fail_waiters(RequestAborted("client_gone", "the Client was closed before the request finished"))

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        sock = getattr(self, "_sock", None)
        if sock is not None and not sock.closed:
            close_socket(sock, getattr(self, "_monitor", None), 0)
