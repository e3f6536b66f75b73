"""What the front knows about the daemon behind it: reachable or not, and its last status.

A probe task asks the daemon for its Status every ``daemon_probe_interval_s``, with a bound
of ``daemon_probe_timeout_s`` on each answer. One unanswered probe makes the link
*unreachable* (the daemon was killed, is not started, or hangs); the next answer makes it
reachable again. While it is unreachable a request waits at most ``unreachable_hold_s`` for
it to come back and then gets 503 + Retry-After at once, instead of waiting out the
connection's liveness timeout (30 s) for a Welcome that no daemon will send.

The state is one of "reachable" or "unreachable" (before the first probe has ended:
"unknown", treated as reachable so that a request at start-up is not refused for lack of a
probe). /health reads ``status()``: a daemon that answers says loading / draining / ready
itself; one that does not is "unreachable", never "loading".
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import suppress

from protocol import messages as m
from protocol.client import AsyncClient, CouncilError

from .config import HttpConfig

log = logging.getLogger("councild.http")

# The Retry-After a request refused for an unreachable daemon carries: a restarted daemon
# answers Status within a couple of seconds of binding, and clients should not hammer.
UNREACHABLE_RETRY_AFTER_S = 2.0
# While the daemon is loading (or has not answered yet) the probe asks this often, and a
# "loading" answer is never served from the cache: /health says "ready" within this of the
# daemon's READY=1 instead of up to daemon_probe_interval_s + status_ttl_s later (issue 46:
# the two mean the same moment). A loading daemon answers Status from its socket loop, so
# the cost is a status read every 50 ms for as long as a load takes.
STARTING_PROBE_S = 0.05


class DaemonUnreachable(Exception):
    """The daemon has not answered a probe for ``down_s`` seconds (``reason`` says how)."""

    def __init__(self, reason: str, down_s: float):
        super().__init__(reason)
        self.reason, self.down_s = reason, down_s
        self.retry_after = UNREACHABLE_RETRY_AFTER_S

    @property
    def message(self) -> str:
        return (f"councild is unreachable ({self.reason}; for {self.down_s:.1f} s); retry after "
                f"{self.retry_after:g} s")


class DaemonLink:
    def __init__(self, cfg: HttpConfig, endpoint: str | None, seat: str):
        self.cfg, self.endpoint, self.seat = cfg, endpoint, seat
        self.state = "unknown"
        self.reason: str | None = None
        self.since = time.monotonic()
        self.last_status: m.StatusReply | None = None
        self.last_status_at = 0.0
        self._client: AsyncClient | None = None
        self._lock = asyncio.Lock()
        self._changed = asyncio.Event()  # set (and replaced) at every state change
        self._task: asyncio.Task | None = None

    # ------------------------------------------------------------------ the probe
    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._probe_loop())

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with suppress(BaseException):
                await task
        client, self._client = self._client, None
        if client is not None:
            with suppress(Exception):
                await client.close()

    async def _probe_loop(self) -> None:
        while True:
            started = time.monotonic()
            await self.status(max_age=0.0)
            interval = self.cfg.daemon_probe_interval_s
            if self.starting:
                interval = min(interval, STARTING_PROBE_S)
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))

    async def status(self, max_age: float | None = None, timeout: float | None = None) -> m.StatusReply | None:
        """The daemon's StatusReply at most ``max_age`` (default status_ttl_s) old, or None
        when it did not answer within ``timeout`` (default daemon_probe_timeout_s); every
        read updates the reachability state."""
        max_age = self.cfg.status_ttl_s if max_age is None else max_age
        timeout = self.cfg.daemon_probe_timeout_s if timeout is None else timeout
        async with self._lock:
            if (self.last_status is not None and not self.loading
                    and time.monotonic() - self.last_status_at <= max_age):
                return self.last_status
            if self._client is None:
                # wait_for bounds each read; the connection's own timeout only backs it up.
                self._client = AsyncClient(self.endpoint, seat=self.seat, timeout_s=max(10.0, timeout),
                                           client_name="councild-http-status")
            try:
                reply = await asyncio.wait_for(self._client.status(), timeout)
            except (CouncilError, asyncio.TimeoutError) as exc:
                self.last_status = None
                client, self._client = self._client, None  # a fresh connection next time
                with suppress(Exception):
                    await client.close()
                self._set("unreachable", getattr(exc, "message", None) or f"no status reply within {timeout:g} s")
                return None
            self.last_status, self.last_status_at = reply, time.monotonic()
            self._set("reachable", None)
            self._wake()  # a loading daemon may have become ready: held requests look again
            return reply

    def _set(self, state: str, reason: str | None) -> None:
        if state == self.state:
            self.reason = reason or self.reason
            return
        now = time.monotonic()
        if state == "unreachable":
            log.warning("http.daemon_unreachable endpoint=%s reason=%r", self.endpoint or "default", reason)
        elif self.state == "unreachable":
            log.info("http.daemon_reachable endpoint=%s down_s=%.2f", self.endpoint or "default", now - self.since)
        self.state, self.reason, self.since = state, reason, now
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # ------------------------------------------------------------------ for requests
    @property
    def unreachable(self) -> bool:
        return self.state == "unreachable"

    @property
    def loading(self) -> bool:
        st = self.last_status
        return self.state == "reachable" and st is not None and st.detail.get("state") == "loading"

    @property
    def starting(self) -> bool:
        """Not heard from yet, or loading: the daemon may turn ready any moment."""
        return self.state == "unknown" or self.loading

    def error(self) -> DaemonUnreachable:
        return DaemonUnreachable(self.reason or "no answer", time.monotonic() - self.since)

    async def admit(self) -> None:
        """Return when the daemon is reachable and not loading; raise DaemonUnreachable once
        it has stayed unreachable for unreachable_hold_s more. A daemon still loading past
        the hold is let through: it answers the request itself (503 model_loading)."""
        deadline = time.monotonic() + self.cfg.unreachable_hold_s
        while self.unreachable or self.loading:
            left = deadline - time.monotonic()
            if left <= 0:
                if self.unreachable:
                    raise self.error()
                return
            with suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)

    async def guard(self, aw):
        """Await ``aw`` (a wait on the daemon: a Welcome, a request's first reply), but give
        up with DaemonUnreachable (having cancelled it) when the link goes unreachable
        meanwhile and stays so past unreachable_hold_s. Without this a request sent just
        before the daemon died would wait out the connection's liveness timeout."""
        task = asyncio.ensure_future(aw)
        try:
            while True:
                if self.unreachable:
                    watcher = asyncio.ensure_future(self.admit())
                else:
                    watcher = asyncio.ensure_future(self._changed.wait())
                try:
                    await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    if not watcher.done():
                        watcher.cancel()
                        with suppress(BaseException):
                            await watcher
                if task.done():
                    return task.result()
                if watcher.exception() is not None:  # admit() gave up: unreachable past the hold
                    raise watcher.exception()
        finally:
            if not task.done():
                task.cancel()
                with suppress(BaseException):
                    await task


# ---------------------------------------------------------------------- error shapes
# The body of an error in each API this front speaks. OpenAI's: {"error": {"message",
# "type", "param", "code"}} (front/app.py's HTTPError builds it). Anthropic's Messages API:
# {"type": "error", "error": {"type", "message"}}, with its own type names per status.
ANTHROPIC_ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                        404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error",
                        500: "api_error", 503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPE.get(status, "api_error"), "message": message}}
