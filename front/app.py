"""The ASGI app: OpenAI-compatible routes, /health and /metrics, over councild's ZeroMQ protocol.

One AsyncClient per seat (a connection's seat is fixed by its Hello), created on first use,
all on uvicorn's one event loop. A request's life:
1. the seat: from the API key (``http.api_keys``), or without keys from X-Councild-Seat;
2. the body is validated (schema.py): a bad or unsupported option is a 400 naming it;
3. the Generate goes out, and the front waits for its first reply (Accepted, or the Error
   that becomes 400 / 429 with Retry-After / 503), so admission errors keep their HTTP status;
4. tokens stream as SSE (or the Done becomes one JSON body). A client that disconnects at
   any point gets its request cancelled at the daemon (Cancel; the daemon ends it with one
   terminal message as for any client).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
from contextlib import asynccontextmanager, suppress

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from protocol import messages as m
from protocol.client import AsyncClient, CouncilError

from .anthropic_api import AnthropicAPI
from .body import ClientGone, read_json
from .config import HttpConfig
from .daemon_link import DaemonLink, DaemonUnreachable
from .errors import HTTPError, from_council, from_unreachable, shaped_response
from .metrics import FrontMetrics
from .responses_api import ResponsesAPI
from .schema import BadRequest, Parsed, ResponseShape, finish_reason, parse_request

SEAT_RE = re.compile(r"^[A-Za-z0-9._\-]{1,64}$")
# /v1/models waits at most this long for the daemon's Welcome; /metrics waits longer for its
# status (a scrape has its own timeout, typically 10 s, and a loaded machine answers slowly).
# /health waits http.daemon_probe_timeout_s (front/daemon_link.py).
STATUS_TIMEOUT_S = 3.0
METRICS_STATUS_TIMEOUT_S = 8.0
# Distinct seats (daemon connections) one front keeps; the daemon keeps at most 256 seats too.
MAX_SEATS = 256
# The metrics' route label of each generating path (an unexpected failure is counted there too).
ROUTE_LABEL = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/messages": "messages",
               "/v1/responses": "responses"}
log = logging.getLogger("councild.http")

def sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


class _Disconnected(Exception):
    pass


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, aw):
    """Await ``aw``; raise _Disconnected (having cancelled it) if the client goes first."""
    task = asyncio.ensure_future(aw)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with suppress(BaseException):
        await task
    raise _Disconnected()


class Front:
    def __init__(self, cfg: HttpConfig, endpoint: str | None):
        self.cfg = cfg
        self.endpoint = endpoint
        self.clients: dict[str, AsyncClient] = {}
        # Reachability and the last status (front/daemon_link.py): /health and every request read it.
        self.link = DaemonLink(cfg, endpoint, cfg.default_seat)
        self._background: set[asyncio.Task] = set()
        self.metrics = FrontMetrics(self)
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                *AnthropicAPI(self).routes(),
                *ResponsesAPI(self).routes(),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.metrics_route, methods=["GET"]),
            ],
            lifespan=self._lifespan,
            exception_handlers={HTTPException: self._http_exception, Exception: self._unexpected},
        )

    @asynccontextmanager
    async def _lifespan(self, app):
        self.link.start()
        yield
        await self.close()

    # ------------------------------------------------------------------ daemon side
    def client(self, seat: str) -> AsyncClient:
        c = self.clients.get(seat)
        if c is None and len(self.clients) >= MAX_SEATS:
            # Keyless seats come from a header: bound the connections they can open.
            raise HTTPError(429, f"{MAX_SEATS} seats are connected through this front; reuse one", param="X-Councild-Seat",
                            code="too_many_seats", retry_after=60.0)
        if c is None:
            c = self.clients[seat] = AsyncClient(self.endpoint, seat=seat, timeout_s=self.cfg.daemon_timeout_s,
                                                 client_name="councild-http")
        return c

    async def connected_client(self, seat: str) -> tuple[AsyncClient, m.Welcome]:
        """The seat's client and the daemon's Welcome to it. An unreachable daemon raises
        DaemonUnreachable at once, not after daemon_timeout_s."""
        client = self.client(seat)
        await self.link.admit()
        welcome = await self.link.guard(client.connect())
        return client, welcome

    async def status(self, max_age: float | None = None, timeout: float | None = None) -> m.StatusReply | None:
        """The daemon's StatusReply, at most ``max_age`` (default status_ttl_s) old; None when
        it does not answer within ``timeout`` (the link's state says why)."""
        return await self.link.status(max_age, timeout)

    @property
    def _status(self) -> m.StatusReply | None:
        return self.link.last_status

    async def model_name(self, seat: str) -> str:
        if self.cfg.model_name:
            return self.cfg.model_name
        welcome = await self.client(seat).connect()
        return welcome.model

    async def close(self) -> None:
        await self.link.close()
        for c in list(self.clients.values()):
            with suppress(Exception):
                await c.close()
        self.clients.clear()

    # ------------------------------------------------------------------ who is asking
    def seat_for(self, request: Request) -> str:
        header = request.headers.get("x-councild-seat")
        if self.cfg.api_keys:
            auth = request.headers.get("authorization", "")
            key = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
            key = key or request.headers.get("x-api-key", "").strip()  # how Anthropic's clients send it
            seat = None
            for known, known_seat in self.cfg.api_keys.items():  # compare every key in constant time
                if hmac.compare_digest(known.encode(), key.encode()):
                    seat = known_seat
            if seat is None:
                raise HTTPError(401, "a valid API key is required (Authorization: Bearer <key>, or x-api-key)",
                                code="invalid_api_key")
            if header is not None and header != seat:
                raise HTTPError(403, f"this API key speaks as seat {seat!r}; X-Councild-Seat may not name another",
                                param="X-Councild-Seat", code="seat_not_allowed")
            return seat
        if header is None:
            return self.cfg.default_seat
        if not SEAT_RE.match(header):
            raise HTTPError(400, "X-Councild-Seat must be 1-64 characters of A-Z a-z 0-9 . _ -", param="X-Councild-Seat")
        return header

    async def json_body(self, request: Request):
        """The request's body, parsed within http.max_body_bytes and the nesting and Unicode
        rules of front/body.py; HTTPError (400, 413) otherwise, ClientGone when the client left."""
        return await read_json(request, self.cfg.max_body_bytes)

    # ------------------------------------------------------------------ errors no route caught
    async def _http_exception(self, request: Request, exc: HTTPException) -> Response:
        """Starlette's own errors (no such route, a method the route does not take) in the
        route's API shape, not plain text."""
        err = HTTPError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None)
        response = shaped_response(request.url.path, err)
        response.headers.update(exc.headers or {})  # a 405's Allow
        return response

    async def _unexpected(self, request: Request, exc: Exception) -> Response:
        """A fault of the front's own that a route did not catch: still a JSON error in the
        route's shape (Starlette logs the traceback after this answer goes out)."""
        label = ROUTE_LABEL.get(request.url.path)
        if label is not None:
            self.metrics.request(label, "-", 500, "internal")
        log.error("http.unexpected_error path=%s error=%s", request.url.path, type(exc).__name__)
        err = HTTPError(500, f"the front failed on this request ({type(exc).__name__}); it is logged", code="internal")
        return shaped_response(request.url.path, err)

    # ------------------------------------------------------------------ routes
    async def chat(self, request: Request) -> Response:
        return await self._complete(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, chat=False)

    async def _complete(self, request: Request, chat: bool) -> Response:
        route = "chat" if chat else "completions"
        received = time.monotonic()
        seat = "-"
        try:
            seat = self.seat_for(request)
            body = await self.json_body(request)
            try:
                parsed = parse_request(body, chat, self.cfg.default_max_tokens)
            except BadRequest as exc:
                raise HTTPError(400, exc.message, exc.param, exc.code) from None
            client, welcome = await self.connected_client(seat)
            if "max_tokens" not in body and "max_completion_tokens" not in body:
                parsed.generate["max_tokens"] = min(parsed.generate["max_tokens"], welcome.limits.max_tokens)
            model = self.cfg.model_name or welcome.model
            stream, reply = await self.start_generation(request, client, parsed.generate, parsed.stream, route, seat)
            if reply is None:
                return Response(status_code=499)
            shape = ResponseShape(parsed, stream.request_id, model)
            if parsed.stream:
                return StreamingResponse(self._sse(stream, shape, parsed, route, seat, received), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            self.metrics.request(route, seat, 200, reply.finish_reason)
            return JSONResponse(shape.full(reply))
        except HTTPError as exc:
            self.metrics.request(route, seat, exc.status, exc.code or "error")
            return exc.response()
        except ClientGone:
            self.metrics.request(route, seat, 499, "disconnected")
            return Response(status_code=499)
        except DaemonUnreachable as exc:
            err = from_unreachable(exc)
            self.metrics.request(route, seat, err.status, err.code)
            return err.response()
        except CouncilError as exc:
            err = from_council(exc)
            if exc.code == "overloaded":
                st = await self.status()
                if st is not None and st.detail.get("state") == "loading":  # not ready, not busy
                    err = HTTPError(503, exc.message, code="model_loading", retry_after=exc.retry_after_s or 2.0)
            self.metrics.request(route, seat, err.status, exc.code)
            return err.response()

    async def start_generation(self, request: Request, client: AsyncClient, gen: dict, stream_it: bool, route: str,
                               seat: str):
        """Send the Generate and await its first reply (Accepted; a daemon Error raises here, so
        admission errors keep their HTTP status) or, not streaming, its Done, while watching the
        client. Returns (the stream, that reply); the reply is None when the client went away
        first (the work cancelled, its 499 counted). Every generating route starts here: chat,
        completions, Anthropic's messages and the Responses API."""
        stream = client.generate(**gen, stream=stream_it)
        try:
            try:
                reply = await until_disconnect(request, self.link.guard(stream.next_message()))
            except DaemonUnreachable:
                self._cancel_later(stream)  # a daemon that was only slow must not run it unread
                raise
            if not stream_it and not isinstance(reply, m.Done):
                reply = await until_disconnect(request, stream.result())
        except _Disconnected:
            await stream.cancel()
            self.metrics.request(route, seat, 499, "disconnected")
            return stream, None
        return stream, reply

    def _cancel_later(self, stream) -> None:
        """Send the stream's Cancel in the background: to a daemon that is gone, the send
        could wait for the connection's timeout, and the 503 must not."""
        task = asyncio.ensure_future(stream.aclose())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _sse(self, stream, shape: ResponseShape, parsed: Parsed, route: str, seat: str, received: float):
        ended = False
        first_token = True
        last = None
        try:
            if parsed.chat:
                yield sse(shape.chunk("", None, first=True))
            while True:
                msg = await stream.next_message()
                if isinstance(msg, m.Tokens):
                    if msg.text or msg.logprobs or msg.reasoning or msg.tool_calls:
                        now = time.monotonic()
                        if first_token:
                            self.metrics.ttft.observe(now - received)
                            first_token = False
                        elif last is not None:
                            self.metrics.chunk_gap.observe(now - last)
                        last = now
                        yield sse(shape.chunk(msg.text, msg.logprobs, reasoning=msg.reasoning, tool_calls=msg.tool_calls))
                elif isinstance(msg, m.Done):
                    ended = True
                    yield sse(shape.chunk(None if parsed.chat else "", None, finish=finish_reason(msg)))
                    if parsed.include_usage:
                        yield sse(shape.usage_chunk(msg))
                    yield "data: [DONE]\n\n"
                    self.metrics.request(route, seat, 200, msg.finish_reason)
                    return
                elif msg is None:
                    ended = True
                    return
        except CouncilError as exc:
            # Headers are gone: the error travels in the stream, as OpenAI's API sends it.
            ended = True
            err = from_council(exc)
            self.metrics.request(route, seat, err.status, exc.code)
            yield sse(err.body())
        except Exception as exc:  # a fault of the front's own: the work stopped, still one error event
            ended = True
            self.metrics.request(route, seat, 500, "internal")
            log.exception("http.unexpected_error path=%s error=%s (mid-stream)", route, type(exc).__name__)
            with anyio.CancelScope(shield=True):
                with suppress(Exception):
                    await stream.cancel()
            yield sse(HTTPError(500, f"the front failed mid-stream ({type(exc).__name__}); it is logged",
                                code="internal").body())
        finally:
            if not ended:  # the client went away (or the response was torn down): stop the work
                self.metrics.request(route, seat, 499, "disconnected")
                with anyio.CancelScope(shield=True):
                    with suppress(Exception):
                        await stream.cancel()

    async def models(self, request: Request) -> Response:
        try:
            seat = self.seat_for(request)
            await self.link.admit()
            name = await asyncio.wait_for(self.model_name(seat), STATUS_TIMEOUT_S)
        except HTTPError as exc:
            return exc.response()
        except DaemonUnreachable as exc:
            return from_unreachable(exc).response()
        except (CouncilError, asyncio.TimeoutError) as exc:
            return HTTPError(503, f"councild is not answering: {getattr(exc, 'message', exc)}",
                             code="daemon_unavailable", retry_after=2.0).response()
        st = self._status
        created = int(st.detail.get("time", {}).get("started_at_unix", 0)) if st else 0
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                                         "owned_by": "councild"}]})

    async def health(self, request: Request) -> Response:
        # An unreachable daemon is the probe's verdict: say so now rather than wait out one
        # more status read (the probe keeps trying every daemon_probe_interval_s).
        st = None if self.link.unreachable else await self.status()
        if st is None:
            # No answer within daemon_probe_timeout_s: not loading (a loading daemon answers
            # Status), not draining; killed, not started, or hung.
            return JSONResponse({"status": "unreachable", "reason": self.link.reason,
                                 "since_s": round(time.monotonic() - self.link.since, 2)}, status_code=503,
                                headers={"Retry-After": "2"})
        if st.detail.get("state") == "loading":  # bound, still reading the model's weights
            progress = (st.detail.get("load_progress") or {}).get("percent")
            return JSONResponse({"status": "loading", "model": st.model, "percent": progress}, status_code=503,
                                headers={"Retry-After": "2"})
        if st.detail.get("draining"):
            return JSONResponse({"status": "draining", "model": st.model}, status_code=503, headers={"Retry-After": "5"})
        return JSONResponse({"status": "ready", "model": st.model, "active": st.active, "queued": st.queued,
                             "depth": st.detail.get("depth"), "head_resident": st.detail.get("head_resident"),
                             # Start-up checks still to run between requests (serving already).
                             "warming": (st.detail.get("warming") or {}).get("pending", [])})

    async def metrics_route(self, request: Request) -> Response:
        st = await self.status(max_age=0.0, timeout=METRICS_STATUS_TIMEOUT_S)
        body, content_type = self.metrics.render(st)
        return Response(body, media_type=content_type)


def build_app(cfg: HttpConfig, endpoint: str | None) -> Starlette:
    return Front(cfg, endpoint).app
