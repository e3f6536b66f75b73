"""The socket loop: a ROUTER socket, validation, admission, and routing replies back.

It never blocks on the model: every poll has a timeout, requests go to the engine thread
through a queue, replies come back over an inproc socket. Every bad frame becomes a typed
Error; no exception from one client's input reaches the loop itself. Signals are turned
into flags the loop reads, so there is exactly one shutdown path.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import zmq

import daemon
from protocol import PROTOCOL_VERSION, ProtocolError, decode_client
from protocol import messages as m
from protocol.codec import peek_request_id

from .client_delivery import ClientDelivery
from ..engine_thread.commands import CancelAll, CancelJob, GovernorOverride, ReloadGovernor, ReloadScheduler, Stop, Submit
from ..config import Config
from .endpoint import EndpointGuard, StartupError
from ..exits import EXIT_CONFIG, EXIT_OK, EXIT_SOFTWARE
from ..logs import get_logger
from ..request_text.requests import Job
from .status_reply import StatusReplies
from ..engine_thread.worker import OUT_ENDPOINT, EngineWorker

# What SIGHUP applies to a running daemon; any other key that changed needs a restart.
LIVE_ON_RELOAD = frozenset({"scheduler", "governor", "heartbeat_timeout_s", "drain_deadline_s", "stats_interval_s"})
# Tables in the daemon's file that belong to other processes (`councild http` reads [http]).
NOT_THE_DAEMONS = frozenset({"http"})

log = get_logger("councild.server")

# Each progress step of a model load extends systemd's start timeout this far past now.
LOAD_EXTEND_S = 120.0
# A load's progress goes to systemd at most this often (besides its 0% and 100%): a small
# model's twenty steps came within ~6 ms, two datagrams each, past the 10 a socket queues.
LOAD_NOTE_EVERY_S = 0.5


class _Hooks:
    """Engine-thread callbacks (sd_notify watchdog follows real decode progress)."""

    def __init__(self, server: "Server"):
        self.server = server

    def on_step(self) -> None:
        self.server.notifier_progress()

    def on_load_progress(self, percent: int) -> None:
        self.server.load_progress(percent)


class Server(ClientDelivery, StatusReplies):
    """The socket loop. Reading clients, admission and the loop's housekeeping are here;
    sending replies without blocking (grace, held terminals, cutting slow consumers) is
    client_delivery.py's, building the status reply status_reply.py's."""

    def __init__(self, cfg: Config, model_path: str, endpoint: str, cli_overrides: dict | None = None,
                 group=None, exit_when_ready: bool = False, prebuild=None):
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
        self._init_delivery(cfg)  # the send queues' grace, held terminals, cut clients
        self._router: zmq.Socket | None = None
        self.draining_since: float | None = None
        # True from the serving loop's first turn: Status says "serving" only once a Generate
        # read next is accepted (the engine's snapshot turns ready a moment before the loading
        # loop lets go, and a "serving" answer followed by "still loading" was seen).
        self.accepting = False
        self._load_noted_at = 0.0  # when the load's progress last went to systemd (load_progress)
        self.stop_now = False
        self.reload_requested = False
        # `councild prepare`: the start-up's checks were the point; drain (nothing in flight) once ready.
        self.exit_when_ready = exit_when_ready
        self.endpoint_guard = EndpointGuard(cfg, endpoint, self.ctx)
        self.notifier = None
        self._watchdog = None
        if group is None:
            self.worker = EngineWorker(cfg, self.ctx, model_path, hooks=_Hooks(self), prebuild=prebuild)
        else:  # rank 0 of a tensor-parallel group (daemon/distributed/)
            from ..distributed.lockstep import LeaderWorker

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
        if self.exit_when_ready:
            log.info("daemon.prepared", model=self.model_path, seconds=round(time.monotonic() - self.started, 1))
            self.draining_since = time.monotonic()
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(engine_out, zmq.POLLIN)
        last_housekeeping = 0.0
        stop_sent = False
        self.accepting = True
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
        """Steps of the weights read (engine thread) push systemd's start timeout LOAD_EXTEND_S
        past now, with the progress as STATUS, in one datagram at most every LOAD_NOTE_EVERY_S
        (and at 0% and 100%): a big model may take longer than TimeoutStartSec, while a load
        that stops making progress is still killed LOAD_EXTEND_S later."""
        if self.notifier is None:
            return
        now = time.monotonic()
        if percent not in (0, 100) and now - self._load_noted_at < LOAD_NOTE_EVERY_S:
            return
        self._load_noted_at = now
        self.notifier.extend_timeout(LOAD_EXTEND_S, status=f"loading {Path(self.model_path).name}: {percent}%")

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


    def _reload(self) -> None:
        from ..config import ConfigError, load_config

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


