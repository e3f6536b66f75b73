"""The engine thread: owns the model and every mlx call, and runs the step loop.

The socket loop hands it commands through a queue and it hands back encoded replies over
an inproc PUSH socket, so neither thread ever waits on the other's work. Between two decode
cycles (the only safe points) it applies commands, expires deadlines, admits queued work
and lets the governor act; then it advances one active request by one cycle.

``EngineWorker`` is that step loop plus its parts, each an object with its own state, made
with what it needs: ``EngineStartup`` (startup.py) builds the ``LoadedEngine`` they share
(loaded_engine.py); ``CommandHandling`` (commands.py) applies the commands; ``DecodePaths``
(decode_paths.py) starts a request and chooses its decode path; ``PrefixCacheUse``
(prefix_cache_use.py) opens the prefix cache and keeps continuations; ``EngineStatus``
(status_snapshot.py) publishes the status snapshot.
"""

from __future__ import annotations

import gc
import itertools
import queue
import threading
import time
import traceback
from typing import Any

import zmq

from protocol import encode
from protocol import messages as m

from .commands import CommandHandling, Submit
from ..config import Config
from .decode_paths import DecodePaths, exact_greedy
from .loaded_engine import LoadedEngine
from ..logs import get_logger
from .prefill_pacer import PrefillPacer
from .prefill_phase import PrefillPhase, Riding
from .prefix_cache_use import PrefixCacheUse
from ..request_text.requests import Job
from .scheduler import Scheduler
from .slow_iterations import SlowIterationLog
from .startup import EngineStartup
from .stats import StepUse, Tallies
from .status_snapshot import EngineSnapshot, EngineStatus
from .warming import BusyShare

log = get_logger("councild.engine")

OUT_ENDPOINT = "inproc://councild-engine-out"

# Under load that never lets the engine idle, the start-up parts still finish (warming.py):
# between steps, pieces within the credit its serving earned (warming.BusyShare), so they take
# a share of its time and a request waits at most WARM_BURST_S and one piece. Idle, pieces
# run back to back. The share is by who waits for the part's verdict (WarmPart.waited_by):
# - every request (the compiled step, the warm-up): a fifth;
# - exact greedy requests (verify, batch, splits) while one is in the engine: half. Until
#   their verdicts those requests decode alone and serially and resume on the chunk grid
#   only: on a fresh CPU start, a council's second turn re-prefilled ~180 tokens a seat
#   because the split verdict came at a fifth (bench/results/first_round_pacing_cpu_2026-12-05);
# - nobody (an optional speed-up's cost probe, or an exact part while no exact request is in
#   the engine): a twentieth, so a first round pays little for what it does not use;
# - "idle" (prefill_lengths, whose warming serving does itself): nothing; it waits for idle.
WARM_SHARE_WHEN_BUSY = 0.2
WARM_SHARE_EXACT_WAITING = 0.5
WARM_SHARE_NONE_WAITING = 0.05
WARM_BURST_S = 0.25


class EngineWorker(threading.Thread):
    """The engine thread: its step loop and a request's per-cycle life (advance, deliver,
    finish). Its parts (the module's docstring) are made at start-up, once the engine is
    loaded, but the status, which status readers read from the first moment."""

    def __init__(self, cfg: Config, ctx: zmq.Context, model_path: str, hooks: Any = None, prebuild: Any = None):
        super().__init__(name="councild-engine", daemon=True)
        self.cfg = cfg
        self.prebuild = prebuild  # prebuild_start.start_kernel_prebuild's workers, or None
        self.ctx = ctx
        self.model_path = model_path
        # The socket loop puts commands here; the intake thread (request_text/intake.py) tokenizes each
        # Submit and passes every command on, in order, to ``_ready``, which this thread reads.
        self.commands: queue.Queue = queue.Queue()
        self._ready: queue.Queue = queue.Queue()
        self.max_prompt_tokens = cfg.max_prompt_tokens or 0  # the model's context once loaded
        self.loaded = threading.Event()
        self.load_error: BaseException | None = None
        self.hooks = hooks
        self.scheduler = Scheduler(cfg.scheduler)
        self.jobs: dict[tuple[str, str], Job] = {}
        self._out: zmq.Socket | None = None
        self.tallies = Tallies()
        self.step_use = StepUse()
        self.slow = SlowIterationLog(cfg.log_slow_iteration_s)
        self._last_shape: dict = {}  # the last iteration's step, for engine.slow_iteration
        self.pacer = PrefillPacer(cfg.scheduler.decode_gap_bound)
        self.status = EngineStatus(self.scheduler, self.jobs, self.tallies, self.step_use, self._step_budget, self.pacer)
        # Made by ``_load``: the engine start-up built, and the parts that use it.
        self.engine: LoadedEngine | None = None
        self.startup: EngineStartup | None = None
        self.handling: CommandHandling | None = None
        self.paths: DecodePaths | None = None
        self.prefix_use: PrefixCacheUse | None = None
        # The start-up parts still to run between requests (warming.py), and the credit their
        # pieces draw on while requests keep the engine busy (the WARM_SHARE_* constants).
        self.warming = None
        self._warm_share = BusyShare(WARM_SHARE_WHEN_BUSY, WARM_BURST_S)
        # An mx.distributed group of several ranks when serving tensor-parallel
        # (daemon/distributed/, which subclasses this worker); None in one process.
        self.group = None

    # ------------------------------------------------------------------ start-up
    def _load(self) -> None:
        # No cyclic collections while start-up builds its objects (mlx-lm and transformers'
        # imports, the model, the traces): ~7% of the imports' time, about what the one
        # collection after costs. That collection frees start-up's cyclic garbage (the
        # warm-up's caches may sit in it: frozen, it would never be freed); then what lives
        # on is frozen out of the collector's view: a full collection over it took ~100 ms
        # on the bundled model on CPU, a stall in every stream each time one ran mid-decode.
        gc.disable()
        try:
            self._load_unfrozen()
        finally:
            gc.collect()
            gc.freeze()
            gc.enable()

    def _load_unfrozen(self) -> None:
        """Start-up (startup.py) builds the engine; then the parts that use it are made,
        and the snapshot says ready."""
        self.startup = EngineStartup(self.cfg, self.model_path, self.group, self.status, self.hooks,
                                     requests_holding_head=self.requests_holding_head, prebuild=self.prebuild)
        engine = self.engine = self.startup.load()
        self.warming = self.startup.warming
        self.max_prompt_tokens = engine.max_prompt_tokens
        self.prefix_use = self.startup.prefix_use or PrefixCacheUse(self.cfg, engine, self.group)
        self.paths = DecodePaths(self.cfg, engine, self.scheduler, self.group, self.prefix_use,
                                 failed=self._failed, deliver=self._deliver, depth_pinned=self.depth_pinned,
                                 build_ahead=self.startup.build_ahead)
        self.prefill_phase = PrefillPhase(engine, self.scheduler, self.paths, self.jobs,
                                          failed=self._failed, piece=self._prefill_piece,
                                          count_prefilled=self.status.count_prefilled)
        self.status.prefill_phase = self.prefill_phase
        self.handling = CommandHandling(self._ready, self.scheduler, self.jobs, engine, self.status,
                                        finish=self._finish, send=self._send, publish=self._publish)
        self.status.attach(engine)
        if engine.governance is not None and self.group is None:
            # With max_active = "auto" the governor sets the scheduler's limit (not in a
            # tensor-parallel group: the followers would not hear of it; the limit stays at
            # its start height there).
            engine.governance.attach_rows(self.cfg.scheduler, self.scheduler.set_max_active, engine.row_cache_bytes,
                                          self.scheduler.max_active)
        # The first status answer already has every row (step, seats, memory): publish before
        # ready rather than at the step loop's first turn, which a status read can beat.
        self._publish()
        with self.status.snapshot_lock:
            self.status.snapshot.model = self.engine.lm.name
            self.status.snapshot.model_type = self.engine.lm.model_type
            self.status.snapshot.decode_path = self.engine.lm.decode_path
            self.status.snapshot.batch_decode_path = self.engine.lm.batch_decode_path
            self.status.snapshot.recurrence = self.engine.lm.recurrence
            self.status.snapshot.linears = self.engine.lm.linears

    # ------------------------------------------------------------------ the parts' hooks
    # What a tensor-parallel rank (daemon/distributed/lockstep.py) overrides or calls.
    def _drain_commands(self, block: bool) -> bool:
        """Apply queued commands; False when the thread must stop (commands.py)."""
        return self.handling.drain(block)

    def _apply_command(self, cmd) -> bool:
        return self.handling.apply(cmd)

    def _publish(self) -> None:
        self.status.publish()

    def read_snapshot(self) -> EngineSnapshot:
        return self.status.read_snapshot()

    def depth_pinned(self) -> bool:
        return self.engine.governance is not None and self.engine.governance.gov.state.override == "pin_depth"

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
        from ..request_text.intake import Intake

        Intake(self.commands, self._ready, self.engine.lm, self.max_prompt_tokens, Submit, chat=self.cfg.chat,
               constraint=self.cfg.constraint).start()
        # Status says "serving" only from here: until `loaded` is set the socket loop still
        # answers a Generate with "still loading", and a front that read "serving" earlier
        # (start-up's collection and freeze run after the load) let it through to a 429.
        with self.status.snapshot_lock:
            self.status.snapshot.ready = True
        self.loaded.set()
        try:
            self._loop()
        except BaseException:
            log.error("engine.crashed", error=traceback.format_exc())
            self.handling.fail_all("internal", "the engine thread crashed; see the daemon log")
            raise
        finally:
            if self.warming is not None:
                self.warming.abandon()
            if self.engine.governance is not None:
                self.engine.governance.close()  # what the governor learned reaches the cache folder
            self._out.close()
            pc = getattr(self.engine, "prefix_cache", None)
            if pc is not None and pc.disk is not None:
                pc.disk.close(timeout=10.0)  # snapshots still queued reach the disk


    def _warming_left(self) -> bool:
        return self.warming is not None and bool(self.warming.parts) and not self.handling.stopping

    def _warm_piece(self, idle: bool) -> None:
        """The start-up's remaining checks (warming.py) between steps: idle, one piece (about
        one step's work, so a request arriving meanwhile waits about one step); busy, the
        pieces the serving since the last has earned (the WARM_SHARE_* constants)."""
        share = self._warm_share
        if idle:
            self.warming.step()
            share.idle()
            return
        busy_share = self._busy_warm_share()
        if busy_share == 0.0:  # an "idle" part: not even credit a part before it left over
            return
        share.set_share(busy_share)
        while share.earn() > 0 and self._warming_left():
            t0 = time.monotonic()
            self.warming.step()
            share.charge(time.monotonic() - t0)

    def _busy_warm_share(self) -> float:
        """The part under way's share of a busy engine, by who waits for it (the constants)."""
        waited_by = self.warming.waited_by
        if waited_by == "idle":
            return 0.0
        if waited_by == "every":
            return WARM_SHARE_WHEN_BUSY
        if waited_by == "exact" and self._exact_greedy_in_engine():
            return WARM_SHARE_EXACT_WAITING
        return WARM_SHARE_NONE_WAITING

    def _exact_greedy_in_engine(self) -> bool:
        """A request decoding or waiting that is exact at temperature 0: one the exactness
        verdicts speed up."""
        return any(exact_greedy(j.msg, self.cfg) for j in itertools.chain(self.scheduler.active, self.scheduler.waiting()))

    def requests_holding_head(self) -> int:
        return sum(1 for j in self.scheduler.active + self.scheduler.parked
                   if j.spec.mode != "off" or (j.prefill is not None and j.prefill.history is not None))

    def _loop(self) -> None:
        while True:
            idle = not self.scheduler.has_work()
            warming = idle and self._warming_left()
            if not self._drain_commands(block=idle and not warming):
                return
            self.slow.begin()
            self._expire_deadlines()
            admitted = self.scheduler.admit()
            self._log_displaced()
            if self.engine.batch is not None and self.scheduler.parked:
                self._park_batched()
            for job in admitted:
                try:
                    self.paths.start(job)
                except Exception as exc:  # e.g. a batch row's prefill failing: that request only
                    self._failed(job, exc)
            self.slow.phase("start")
            stepped = self._step()
            if not stepped and self.handling.stopping:
                return
            if self._warming_left():
                part = self.warming.pending[0]
                self._warm_piece(idle=not stepped and not self.scheduler.has_work() and self._ready.empty())
                self.slow.phase(f"warm {part}")
            if self.engine.governance is not None:
                self.engine.governance.update_load(len(self.scheduler.active),
                                            {s: self.scheduler.queued_count(s) for s in self.scheduler.queues})
                self.engine.governance.update_rows(len(self.scheduler.active), self.scheduler.queued_count(),
                                                   self.scheduler.max_active)
                self.engine.governance.safe_point()
            self._publish()
            self.slow.end(**self._last_shape, started=len(admitted), active=len(self.scheduler.active))
            if self.hooks is not None:
                # Liveness is this loop going round (it wakes every 0.1 s when idle), not a
                # timer: a decode that hangs stops the watchdog pings.
                self.hooks.on_step()

    def _step(self) -> bool:
        """One engine iteration: a decode phase (one cycle: the batch's one step for every
        batched row, or one solo decoder's cycle), then a prefill phase (prefill_phase.py:
        whole chunks filling what is left of ``scheduler.step_token_budget``, or the pacer's
        piece while others decode). False when there was nothing to do."""
        job = self.scheduler.pick_decoder()
        decoding = job is not None and job.prefill is None
        t0 = time.perf_counter()
        # A batched decode forward may carry the first prompt's paced piece (mixed steps).
        riding = self.prefill_phase.riding(decoding) if decoding and job.batched else None
        batch = self.engine.batch
        batched = job is not None and job.batched and batch is not None
        rows = len(batch) if batched else int(decoding)  # before the step: a finished row leaves in it
        spent = self._advance(job, riding) if job is not None else 0
        self.slow.phase("decode")
        prefilled, planned = self.prefill_phase.run(spent, decoding, riding)
        self.slow.phase("prefill")
        self._last_shape = {"decode": None if not decoding else "batch" if batched else "solo", "rows": rows,
                            "positions": spent, "prefilled": prefilled,
                            "depth": getattr(batch, "last_depth", 0) if batched else None}
        # The whole iteration is what a decoding stream waits (its forward runs while the
        # prefill's is evaluated): the pacer learns from that, not from each phase's clock.
        self.pacer.iteration_done(time.perf_counter() - t0, prefilled, decoding)
        if job is not None or planned:
            self.step_use.record(spent, prefilled, self._step_budget())
        return job is not None or planned

    def _prefill_piece(self, decoding: bool) -> int | None:
        """While others decode, the prefill phase's piece that keeps their gap within the
        bound (prefill_pacer.py); None: whole chunks."""
        self.pacer.bound = self.scheduler.cfg.decode_gap_bound
        return self.pacer.allowance(decoding, self.scheduler.cfg.prefill_chunk)

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
        return self.engine.lm.tokenizer.decode([token_id])

    def _advance(self, job: Job, riding: Riding | None = None) -> int:
        """One cycle of a decoding job; returns the tokens its forward held (the step's
        budget use): a batch's positions (its rows, times depth + 1 where it speculates), or
        a solo cycle's verified positions. ``riding``: a prompt's piece the batch's forward
        may carry (prefill_phase.py)."""
        if job.prefill is not None:  # a one-token prompt: nothing to prefill, decode next
            return self.prefill_phase.run_piece(job)
        if job.batched:
            self._step_batch(riding)
            return self.engine.batch.last_positions  # rows x (depth + 1) where the batch speculates
        try:
            step = next(job.generator)
        except Exception as exc:
            self._failed(job, exc)
            return 1
        if self.engine.governance is not None:
            self.engine.governance.after_step(step)
        self._deliver(job, step)
        return 1 + step.drafted

    def _step_batch(self, riding: Riding | None = None) -> None:
        """One cycle for every batched row (a verify of every row's drafts where the batch
        speculates, else one token each); each row's seat is charged its own tokens."""
        from ..engine.types import DecodeStep

        t0 = time.perf_counter()
        ride = riding.ride if riding is not None else None
        try:
            out = self.engine.batch.step(ride) if ride is not None else self.engine.batch.step()
        except Exception as exc:  # a failed batched forward fails every row in it, and a piece it carried
            for job in [j for j in self.jobs.values() if j.batched and j.key in self.engine.batch]:
                self._failed(job, exc)
            if ride is not None and self.jobs.get(riding.job.key) is riding.job:
                self._failed(riding.job, exc)
            return
        dt = time.perf_counter() - t0
        steps = out if self.engine.batch_speculates else {key: DecodeStep(tokens=[t], cycle_s=dt) for key, t in out.items()}
        if self.engine.governance is not None and steps:
            rows = list(steps.values())
            self.engine.governance.after_step(DecodeStep(
                tokens=[t for s in rows for t in s.tokens], depth=getattr(self.engine.batch, "last_depth", 0),
                drafted=sum(s.drafted for s in rows), accepted=sum(s.accepted for s in rows),
                accepted_mask=[ok for s in rows for ok in s.accepted_mask], cycle_s=dt,
                draft_source=getattr(self.engine.batch, "last_source", "head"),
                transition=getattr(self.engine.batch, "last_transition", False)), batch=len(rows))
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
            if job.batched and job.parked_state is None and job.key in self.engine.batch:
                job.parked_state = self.engine.batch.extract(job.key)  # (cache, next token) or (cache, primary, history)

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
        kept = job.absorb(step, self.engine.lm.eos_token_ids, self._token_text if job.msg.option("logprobs") else None,
                          complete=constraint is not None and constraint.complete)
        self._tally(job, step, kept)
        self.scheduler.charge(job, max(1, len(step.tokens)))
        self.status.count_tokens(job.seat, len(kept))
        if job.msg.stream:
            chunk = job.chunk(kept)
            if chunk is not None:
                self._send(job.identity, chunk, key=job.key)
        if job.finished_reason is not None:
            self._finish(job, job.done())

    def _tally(self, job: Job, step, kept: list[int]) -> None:
        """Latency and speculation counters for status readers (daemon/engine_thread/stats.py)."""
        t = self.tallies
        if step.draft_source != "lookup":  # the head's drafts, as Done.speculation counts them
            t.drafted += step.drafted
            t.accepted += step.accepted
        if not kept:
            return
        now = time.monotonic()
        if job.last_token_at is None:
            t.ttft.observe(now - job.received_at)
            self.status.first_token(job.seat, now - job.received_at)
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
            self.prefix_use.keep_continuation(job)
        if job.generator is not None:
            job.generator.close()
            job.generator = None
        if job.batched and self.engine.batch is not None and job.key in self.engine.batch:
            self.engine.batch.remove(job.key)  # a row whose start failed after it joined: never left behind
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
                     prefilled_tokens=prefilled, prefill_forwards=job.prefill_forwards, batched=job.batched,
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
        self.tallies.finished(job.seat, terminal.finish_reason if isinstance(terminal, m.Done) else terminal.code)
        # Published before the terminal goes, as a governor override's reply is: whoever has
        # the terminal reads a status (and /metrics) that counts it.
        self.status.published_at = 0.0
        self._publish()
        self._send(job.identity, terminal, key=job.key, terminal=True)

    # ------------------------------------------------------------------ plumbing
    def _send(self, identity: bytes, msg, key: tuple[str, str] | None = None, terminal: bool = False) -> None:
        """Hand a message to the socket loop: [identity, payload, request key, terminal flag].
        The key (on every message of a request) lets the loop drop the chunks of a request
        it has cut; the flag marks the request's one terminal message."""
        k = b"" if key is None else f"{key[0]}\x00{key[1]}".encode()
        self._out.send_multipart([identity, encode(msg), k, b"T" if terminal else b""])
