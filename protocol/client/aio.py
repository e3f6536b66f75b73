"""The asyncio shell: ``AsyncClient`` and its ``AsyncStream``. Three background tasks do the
I/O (read and route, heartbeat, watch for a dropped connection); what a reply means is
ClientCore's, when to ping and when to give up is Liveness's."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Iterable, Mapping

import zmq
import zmq.asyncio

from .. import messages as m
from ..codec import ProtocolError, encode
from .build import build_generate, check_frame, check_limits
from .core import ClientCore
from .errors import DaemonUnavailable, RequestAborted
from .stream_state import StreamState
from .transport import LOST, SOCKET_LINGER_MS, close_socket, connect_dealer, disconnected, recv_nowait, send_cancels


class AsyncStream(StreamState):
    """One request on an AsyncClient. ``async for chunk in stream`` (sends the Generate on
    first use), or ``stream = await client.generate(...)`` to send it now. Afterwards
    ``.done``, ``.accepted``, ``.text``, ``.token_ids`` as on Stream."""

    def __init__(self, client: "AsyncClient", request: m.Generate, frame: bytes):
        super().__init__(request)
        self._client = client
        self._frame = frame
        self._queue: asyncio.Queue = asyncio.Queue()
        self._started = False

    def _deliver(self, item: Any) -> None:
        self._queue.put_nowait(item)

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


class AsyncClient(ClientCore):
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
        super().__init__(endpoint, seat, timeout_s, curve_server_key, curve_keys, client_name)
        self._ctx = context
        self._tasks: list[asyncio.Task] = []
        self._welcome_fut: asyncio.Future | None = None

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
        sock, self._monitor = connect_dealer(self._ctx, self.endpoint, self.timeout_s, *self._curve)
        self._sock = sock
        self._welcome = None
        loop = asyncio.get_running_loop()
        self._welcome_fut = loop.create_future()
        self._expect(m.Welcome, self._welcome_fut)
        self._tasks = [
            loop.create_task(self._read_loop(sock)),
            loop.create_task(self._heartbeat_loop(sock)),
            loop.create_task(self._monitor_loop(sock, self._monitor)),
        ]

    async def _ensure_welcome(self) -> m.Welcome:
        if self._sock is None:
            self._open()
            await self._send_frame(self._hello_frame)
        if self._welcome is not None:
            return self._welcome
        assert self._welcome_fut is not None
        return await asyncio.shield(self._welcome_fut)

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
            close_socket(sock, monitor, 0)
        self._welcome = None
        self._fail_waiters(exc)

    def _unavailable(self, reason: str) -> DaemonUnavailable:
        exc = self._unavailable_error(reason)
        self._fail(exc)
        return exc

    # -------------------------------------------------------------- background tasks
    async def _read_loop(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            try:
                frame = await sock.recv()
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            try:
                self._receive(frame)
            except ProtocolError as exc:
                self._bad_frame(exc)

    async def _monitor_loop(self, sock: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket) -> None:
        """Fail what waits as soon as the connection drops (a restarted daemon would answer
        pings but know nothing of our requests)."""
        while True:
            try:
                frames = await monitor.recv_multipart()
            except (zmq.ZMQError, asyncio.CancelledError):
                return
            if not disconnected(frames) or self._sock is not sock:
                continue
            for frame in recv_nowait(sock):  # what arrived before the drop still counts
                try:
                    self._receive(frame)
                except ProtocolError as exc:
                    self.stray.append(exc)
            self._unavailable(LOST)
            return

    async def _heartbeat_loop(self, sock: zmq.asyncio.Socket) -> None:
        try:
            while self._sock is sock:
                interval = self._heartbeat_interval()
                await asyncio.sleep(self._live.tick_s(interval))
                if self._sock is not sock:
                    return
                now = time.monotonic()
                if not self._outstanding():
                    self._live.busy_since = None
                    continue
                silent = self._live.silence(now, self._live.busy_since or now)
                if silent >= self.timeout_s:
                    self._unavailable(f"nothing heard for {silent:.1f} s")
                    return
                if self._live.quiet(now, interval):
                    await self._send_frame(self._ping_frame())
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
        self._live.sent(time.monotonic())

    async def _send_request(self, frame: bytes) -> None:
        if self._hello_due():
            await self._send_frame(self._hello_frame)
        await self._send_frame(frame)

    async def _send(self, msg: Any) -> None:
        if self._sock is None:
            await self._ensure_welcome()
        await self._send_request(encode(msg))

    async def _wait_reply(self, waiter: asyncio.Future, what: str) -> Any:
        try:
            return await asyncio.wait_for(asyncio.shield(waiter), self.timeout_s)
        except asyncio.TimeoutError:
            raise self._unavailable(f"no {what} within {self.timeout_s:g} s") from None

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
    ) -> AsyncStream:
        """Validate now (InvalidRequest before anything is sent) and return the AsyncStream;
        the Generate goes out when the stream is first iterated or awaited."""
        if self._closed:
            raise RuntimeError("this AsyncClient is closed")
        msg, frame = build_generate(
            prompt, messages, prompt_tokens, max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            seed=seed, stop=stop, priority=priority, deadline_ms=deadline_ms, speculation=speculation,
            request_id=request_id, stream=stream, limits=self._welcome.limits if self._welcome else None,
            chat_template_kwargs=chat_template_kwargs,
            options=options, session=session,
        )
        return AsyncStream(self, msg, frame)

    async def _start(self, stream: AsyncStream) -> None:
        welcome = await self._ensure_welcome()
        check_limits(stream.request, stream._frame, welcome.limits)
        self._add_stream(stream)
        await self._send_request(stream._frame)

    async def complete(self, prompt: str | None = None, **kwargs: Any) -> m.Done:
        """Generate without streaming and return the Done (same arguments as ``generate``)."""
        kwargs.setdefault("stream", False)
        return await self.generate(prompt, **kwargs).result()

    async def _call(self, msg: Any, reply_type: type) -> Any:
        await self._ensure_welcome()
        fut = asyncio.get_running_loop().create_future()
        self._expect(reply_type, fut)
        try:
            await self._send(msg)
            return await self._wait_reply(fut, f"reply to {msg.__struct_config__.tag}")
        finally:
            self._forget(reply_type, fut)

    async def status(self) -> m.StatusReply:
        return await self._call(m.Status(), m.StatusReply)

    async def governor(self, action: str, depth: int | None = None) -> m.GovernorReply:
        msg = m.GovernorCommand(action=action, depth=depth)
        check_frame(msg)
        return await self._call(msg, m.GovernorReply)

    async def ping(self) -> float:
        """Round-trip time to the daemon in seconds."""
        await self._ensure_welcome()
        fut = asyncio.get_running_loop().create_future()
        nonce = self._expect_pong(fut)
        t0 = time.monotonic()
        try:
            await self._send(m.Ping(nonce=nonce))
            return await self._wait_reply(fut, "Pong") - t0
        finally:
            self._ping_waiters.pop(nonce, None)

    async def close(self) -> None:
        """Cancel requests in flight, stop the background tasks, close the socket (short linger)."""
        if self._closed:
            return
        self._closed = True
        sock = self._sock
        if sock is not None:
            send_cancels(sock, self._streams)
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
            close_socket(sock, monitor, SOCKET_LINGER_MS)
        self._fail_waiters(RequestAborted("client_gone", "the AsyncClient was closed before the request finished"))
