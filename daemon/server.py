"""The socket loop: a ROUTER socket, validation, admission, and routing replies back.

It never blocks on the model: every poll has a timeout, requests go to the engine thread
through a queue, replies come back over an inproc socket. Every bad frame becomes a typed
Error; no exception from one client's input reaches the loop itself. Signals are turned
into flags the loop reads, so there is exactly one shutdown path.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time
from collections import deque
from pathlib import Path

import zmq

import daemon
from protocol import PROTOCOL_VERSION, ProtocolError, decode_client, encode
from protocol import messages as m
from protocol.codec import peek_request_id

from .config import Config
from .endpoint import EndpointGuard, StartupError
from .exits import EXIT_CONFIG, EXIT_OK, EXIT_SOFTWARE
from .logs import get_logger, lines_dropped
from .requests import Job
from .stats import Tallies
from .worker import (OUT_ENDPOINT, CancelAll, CancelJob, EngineWorker, GovernorOverride, ReloadGovernor,
                     ReloadScheduler, Stop, Submit)

# What SIGHUP applies to a running daemon; any other key that changed needs a restart.
LIVE_ON_RELOAD = frozenset({"scheduler", "governor", "heartbeat_timeout_s", "drain_deadline_s", "stats_interval_s"})
# Tables in the daemon's file that belong to other processes (`councild http` reads [http]).
NOT_THE_DAEMONS = frozenset({"http"})

log = get_logger("councild.server")

# Each progress step of a model load extends systemd's start timeout this far past now.
LOAD_EXTEND_S = 120.0
# A full queue is logged (client.backlog) once it has stayed full this long: a client that
# reads, only slower than the engine writes, fills and empties its queue many times a second,
# and that is not news.
BACKLOG_LOG_AFTER_S = 1.0
# During a slow consumer's grace (slow_consumer_grace_s) its messages wait in the daemon, at
# most this many (or client_send_hwm, if larger) per connection: room for seconds of four
# streams' chunks, and a bound on what a client that never reads again can cost (~1 MB).
GRACE_BACKLOG_MIN = 4096


class _Hooks:
    """Engine-thread callbacks (sd_notify watchdog follows real decode progress)."""

    def __init__(self, server: "Server"):
        self.server = server

    def on_step(self) -> None:
        self.server.notifier_progress()

    def on_load_progress(self, percent: int) -> None:
        self.server.load_progress(percent)


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(timespec="milliseconds")


class Server:
    def __init__(self, cfg: Config, model_path: str, endpoint: str, cli_overrides: dict | None = None,
                 group=None):
        self.cfg = cfg
        # Flags given at start-up win over the file on every SIGHUP reload too.
        self.cli_overrides = cli_overrides or {}
        self.endpoint = endpoint
        self.model_path = model_path
        self.ctx = zmq.Context()
        self.started = time.monotonic()
        self.started_wall = time.time()
        # Requests refused before reaching the engine: (seat, error code) -> count.
        self.rejected: dict[tuple[str, str], int] = {}
        self._stats_logged_at = time.monotonic()
        self.seats: dict[bytes, str] = {}
        self.last_seen: dict[bytes, float] = {}
        self.live: dict[tuple[str, str], bytes] = {}  # request key -> client identity
        self._cut: set[tuple[str, str]] = set()  # live requests already cancelled by _drop_client
        self._held: dict[bytes, deque[bytes]] = {}  # terminal messages a full queue refused, to retry
        # Connections cut as slow consumers: until every terminal owed to them has gone out,
        # their new Generates are refused (slow_consumer), never accepted.
        self._slow: set[bytes] = set()
        # Rejections past the per-connection hold bound, answered by one summary Error later.
        self._discarded: dict[bytes, int] = {}
        self._held_cap = 16 * cfg.client_send_hwm
        # A connection whose send queue is full, inside its grace: the messages it has not
        # taken yet, in order (payload, request key or None, terminal, rejection), and since when.
        self._backlog: dict[bytes, deque[tuple[bytes, tuple[str, str] | None, bool, bool]]] = {}
        # (when the queue filled, when the client last took a message): the grace runs from the latter.
        self._backlog_since: dict[bytes, tuple[float, float]] = {}
        self._backlog_logged: set[bytes] = set()  # episodes long enough to be logged
        self._backlog_cap = max(GRACE_BACKLOG_MIN, cfg.client_send_hwm)
        self._router: zmq.Socket | None = None
        self.draining_since: float | None = None
        self.stop_now = False
        self.reload_requested = False
        self.endpoint_guard = EndpointGuard(cfg, endpoint, self.ctx)
        self.notifier = None
        self._watchdog = None
        if group is None:
            self.worker = EngineWorker(cfg, self.ctx, model_path, hooks=_Hooks(self))
        else:  # rank 0 of a tensor-parallel group (daemon/distributed/)
            from .distributed.lockstep import LeaderWorker

            self.worker = LeaderWorker(cfg, self.ctx, model_path, hooks=_Hooks(self), group=group)

    # ------------------------------------------------------------------ signals
    def _install_signals(self) -> None:
        def term(signum, _frame):
            # The first TERM/INT drains; a second one exits at once.
            if self.draining_since is not None:
                self.stop_now = True
            else:
                self.draining_since = time.monotonic()

        def hup(_signum, _frame):
            self.reload_requested = True

        signal.signal(signal.SIGTERM, term)
        signal.signal(signal.SIGINT, term)
        signal.signal(signal.SIGHUP, hup)

    def notifier_progress(self) -> None:
        if self._watchdog is not None:
            self._watchdog.progress()

    # ------------------------------------------------------------------ main loop
    def run(self, config_path: str | None = None) -> int:
        self.config_path = config_path
        self.endpoint_guard.secure_tcp()
        self.endpoint_guard.claim()
        engine_out = self.ctx.socket(zmq.PULL)
        engine_out.bind(OUT_ENDPOINT)
        # Handlers first: a SIGHUP or SIGTERM while the model loads (minutes for a big one)
        # must set a flag, not kill the process with the signal's default action.
        self._install_signals()
        self._make_notifier()
        # Bind before the load: a malformed endpoint or a TCP port in use is an answer the
        # operator should get in a second, not after minutes of loading a 15 GB model; and
        # meanwhile Status answers "loading" with the progress (_answer_while_loading).
        try:
            router = self._router = self.endpoint_guard.bind()
        except StartupError:
            engine_out.close(linger=0)
            raise
        self.worker.start()
        log.info("daemon.loading", model=self.model_path, endpoint=self.endpoint, pid=os.getpid())
        self.load_progress(0)
        # Answers Status and Hello meanwhile; returns False when a SIGTERM/SIGINT came during
        # the load (minutes for a big model, and a load cannot be interrupted): nothing is in
        # flight yet, so the process ends now. The caller leaves with os._exit, which takes
        # the loading thread with it.
        if not self._answer_while_loading(router):
            router.close(linger=0)
            engine_out.close(linger=0)
            if self.endpoint.startswith("ipc://"):
                Path(self.endpoint[len("ipc://"):]).unlink(missing_ok=True)
            log.info("daemon.stop", reason="signal", forced=False, during_load=True)
            return EXIT_OK
        if self.worker.load_error is not None:
            exc = self.worker.load_error
            code = EXIT_CONFIG if isinstance(exc, (FileNotFoundError, ValueError)) else EXIT_SOFTWARE
            router.close(linger=0)
            engine_out.close(linger=0)
            if self.endpoint.startswith("ipc://"):
                Path(self.endpoint[len("ipc://"):]).unlink(missing_ok=True)
            raise StartupError(f"model {self.model_path} failed to load: {exc}", code)
        self._start_notifier()
        log.info("daemon.start", endpoint=self.endpoint, model=self.model_path, pid=os.getpid(),
                 version=daemon.__version__, protocol=PROTOCOL_VERSION)
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(engine_out, zmq.POLLIN)
        last_housekeeping = 0.0
        stop_sent = False
        try:
            while not self.stop_now:
                events = dict(poller.poll(50))
                if router in events:
                    self._read_clients(router)
                if engine_out in events:
                    self._forward_replies(engine_out, router)
                now = time.monotonic()
                if now - last_housekeeping > 0.25:
                    last_housekeeping = now
                    self._housekeeping(now)
                if self.draining_since is not None:
                    if not stop_sent:
                        log.info("daemon.draining", in_flight=len(self.live), deadline_s=self.cfg.drain_deadline_s)
                        if self.notifier:
                            self.notifier.stopping()
                        self.worker.commands.put(Stop())
                        stop_sent = True
                    if now - self.draining_since > self.cfg.drain_deadline_s and self.live:
                        self.worker.commands.put(CancelAll("shutting_down", "the drain deadline passed"))
                        self.draining_since = now - self.cfg.drain_deadline_s + 5.0  # give it 5 s to flush
                    if not self.worker.is_alive():
                        self._forward_replies(engine_out, router)
                        break
                elif not self.worker.is_alive():
                    log.error("daemon.engine_died")
                    return EXIT_SOFTWARE
        finally:
            router.close(linger=0 if self.stop_now else 200)
            engine_out.close(linger=0)
            if self.endpoint.startswith("ipc://"):
                Path(self.endpoint[len("ipc://"):]).unlink(missing_ok=True)
            if self.stop_now and self.worker.is_alive():
                # A second signal: leave now. Terminating the context under the engine
                # thread mid-decode would crash it and report a failure instead of exit 0.
                log.info("daemon.stop", reason="signal", forced=True, in_flight=len(self.live))
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                except (OSError, ValueError):  # a full or closed log sink must not change the exit code
                    pass
                os._exit(EXIT_OK)
            self.ctx.term()
        log.info("daemon.stop", reason="signal", forced=self.stop_now)
        return EXIT_OK

    def _make_notifier(self) -> None:
        try:
            from .notify import Notifier
        except ImportError:  # the service integration is optional
            return
        self.notifier = Notifier()

    def load_progress(self, percent: int) -> None:
        """Each step of the weights read (engine thread) pushes systemd's start timeout
        LOAD_EXTEND_S past now: a big model may take longer than TimeoutStartSec, while a
        load that stops making progress is still killed LOAD_EXTEND_S later."""
        if self.notifier is not None:
            self.notifier.extend_timeout(LOAD_EXTEND_S)
            self.notifier.status(f"loading {Path(self.model_path).name}: {percent}%")

    def _answer_while_loading(self, router: zmq.Socket) -> bool:
        """Until the engine has loaded: Status answers with the load's progress, Hello with a
        Welcome; Generate is refused (``overloaded`` with a retry hint); Ping gets no Pong
        yet (a Pong means ready: launchers wait for it)."""
        while not self.worker.loaded.wait(0.05):
            if self.draining_since is not None:
                return False
            if not router.poll(200, zmq.POLLIN):
                continue
            for _ in range(256):
                try:
                    frames = router.recv_multipart(zmq.NOBLOCK, copy=True)
                except zmq.Again:
                    break
                if len(frames) != 2:
                    continue
                identity = frames[0]
                try:
                    msg = decode_client(frames[1], self.cfg.max_frame_bytes)
                except ProtocolError as exc:  # answered as when serving: one terminal each
                    rid = peek_request_id(frames[1]) if exc.code == "invalid_request" else None
                    self._reply(router, identity, m.Error(code=exc.code, message=exc.message, request_id=rid))
                    continue
                pct = self.worker.read_snapshot().load_progress.get("percent", 0)
                if isinstance(msg, m.Status):
                    self._reply(router, identity, self.status_reply())
                elif isinstance(msg, m.Hello):
                    self.seats[identity] = msg.seat
                    self._reply(router, identity, self._welcome(msg.seat))
                elif isinstance(msg, m.Generate):
                    self._reply(router, identity, m.Error(
                        code="overloaded", request_id=msg.request_id, retry_after_s=2.0,
                        message=f"the model is still loading ({pct}% of its weights read)"))
                elif isinstance(msg, m.GovernorCommand):
                    self._reply(router, identity, m.GovernorReply(ok=False, message="the model is still loading"))
        return True

    def _start_notifier(self) -> None:
        try:
            from .notify import Notifier, WatchdogPacer
        except ImportError:  # the service integration is optional
            return
        self.notifier = self.notifier or Notifier()
        self.notifier.ready()
        self.notifier.status(f"serving {Path(self.model_path).name} on {self.endpoint}")
        self._watchdog = WatchdogPacer(self.notifier)

    # ------------------------------------------------------------------ client input
    def _read_clients(self, router: zmq.Socket) -> None:
        for _ in range(256):  # bounded, so replies keep flowing under a flood
            try:
                frames = router.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            if len(frames) < 2:
                continue
            identity = frames[0]
            self.last_seen[identity] = time.monotonic()
            if len(frames) != 2:
                self._reply(router, identity, m.Error(code="bad_frame", message=f"expected one frame per message, got {len(frames) - 1}"))
                continue
            try:
                msg = decode_client(frames[1], self.cfg.max_frame_bytes)
            except ProtocolError as exc:
                rid = peek_request_id(frames[1]) if exc.code == "invalid_request" else None
                self._reply(router, identity, m.Error(code=exc.code, message=exc.message, request_id=rid))
                log.info("request.rejected", request_id=rid, seat=self.seats.get(identity, "default"),
                         code=exc.code, message=exc.message[:200])
                continue
            try:
                self._handle(router, identity, msg)
            except Exception as exc:  # a bug in handling one message must not end the daemon
                log.error("server.handler_failed", error=repr(exc), type=type(msg).__name__)
                self._reply(router, identity, m.Error(code="internal", message=f"{type(exc).__name__}: {exc}",
                                                       request_id=getattr(msg, "request_id", None)))

    def _handle(self, router: zmq.Socket, identity: bytes, msg) -> None:
        if isinstance(msg, m.Generate):
            self._generate(router, identity, msg)
        elif isinstance(msg, m.Cancel):
            key = (self.seats.get(identity, "default"), msg.request_id)
            if key in self.live:
                self.worker.commands.put(CancelJob(key))
            else:
                self._reply(router, identity, m.Error(code="not_found", request_id=msg.request_id,
                                                       message="no request with this id is in flight for this seat"))
        elif isinstance(msg, m.Ping):
            self._reply(router, identity, m.Pong(nonce=msg.nonce))
        elif isinstance(msg, m.Hello):
            self.seats[identity] = msg.seat
            self._reply(router, identity, self._welcome(msg.seat))
        elif isinstance(msg, m.Status):
            self._reply(router, identity, self.status_reply())
        elif isinstance(msg, m.GovernorCommand):
            if msg.action == "pin_depth" and msg.depth is None:
                self._reply(router, identity, m.GovernorReply(ok=False, message="pin_depth needs a depth"))
            else:
                self.worker.commands.put(GovernorOverride(identity, msg.action, msg.depth))

    def _welcome(self, seat: str) -> m.Welcome:
        c = self.cfg
        return m.Welcome(
            seat=seat,
            server=f"councild {daemon.__version__}",
            model=Path(self.model_path).name,
            capabilities=["stream", "cancel", "chat", "prompt_tokens", "stop", "deadline", "priority",
                          "chat_template_kwargs", "reasoning", "sampling_options", "logprobs", "tools",
                          "count_only", "constraint"],
            limits=m.Limits(max_frame_bytes=c.max_frame_bytes, max_tokens=c.max_tokens,
                            max_prompt_tokens=self.worker.max_prompt_tokens, heartbeat_interval_s=c.heartbeat_interval_s,
                            heartbeat_timeout_s=c.heartbeat_timeout_s),
        )

    def _generate(self, router: zmq.Socket, identity: bytes, msg: m.Generate) -> None:
        def reject(code: str, message: str, retry_after: float | None = None) -> None:
            self._reply(router, identity, m.Error(code=code, message=message, request_id=msg.request_id,
                                                   retry_after_s=retry_after))
            log.info("request.rejected", request_id=msg.request_id, seat=seat, code=code, message=message)
            self.rejected[(seat, code)] = self.rejected.get((seat, code), 0) + 1

        seat = self.seats.get(identity, "default")
        key = (seat, msg.request_id)
        if identity in self._slow:
            return reject("slow_consumer", "this connection stopped reading and was cut; read the replies queued "
                                           "for it before sending more work")
        if self.draining_since is not None:
            return reject("shutting_down", "the daemon is draining and accepts no new work")
        if msg.prompt_kind() is None:
            return reject("invalid_request", "give exactly one of prompt, messages, prompt_tokens")
        if msg.prompt == "" or msg.messages == [] or msg.prompt_tokens == []:
            return reject("invalid_request", "the prompt is empty")
        if msg.max_tokens > self.cfg.max_tokens:
            return reject("invalid_request", f"max_tokens {msg.max_tokens} exceeds this daemon's limit of {self.cfg.max_tokens}")
        if key in self.live:
            return reject("duplicate_request", f"request {msg.request_id!r} is already in flight for seat {seat!r}")
        # The governor's shedding, as the engine thread last published it (the socket thread
        # reads no engine object directly; the snapshot is refreshed between cycles).
        shedding, retry_after = self.worker.read_snapshot().shedding
        if shedding:
            return reject("overloaded", "memory pressure is critical; new work is refused until it eases",
                          retry_after=retry_after)
        sc = self.cfg.scheduler
        seat_live = sum(1 for k in self.live if k[0] == seat)
        if len(self.live) >= sc.max_queued or seat_live >= sc.max_queued_per_seat:
            return reject("overloaded", f"{len(self.live)} requests in flight ({seat_live} for seat {seat!r}); try again later",
                          retry_after=self._retry_after())
        seat_cfg = self.cfg.seat(seat)
        now = time.monotonic()
        job = Job(msg=msg, identity=identity, seat=seat, priority=msg.priority or seat_cfg.priority,
                  weight=seat_cfg.weight, deadline=now + msg.deadline_ms / 1000 if msg.deadline_ms else None,
                  received_at=now)
        self.live[key] = identity
        self.worker.commands.put(Submit(job))

    def _retry_after(self) -> float:
        rate = self.worker.read_snapshot().recent_tokens_per_s
        # Time for the queue ahead to drain at the recent rate, bounded to something useful.
        backlog_tokens = 64 * max(1, len(self.live))
        return round(min(30.0, max(0.5, backlog_tokens / rate if rate > 0 else 2.0)), 2)

    # ------------------------------------------------------------------ replies
    def _forward_replies(self, engine_out: zmq.Socket, router: zmq.Socket) -> None:
        for _ in range(1024):
            try:
                identity, payload, key, terminal = engine_out.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if not key:  # not a request's message (a GovernorReply)
                self._send(router, identity, payload)
                continue
            seat, rid = key.decode().split("\x00", 1)
            if terminal:
                self.live.pop((seat, rid), None)
                self._cut.discard((seat, rid))
                self._send(router, identity, payload, terminal=True, key=(seat, rid))
            elif (seat, rid) not in self._cut:
                self._send(router, identity, payload, key=(seat, rid))
            # else: a request already cut (slow consumer, client gone): its remaining chunks
            # are dropped on purpose, so a client that resumes reading sees no seq gap, just
            # the chunks it had, then the terminal Error.

    def _reply(self, router: zmq.Socket, identity: bytes, msg) -> None:
        # An Error with a request id (not_found aside) is that request's terminal: a
        # rejection, held like any terminal when the client's queue is full.
        terminal = isinstance(msg, m.Error) and msg.request_id is not None and msg.code != "not_found"
        self._send(router, identity, encode(msg), terminal=terminal, rejection=terminal)

    def _send(self, router: zmq.Socket, identity: bytes, payload: bytes, terminal: bool = False,
              rejection: bool = False, key: tuple[str, str] | None = None) -> None:
        """Send without ever blocking. A full queue (EAGAIN: the client is not reading)
        starts the client's grace: its messages wait in order (``_backlog``) for up to
        ``slow_consumer_grace_s``, so a client that pauses on a starved machine and reads
        again loses nothing. A queue still full past the grace (or a backlog past its cap)
        cuts the client's requests with slow_consumer rather than buffering without bound
        or blocking every other client; a terminal message that cannot go out then is held
        (``_held``) and retried, so no request loses its one terminal message. Replies that
        end no request (Pong, Welcome, StatusReply, GovernorReply, id-less Errors) are
        dropped when they do not fit after a cut."""
        if identity in self._backlog:  # inside the grace: behind what waits already
            self._backlog[identity].append((payload, key, terminal, rejection))
            self._flush_backlog(router, identity)
            return
        try:
            if identity in self._held and not self._flush_held(router, identity):
                raise zmq.Again()  # keep the order: held terminals first
            router.send_multipart([identity, payload], zmq.NOBLOCK)
        except zmq.Again:
            if self.cfg.slow_consumer_grace_s > 0 and identity not in self._slow and identity not in self._held:
                self._backlog[identity] = deque([(payload, key, terminal, rejection)])
                now = time.monotonic()
                self._backlog_since[identity] = (now, now)
                return
            if terminal:
                self._hold(identity, payload, rejection)
            self._drop_client(identity, "slow_consumer")
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:  # the connection is gone: nothing can be delivered
                self._forget_held(identity)
                self._drop_client(identity, "client_gone")
            else:
                raise
        else:
            if identity in self._slow:
                self._settle(identity)

    def _flush_backlog(self, router: zmq.Socket, identity: bytes) -> None:
        """Send what waits for a client inside its grace, in order. Emptied: the grace ends
        (client.backlog_cleared). Nothing taken for slow_consumer_grace_s (a client that
        takes some restarts the clock), or past the cap: the client is cut (_cut_backlog)."""
        backlog = self._backlog[identity]
        since, progress = self._backlog_since[identity]
        sent = 0
        while backlog:
            try:
                router.send_multipart([identity, backlog[0][0]], zmq.NOBLOCK)
            except zmq.Again:
                break
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                self._forget_held(identity)  # the connection is gone: nothing can be delivered
                self._drop_client(identity, "client_gone")
                return
            backlog.popleft()
            sent += 1
        now = time.monotonic()
        if sent:
            progress = now
            self._backlog_since[identity] = (since, progress)
        if not backlog:
            del self._backlog[identity], self._backlog_since[identity]
            if identity in self._backlog_logged:
                self._backlog_logged.discard(identity)
                log.info("client.backlog_cleared", seat=self.seats.get(identity, "default"), held_s=round(now - since, 3))
            return
        if identity not in self._backlog_logged and now - since >= BACKLOG_LOG_AFTER_S:
            self._backlog_logged.add(identity)
            log.info("client.backlog", seat=self.seats.get(identity, "default"), full_s=round(now - since, 3),
                     waiting=len(backlog), grace_s=self.cfg.slow_consumer_grace_s, send_hwm=self.cfg.client_send_hwm)
        if now - progress > self.cfg.slow_consumer_grace_s or len(backlog) > self._backlog_cap:
            self._cut_backlog(identity, now - since)

    def _cut_backlog(self, identity: bytes, held_s: float) -> None:
        """The grace is over: cut the client as a slow consumer. Of what waited, requests
        that have ended keep all their messages (their chunks then their terminal, held for
        delivery); those still running lose their waiting chunks (their slow_consumer
        Error follows what the client already has, with no seq gap); other replies go."""
        backlog = self._backlog.pop(identity)
        del self._backlog_since[identity]
        self._backlog_logged.discard(identity)
        ended = {key for _, key, terminal, _ in backlog if terminal and key is not None}
        kept = [(payload, rejection) for payload, key, terminal, rejection in backlog if terminal or key in ended]
        for payload, rejection in kept:
            self._hold(identity, payload, rejection)
        self._drop_client(identity, "slow_consumer", held_s=round(held_s, 3), waiting=len(backlog))

    def _hold(self, identity: bytes, payload: bytes, rejection: bool) -> None:
        """Keep a terminal for a client that is not reading. Terminals of accepted requests
        are always kept (a cut connection gets no new ones accepted, so they are at most
        its share of the queue); rejections are kept up to ``_held_cap`` per connection,
        and past it only counted: the client gets one summary Error for them instead."""
        held = self._held.setdefault(identity, deque())
        if rejection and len(held) >= self._held_cap:
            n = self._discarded.get(identity, 0) + 1
            self._discarded[identity] = n
            if n == 1:
                log.warning("client.terminal_lost", reason="too many undelivered rejections for a client that "
                            "is not reading; the excess is counted and reported to it", held=len(held))
            return
        held.append(payload)

    def _forget_held(self, identity: bytes) -> None:
        self._backlog_logged.discard(identity)
        self._backlog.pop(identity, None)
        self._backlog_since.pop(identity, None)
        self._held.pop(identity, None)
        self._discarded.pop(identity, None)
        self._slow.discard(identity)

    def _flush_held(self, router: zmq.Socket, identity: bytes) -> bool:
        """Send held terminal messages in order, then the summary of discarded rejections;
        True when nothing is left."""
        held = self._held.get(identity)
        while held:
            try:
                router.send_multipart([identity, held[0]], zmq.NOBLOCK)
            except zmq.Again:
                return False
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                log.warning("client.terminal_lost", reason="connection gone", undelivered=len(held))
                self._forget_held(identity)
                return True
            held.popleft()
            if not held:
                log.info("client.terminal_delivered", late=True)
        discarded = self._discarded.get(identity, 0)
        if discarded:
            summary = m.Error(code="slow_consumer", request_id=None,
                              message=f"{discarded} Generate requests sent while this connection was not reading "
                                      "got no reply of their own: none of them was accepted")
            try:
                router.send_multipart([identity, encode(summary)], zmq.NOBLOCK)
            except zmq.ZMQError:
                return False
            log.info("client.terminal_delivered", late=True, discarded=discarded)
            del self._discarded[identity]
        self._held.pop(identity, None)
        self._settle(identity)
        return True

    def _settle(self, identity: bytes) -> None:
        """A cut connection is whole again once every terminal owed to it has gone out."""
        if identity in self._held or identity in self._discarded:
            return
        if any(self.live.get(k) == identity for k in self._cut):
            return  # a cut request's terminal is still on its way from the engine
        self._slow.discard(identity)

    def _drop_client(self, identity: bytes, why: str, **grace) -> None:
        """End every request of a connection with ``why`` (``slow_consumer`` or
        ``client_gone``: the terminal Error's code). Each request is cancelled once: the
        chunks still on their way from the engine would otherwise repeat the cancel (and the
        log line) for every undeliverable message until the terminal one passes."""
        if why == "slow_consumer":
            self._slow.add(identity)
        keys = [k for k, ident in self.live.items() if ident == identity and k not in self._cut]
        if keys:
            log.warning("client.dropped", reason=why, requests=[k[1] for k in keys], seat=keys[0][0], **grace)
        for key in keys:
            self._cut.add(key)
            self.worker.commands.put(CancelJob(key, why))

    # ------------------------------------------------------------------ periodic
    def _housekeeping(self, now: float) -> None:
        timeout = self.cfg.heartbeat_timeout_s
        owners = set(self.live.values())
        for identity, seen in list(self.last_seen.items()):
            if now - seen > timeout:
                if identity in owners:
                    log.warning("client.timeout", seat=self.seats.get(identity, "default"), silent_s=round(now - seen, 1))
                    self._drop_client(identity, "client_gone")
                del self.last_seen[identity]
                self.seats.pop(identity, None)
                if identity in self._held or identity in self._discarded:  # gone for good: its held terminals too
                    log.warning("client.terminal_lost", reason="client silent past the heartbeat timeout",
                                undelivered=len(self._held.get(identity, ())))
                self._forget_held(identity)
        for identity in list(self._backlog):  # inside its grace: read again, or cut once it is over
            if identity in self._backlog:
                self._flush_backlog(self._router, identity)
        for identity in list(self._held):  # a slow consumer that reads again gets its terminals
            self._flush_held(self._router, identity)
        if self.reload_requested:
            self.reload_requested = False
            self._reload()
        interval = self.cfg.stats_interval_s
        if interval > 0 and now - self._stats_logged_at >= interval:
            self._stats_logged_at = now
            self._log_stats()

    def _log_stats(self) -> None:
        """The periodic ``stats`` event: what /metrics shows, for shops that only read logs."""
        d = self.status_reply().detail
        st = d["stats"]
        log.info("stats", active=len(d["active_requests"]), queued=sum(s.get("queued", 0) for s in d["seats"].values()),
                 in_flight=d["in_flight"], tokens_total=d["tokens_total"], tokens_per_s=d["recent_tokens_per_s"],
                 depth=d["depth"], head_resident=d["head_resident"], memory=d["memory"],
                 pressure=d["governor"].get("pressure"), requests=st["requests"], drafted=st["drafted"],
                 accepted=st["accepted"], ttft_count=st["ttft_seconds"]["count"],
                 ttft_mean_s=round(st["ttft_seconds"]["sum"] / max(1, st["ttft_seconds"]["count"]), 4),
                 clients=d["clients"])

    def _reload(self) -> None:
        from .config import ConfigError, load_config

        if self.notifier:
            self.notifier.reloading()
        try:
            new = load_config(self.config_path, self.cli_overrides)
        except ConfigError as exc:
            log.error("config.reload_rejected", error=str(exc), message="kept the running configuration")
            if self.notifier:
                self.notifier.ready()
            return
        # The settings in LIVE_ON_RELOAD apply now, each by its one path (the engine's take a
        # command on its queue); every other key that changed is named as needing a restart,
        # so no change is ever dropped in silence.
        changed = [k for k in new.__struct_fields__
                   if k not in NOT_THE_DAEMONS and getattr(new, k) != getattr(self.cfg, k)]
        if new.scheduler != self.cfg.scheduler:
            self.cfg.scheduler = new.scheduler
            self.worker.commands.put(ReloadScheduler(new.scheduler))
        if new.governor != self.cfg.governor:
            self.cfg.governor = new.governor
            self.worker.commands.put(ReloadGovernor(new.governor))
        self.cfg.heartbeat_timeout_s = new.heartbeat_timeout_s
        self.cfg.drain_deadline_s = new.drain_deadline_s
        self.cfg.stats_interval_s = new.stats_interval_s
        applied = [k for k in changed if k in LIVE_ON_RELOAD]
        needs_restart = [k for k in changed if k not in LIVE_ON_RELOAD]
        log.info("config.reloaded", path=self.config_path, applied=applied, needs_restart=needs_restart)
        if needs_restart:
            log.warning("config.needs_restart", keys=needs_restart,
                        message="these changed in the file but apply only at the next start: restart the daemon")
        if self.notifier:
            self.notifier.ready()

    def _stats(self, snap) -> dict:
        """The engine's tallies, with the requests this loop refused merged into the outcomes."""
        stats = dict(snap.stats) if snap.stats else Tallies().to_dict()
        requests = {seat: dict(v) for seat, v in stats.get("requests", {}).items()}
        for (seat, code), n in self.rejected.items():
            by = requests.setdefault(seat, {})
            by[code] = by.get(code, 0) + n
        stats["requests"] = requests
        return stats

    def status_reply(self) -> m.StatusReply:
        snap = self.worker.read_snapshot()
        now_wall = time.time()
        return m.StatusReply(
            server=f"councild {daemon.__version__}",
            model=snap.model or Path(self.model_path).name,
            uptime_s=round(time.monotonic() - self.started, 3),
            active=len(snap.active),
            queued=sum(snap.queued.values()),
            detail={
                "pid": os.getpid(),
                "endpoint": self.endpoint,
                "model_type": snap.model_type,
                "draining": self.draining_since is not None,
                "state": ("loading" if not snap.ready else "draining" if self.draining_since is not None
                          else "serving"),
                "load_progress": snap.load_progress,
                "head_resident": snap.head_resident,
                "head_bytes": snap.head_bytes,
                "exact_decode": snap.exact_decode,
                "kernels": {"name": snap.kernels, "reason": snap.kernels_reason},
                "decode_path": snap.decode_path,
                "depth": snap.depth,
                "in_flight": len(self.live),
                "active_requests": snap.active,
                "seats": snap.seats,
                "tokens_total": snap.tokens_total,
                "prefill_tokens_total": snap.prefill_tokens_total,
                # The engine step: budget, its use (decode and prefill tokens per iteration),
                # and the prefill queue (OPERATIONS.md, "The engine step").
                "step": snap.step,
                "warmup": snap.warmup,
                "prefix_cache": snap.prefix_cache,
                "recent_tokens_per_s": round(snap.recent_tokens_per_s, 2),
                # Heard from within heartbeat_timeout_s (a client that left counts until then:
                # a ROUTER socket is not told when a peer goes), and those with work in flight.
                "clients": len(self.last_seen),
                "clients_with_work": len(set(self.live.values())),
                "slow_clients": len(self._slow),
                "log_lines_dropped": lines_dropped(),
                "memory": snap.memory,
                "governor": snap.governor,
                **({"group": snap.group} if snap.group else {}),
                "stats": self._stats(snap),
                # Wall-clock times (UTC, ISO 8601 and Unix seconds), for logs and dashboards.
                "time": {
                    "now": _iso(now_wall), "now_unix": round(now_wall, 3),
                    "started_at": _iso(self.started_wall), "started_at_unix": round(self.started_wall, 3),
                },
            },
        )
