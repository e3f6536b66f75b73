"""The commands the socket loop sends the engine thread, and how the engine applies them.

The socket loop puts a command on ``EngineWorker.commands``; the intake thread (request_text/intake.py)
tokenizes each Submit and passes every command on, in order; the engine thread drains them
between two decode cycles (the only safe points) with ``CommandHandling.drain``.
Nothing here touches mlx: a command changes the scheduler's queues, ends requests with their
terminal message, or hands the governor an override.

``CommandHandling`` is a part of ``EngineWorker`` (worker.py) with its own state (whether a
Stop came); it is handed the queue it reads, the scheduler, the jobs, the loaded engine (its
governance), the status (to publish at once) and the worker's ``_finish`` / ``_send`` /
``_publish``, which a tensor-parallel rank overrides (daemon/distributed/lockstep.py).
"""

from __future__ import annotations

import queue
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from protocol import messages as m

from ..logs import get_logger
from ..request_text.requests import Job

if TYPE_CHECKING:
    from .scheduler import Scheduler
    from .loaded_engine import LoadedEngine
    from .status_snapshot import EngineStatus

log = get_logger("councild.engine")


@dataclass
class Submit:
    job: Job


@dataclass
class CancelJob:
    key: tuple[str, str]
    reason: str = "cancelled"  # or "client_gone", "slow_consumer", "shutting_down"


@dataclass
class CancelAll:
    code: str
    message: str


@dataclass
class Stop:
    pass


@dataclass
class ReloadGovernor:
    table: dict


@dataclass
class ReloadScheduler:
    cfg: Any  # SchedulerConfig: seats, weights, bounds; applies from the next admission


@dataclass
class GovernorOverride:
    identity: bytes
    action: str
    depth: int | None


class CommandHandling:
    """Applying the commands: ``drain`` (the single-process loop's), ``apply`` (one command),
    ``fail_all``; ``stopping`` once a Stop came."""

    def __init__(self, ready: queue.Queue, scheduler: Scheduler, jobs: dict, engine: LoadedEngine,
                 status: EngineStatus, *, finish: Callable, send: Callable, publish: Callable):
        self._ready = ready
        self.scheduler = scheduler
        self.jobs = jobs
        self.engine = engine
        self.status = status
        self._finish = finish
        self._send = send
        self._publish = publish
        self.stopping = False

    def drain(self, block: bool) -> bool:
        """Apply queued commands; False when the thread must stop."""
        timeout = 0.1 if block else 0.0
        while True:
            try:
                cmd = self._ready.get(timeout=timeout) if timeout else self._ready.get_nowait()
            except queue.Empty:
                return True
            timeout = 0.0
            if not self.apply(cmd):
                return False

    def apply(self, cmd) -> bool:
        """Apply one command; False when the thread must stop."""
        if isinstance(cmd, Submit):
            self._submit(cmd.job)
        elif isinstance(cmd, CancelJob):
            self._cancel(cmd.key, cmd.reason)
        elif isinstance(cmd, CancelAll):
            self.fail_all(cmd.code, cmd.message)
        elif isinstance(cmd, GovernorOverride):
            self._override(cmd)
        elif isinstance(cmd, ReloadGovernor):
            if self.engine.governance is not None:
                self.engine.governance.reconfigure(cmd.table)
        elif isinstance(cmd, ReloadScheduler):
            self.scheduler.reconfigure(cmd.cfg)
            if self.engine.governance is not None:
                self.engine.governance.note_scheduler(cmd.cfg)
        elif isinstance(cmd, Stop):
            self.stopping = True
            if not self.scheduler.has_work():
                return False
        return True

    def _submit(self, job: Job) -> None:
        if job.rejection is not None:  # refused by the intake thread, before or after tokenizing
            code, message = job.rejection
            self._finish(job, m.Error(request_id=job.request_id, code=code, message=message), registered=False)
            return
        msg = job.msg
        if msg.count_only:  # tokenized by the intake thread; nothing to decode
            self._send(job.identity, m.Accepted(request_id=job.request_id, queue_position=0,
                                                prompt_tokens=len(job.prompt)), key=job.key)
            self._finish(job, job.done(), registered=False)
            return
        self.jobs[job.key] = job
        self.scheduler.submit(job)
        if self.engine.governance is not None:
            self.engine.governance.on_arrival()
        self._send(job.identity, m.Accepted(request_id=job.request_id,
                                            queue_position=self.scheduler.position(job),
                                            prompt_tokens=len(job.prompt)), key=job.key)
        log.info("request.accepted", request_id=job.request_id, seat=job.seat, priority=job.priority,
                 prompt_tokens=len(job.prompt), max_tokens=msg.max_tokens)

    def _override(self, cmd: GovernorOverride) -> None:
        if self.engine.governance is None:
            reply = m.GovernorReply(ok=False, message="the governor is disabled in this daemon's configuration")
        else:
            ok, message = self.engine.governance.override(cmd.action, cmd.depth)
            reply = m.GovernorReply(ok=ok, message=message, state=self.engine.governance.snapshot())
            log.info("governor.override", action=cmd.action, depth=cmd.depth, ok=ok, message=message)
        # Publish before replying, so a status read right after the reply shows the change.
        self.status.published_at = 0.0
        self._publish()
        self._send(cmd.identity, reply)

    def _cancel(self, key: tuple[str, str], reason: str) -> None:
        job = self.jobs.get(key)
        if job is None:
            return
        if reason == "cancelled":
            self._finish(job, job.done("cancelled"))
        elif reason == "client_gone":
            self._finish(job, m.Error(request_id=job.request_id, code="client_gone",
                                      message="no heartbeat from the client within the timeout; work cancelled"))
        elif reason == "slow_consumer":
            # The client's queue is what filled up: the socket loop holds this terminal
            # and delivers it if the client reads again before its heartbeat timeout.
            self._finish(job, m.Error(request_id=job.request_id, code="slow_consumer",
                                      message="the client stopped reading and its send queue at the daemon "
                                              "filled up; the request was cut"))
        else:
            self._finish(job, m.Error(request_id=job.request_id, code="shutting_down",
                                      message="the daemon is shutting down and the drain deadline passed"))

    def fail_all(self, code: str, message: str) -> None:
        for job in list(self.jobs.values()):
            self._finish(job, m.Error(request_id=job.request_id, code=code, message=message))
