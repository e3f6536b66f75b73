"""The commands the socket loop sends the engine thread, and how the engine applies them.

The socket loop puts a command on ``EngineWorker.commands``; the intake thread (intake.py)
tokenizes each Submit and passes every command on, in order; the engine thread drains them
between two decode cycles (the only safe points) with ``CommandHandling._drain_commands``.
Nothing here touches mlx: a command changes the scheduler's queues, ends requests with their
terminal message, or hands the governor an override.

``CommandHandling`` is a part of ``EngineWorker`` (worker.py) kept in its own file; it uses
the worker's scheduler, jobs, governance and its ``_finish`` / ``_send`` / ``_publish``.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass
from typing import Any

from protocol import messages as m

from .logs import get_logger
from .requests import Job

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
    """Applying the commands (a mixin of EngineWorker)."""

    def _drain_commands(self, block: bool) -> bool:
        """Apply queued commands; False when the thread must stop."""
        timeout = 0.1 if block else 0.0
        while True:
            try:
                cmd = self._ready.get(timeout=timeout) if timeout else self._ready.get_nowait()
            except queue.Empty:
                return True
            timeout = 0.0
            if not self._apply_command(cmd):
                return False

    def _apply_command(self, cmd) -> bool:
        """Apply one command; False when the thread must stop."""
        if isinstance(cmd, Submit):
            self._submit(cmd.job)
        elif isinstance(cmd, CancelJob):
            self._cancel(cmd.key, cmd.reason)
        elif isinstance(cmd, CancelAll):
            self._fail_all(cmd.code, cmd.message)
        elif isinstance(cmd, GovernorOverride):
            self._override(cmd)
        elif isinstance(cmd, ReloadGovernor):
            if self.governance is not None:
                self.governance.reconfigure(cmd.table)
        elif isinstance(cmd, ReloadScheduler):
            self.scheduler.cfg = cmd.cfg
        elif isinstance(cmd, Stop):
            self._stopping = True
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
        if self.governance is not None:
            self.governance.on_arrival()
        self._send(job.identity, m.Accepted(request_id=job.request_id,
                                            queue_position=self.scheduler.position(job),
                                            prompt_tokens=len(job.prompt)), key=job.key)
        log.info("request.accepted", request_id=job.request_id, seat=job.seat, priority=job.priority,
                 prompt_tokens=len(job.prompt), max_tokens=msg.max_tokens)

    def _override(self, cmd: GovernorOverride) -> None:
        if self.governance is None:
            reply = m.GovernorReply(ok=False, message="the governor is disabled in this daemon's configuration")
        else:
            ok, message = self.governance.override(cmd.action, cmd.depth)
            reply = m.GovernorReply(ok=ok, message=message, state=self.governance.snapshot())
            log.info("governor.override", action=cmd.action, depth=cmd.depth, ok=ok, message=message)
        # Publish before replying, so a status read right after the reply shows the change.
        self._published_at = 0.0
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

    def _fail_all(self, code: str, message: str) -> None:
        for job in list(self.jobs.values()):
            self._finish(job, m.Error(request_id=job.request_id, code=code, message=message))
