"""The engine thread: owns the model and every mlx call, and runs the step loop.

The socket loop hands it commands through a queue and it hands back encoded replies over
an inproc PUSH socket, so neither thread ever waits on the other's work. Between two decode
cycles (the only safe points) it applies commands, expires deadlines, admits queued work
and lets the governor act; then it advances one active request by one cycle.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any

import zmq

from protocol import encode
from protocol import messages as m

from .commands import CommandHandling, Submit
from .config import Config
from .decode_paths import DecodePaths
from .logs import get_logger
from .prefix_cache_use import PrefixCacheUse
from .requests import Job
from .scheduler import Scheduler
from .seat_stats import SeatStats
from .startup import EngineStartup
from .stats import StepUse, Tallies
from .status_snapshot import EngineSnapshot, EngineStatus

if TYPE_CHECKING:
    from .head_slot import HeadSlot

log = get_logger("councild.engine")

OUT_ENDPOINT = "inproc://councild-engine-out"


class EngineWorker(EngineStartup, CommandHandling, DecodePaths, PrefixCacheUse, EngineStatus, threading.Thread):
    """The engine thread. Its step loop and a request's per-cycle life (advance, deliver,
    finish) are here; the other concerns are parts of this class kept in files of their
    own: start-up (startup.py), commands (commands.py), starting a request and
    choosing its decode path (decode_paths.py), the prefix cache's opening and
    continuations (prefix_cache_use.py), the status snapshot (status_snapshot.py)."""

    def __init__(self, cfg: Config, ctx: zmq.Context, model_path: str, hooks: Any = None):
        super().__init__(name="councild-engine", daemon=True)
        self.cfg = cfg
        self.ctx = ctx
        self.model_path = model_path
        # The socket loop puts commands here; the intake thread (intake.py) tokenizes each
        # Submit and passes every command on, in order, to ``_ready``, which this thread reads.
        self.commands: queue.Queue = queue.Queue()
        self._ready: queue.Queue = queue.Queue()
        self.max_prompt_tokens = cfg.max_prompt_tokens or 0  # the model's context once loaded
        self.snapshot = EngineSnapshot()
        self.snapshot_lock = threading.Lock()
        self.loaded = threading.Event()
        self.load_error: BaseException | None = None
        self.hooks = hooks
        self.lm = None
        # The MTP head and the depth it drafts at (head_slot.py), made once the model is
        # loaded; governance changes it between cycles, this thread reads it every cycle.
        self.slot: HeadSlot | None = None
        # `councild tune`'s profile when the governor loaded one (governance.py): per
        # sampling setting, the best depth measured, which caps a request's depth.
        self.tuned_profile: dict | None = None
        self.governance = None
        self.scheduler = Scheduler(cfg.scheduler)
        self.jobs: dict[tuple[str, str], Job] = {}
        self._out: zmq.Socket | None = None
        self._seat_stats = SeatStats()
        self._stopping = False
        self._published_at = 0.0
        self.tallies = Tallies()
        self.step_use = StepUse()
        # An mx.distributed group of several ranks when serving tensor-parallel
        # (daemon/distributed/, which subclasses this worker); None in one process.
        self.group = None

    # ------------------------------------------------------------------ thread body
    def run(self) -> None:
        self._out = self.ctx.socket(zmq.PUSH)
        self._out.setsockopt(zmq.LINGER, 1000)
        self._out.connect(OUT_ENDPOINT)
        try:
            self._load()
        except BaseException as exc:  # reported to the socket loop, which exits
            self.load_error = exc
            self.loaded.set()
            self._out.close()
            return
        from .intake import Intake

        Intake(self.commands, self._ready, self.lm, self.max_prompt_tokens, Submit, chat=self.cfg.chat,
               constraint=self.cfg.constraint).start()
        self.loaded.set()
        try:
            self._loop()
        except BaseException:
            log.error("engine.crashed", error=traceback.format_exc())
            self._fail_all("internal", "the engine thread crashed; see the daemon log")
            raise
        finally:
            self._out.close()
            pc = getattr(self, "prefix_cache", None)
            if pc is not None and pc.disk is not None:
                pc.disk.close(timeout=10.0)  # snapshots still queued reach the disk


    def requests_holding_head(self) -> int:
        return sum(1 for j in self.scheduler.active + self.scheduler.parked
                   if j.spec.mode != "off" or (j.prefill is not None and j.prefill.history is not None))

    def _loop(self) -> None:
        while True:
            idle = not self.scheduler.has_work()
            if not self._drain_commands(block=idle):
                return
            self._expire_deadlines()
            admitted = self.scheduler.admit()
            self._log_displaced()
            if self.batch is not None and self.scheduler.parked:
                self._park_batched()
            for job in admitted:
                try:
                    self._start(job)
                except Exception as exc:  # e.g. a batch row's prefill failing: that request only
                    self._failed(job, exc)
            if not self._step() and self._stopping:
                return
            if self.governance is not None:
                self.governance.update_load(len(self.scheduler.active),
                                            {s: self.scheduler.queued_count(s) for s in self.scheduler.queues})
                self.governance.safe_point()
            self._publish()
            if self.hooks is not None:
                # Liveness is this loop going round (it wakes every 0.1 s when idle), not a
                # timer: a decode that hangs stops the watchdog pings.
                self.hooks.on_step()

    def _step(self) -> bool:
        """One engine iteration: a decode phase (one cycle: the batch's one step for every
        batched row, or one solo decoder's cycle), then a prefill phase (whole chunks filling
        what is left of ``scheduler.step_token_budget``; scheduler.prefill_plan says which).
        False when there was nothing to do."""
        job = self.scheduler.pick_decoder()
        spent = self._advance(job) if job is not None else 0
        plan = self.scheduler.prefill_plan(spent)
        prefilled = 0
        for pjob, chunks in plan:
            for _ in range(chunks):
                if self.jobs.get(pjob.key) is not pjob or pjob.prefill is None:
                    break  # failed, or done: the plan counted its tokens as they were
                prefilled += self._prefill_chunk(pjob)
        if job is not None or plan:
            self.step_use.record(spent, prefilled, self._step_budget())
        return job is not None or bool(plan)

    def _step_budget(self) -> int:
        """The token budget in force (0 in the config means one prefill chunk)."""
        cfg = self.scheduler.cfg
        return cfg.step_token_budget or cfg.prefill_chunk

    # ------------------------------------------------------------------ deadlines
    def _now(self) -> float:
        """The clock deadlines are read against (a group reads rank 0's, per iteration)."""
        return time.monotonic()

    def _expire_deadlines(self) -> None:
        now = self._now()
        for job in [j for j in self.jobs.values() if j.deadline is not None and now >= j.deadline]:
            where = ("mid-prefill" if job.prefill is not None else
                     "in the queue" if job.generator is None else "mid-generation")
            self._finish(job, m.Error(request_id=job.request_id, code="deadline_exceeded",
                                      message=f"deadline of {job.msg.deadline_ms} ms passed {where}"))

    # ------------------------------------------------------------------ decoding a cycle
    def _token_text(self, token_id: int) -> str:
        return self.lm.tokenizer.decode([token_id])

    def _prefill_chunk(self, job: Job) -> int:
        """One chunk of a job's prefill; the loop checks commands, deadlines and the drain,
        and feeds the watchdog, after each iteration's chunks. Returns the tokens forwarded."""
        try:
            n = job.prefill.step()
            if job.prefill.pos in job.snapshot_at and self.prefix_cache is not None:
                pos = job.prefill.pos
                self.prefix_cache.store(job.prompt[:pos], job.prefill.cache, job.prefill.history,
                                        exact=self.prefix_cache.is_exact(pos, job.exact_chain), seat=job.seat)
            if job.prefill.done:
                self._begin_decode(job)
        except Exception as exc:
            self._failed(job, exc)
            return 0
        # One cycle, as a decode step is: the seat's solo decoders are picked by this share.
        self.scheduler.charge(job, 1)
        with self.snapshot_lock:
            self.snapshot.prefill_tokens_total += n
        return n


    def _advance(self, job: Job) -> int:
        """One cycle of a decoding job; returns the tokens its forward held (the step's
        budget use): a batch's positions (its rows, times depth + 1 where it speculates), or
        a solo cycle's verified positions."""
        if job.prefill is not None:  # a one-token prompt: nothing to prefill, decode next
            return self._prefill_chunk(job)
        if job.batched:
            self._step_batch()
            return self.batch.last_positions  # rows x (depth + 1) where the batch speculates
        try:
            step = next(job.generator)
        except Exception as exc:
            self._failed(job, exc)
            return 1
        if self.governance is not None:
            self.governance.after_step(step)
        self._deliver(job, step)
        return 1 + step.drafted

    def _step_batch(self) -> None:
        """One cycle for every batched row (a verify of every row's drafts where the batch
        speculates, else one token each); each row's seat is charged its own tokens."""
        from .engine.types import DecodeStep

        t0 = time.perf_counter()
        try:
            out = self.batch.step()
        except Exception as exc:  # a failed batched forward fails every row in it
            for job in [j for j in self.jobs.values() if j.batched and j.key in self.batch]:
                self._failed(job, exc)
            return
        dt = time.perf_counter() - t0
        steps = out if self.batch_speculates else {key: DecodeStep(tokens=[t], cycle_s=dt) for key, t in out.items()}
        if self.governance is not None and steps:
            rows = list(steps.values())
            self.governance.after_step(DecodeStep(
                tokens=[t for s in rows for t in s.tokens], depth=getattr(self.batch, "last_depth", 0),
                drafted=sum(s.drafted for s in rows), accepted=sum(s.accepted for s in rows),
                accepted_mask=[ok for s in rows for ok in s.accepted_mask], cycle_s=dt,
                transition=getattr(self.batch, "last_transition", False)), batch=len(rows))
        for key, step in steps.items():
            job = self.jobs.get(key)
            if job is not None:
                job.row_depth = step.depth
                self._deliver(job, step)

    def _log_displaced(self) -> None:
        for parked, made_room_for, why, waited in self.scheduler.displaced:
            log.info("scheduler.parked", request_id=parked.request_id, seat=parked.seat, rule=why,
                     for_request_id=made_room_for.request_id, for_seat=made_room_for.seat,
                     for_waited_s=round(waited, 3),
                     running=self.scheduler.running_counts())
        self.scheduler.displaced.clear()

    def _park_batched(self) -> None:
        """A parked job must not advance with the batch: take its row out, keeping its
        cache and decided next token, so it rejoins later without recomputing its prompt."""
        for job in self.scheduler.parked:
            if job.batched and job.parked_state is None and job.key in self.batch:
                job.parked_state = self.batch.extract(job.key)  # (cache, next token) or (cache, primary, history)

    def _failed(self, job: Job, exc: BaseException) -> None:
        log.error("request.failed", request_id=job.request_id, seat=job.seat, error=repr(exc),
                  traceback=traceback.format_exc())
        self._finish(job, m.Error(request_id=job.request_id, code="internal",
                                  message=f"decode failed: {type(exc).__name__}: {exc}"))

    def _deliver(self, job: Job, step) -> None:
        """Turn one cycle's committed tokens into the job's output and maybe its end."""
        if step.penalised and not job.spec.penalised:  # the first step under the loop guard
            log.info("request.loop_guard", request_id=job.request_id, seat=job.seat,
                     completion_tokens=len(job.token_ids))
        constraint = job.sampler.constraint if job.sampler is not None else None
        if constraint is not None and constraint.error is not None:  # a batched row's grammar failed
            self._failed(job, constraint.error)
            return
        job.decoded.extend(step.tokens)  # what the decoder's cache now holds (prefix_cache)
        kept = job.absorb(step, self.lm.eos_token_ids, self._token_text if job.msg.option("logprobs") else None,
                          complete=constraint is not None and constraint.complete)
        self._tally(job, step, kept)
        self.scheduler.charge(job, max(1, len(step.tokens)))
        self._count_tokens(job.seat, len(kept))
        if job.msg.stream:
            chunk = job.chunk(kept)
            if chunk is not None:
                self._send(job.identity, chunk, key=job.key)
        if job.finished_reason is not None:
            self._finish(job, job.done())

    def _tally(self, job: Job, step, kept: list[int]) -> None:
        """Latency and speculation counters for status readers (daemon/stats.py)."""
        t = self.tallies
        if step.draft_source != "lookup":  # the head's drafts, as Done.speculation counts them
            t.drafted += step.drafted
            t.accepted += step.accepted
        if not kept:
            return
        now = time.monotonic()
        if job.last_token_at is None:
            t.ttft.observe(now - job.received_at)
        else:  # a cycle's gap, shared by the tokens it committed
            t.inter_token.observe((now - job.last_token_at) / len(kept), len(kept))
        job.last_token_at = now

    def _finish(self, job: Job, terminal: m.Done | m.Error, registered: bool = True) -> None:
        """Send the request's one terminal message and forget it."""
        if registered:
            if self.jobs.pop(job.key, None) is None:
                return  # already finished: never a second terminal message
            self.scheduler.remove(job)
        if isinstance(terminal, m.Done):
            self._keep_continuation(job)
        if job.generator is not None:
            job.generator.close()
            job.generator = None
        if job.batched and self.batch is not None and job.key in self.batch:
            self.batch.remove(job.key)  # a row whose start failed after it joined: never left behind
        job.decode_cache = job.decode_history = None
        prefilled = job.prefill.pos if job.prefill is not None else None
        job.prefill = None  # its cache goes with it
        if isinstance(terminal, m.Done) and job.msg.stream and terminal.finish_reason != "cancelled":
            # Flush any held-back tail before the terminal message.
            rest = job.chunk([])
            if rest is not None and (rest.text or rest.reasoning or rest.tool_calls):
                self._send(job.identity, rest, key=job.key)
        # Log first: whoever has seen the terminal message can rely on the log holding it.
        if isinstance(terminal, m.Done):
            log.info("request.done", request_id=job.request_id, seat=job.seat,
                     finish_reason=terminal.finish_reason, completion_tokens=terminal.usage.completion_tokens,
                     prompt_tokens=terminal.usage.prompt_tokens, cached_tokens=terminal.usage.cached_tokens,
                     prefilled_tokens=prefilled, batched=job.batched,
                     tokens_per_s=round(terminal.timings.tokens_per_s, 2),
                     ttft_s=round(terminal.timings.ttft_s, 4),
                     speculation=terminal.speculation and {
                         "mode": terminal.speculation.mode, "cycles": terminal.speculation.cycles,
                         "drafted": terminal.speculation.drafted, "accepted": terminal.speculation.accepted,
                         "lookup_cycles": job.spec.lookup_cycles, "lookup_drafted": job.spec.lookup_drafted,
                         "lookup_accepted": job.spec.lookup_accepted,
                         "depth_ceiling": getattr(job, "depth_ceiling", None),
                         "draft_stops": job.spec.draft_stops, "loop_guard_steps": job.spec.penalised})
        else:
            log.info("request.error", request_id=job.request_id, seat=job.seat, code=terminal.code,
                     message=terminal.message, prefilled_tokens=prefilled)
        self._send(job.identity, terminal, key=job.key, terminal=True)
        self.tallies.finished(job.seat, terminal.finish_reason if isinstance(terminal, m.Done) else terminal.code)
        self._published_at = 0.0  # status shows the finish at once

    # ------------------------------------------------------------------ plumbing
    def _send(self, identity: bytes, msg, key: tuple[str, str] | None = None, terminal: bool = False) -> None:
        """Hand a message to the socket loop: [identity, payload, request key, terminal flag].
        The key (on every message of a request) lets the loop drop the chunks of a request
        it has cut; the flag marks the request's one terminal message."""
        k = b"" if key is None else f"{key[0]}\x00{key[1]}".encode()
        self._out.send_multipart([identity, encode(msg), k, b"T" if terminal else b""])
