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
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq

from protocol import encode
from protocol import messages as m

from .config import Config
from .detokenize import CommittedText
from .logs import get_logger
from .requests import Job
from .scheduler import Scheduler
from .seat_stats import SeatStats
from .stats import StepUse, Tallies

if TYPE_CHECKING:
    from .head_slot import HeadSlot

log = get_logger("councild.engine")

OUT_ENDPOINT = "inproc://councild-engine-out"


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


@dataclass
class EngineSnapshot:
    """What the socket loop may read without touching the engine's state."""

    ready: bool = False
    model: str = ""
    model_type: str = ""
    head_resident: bool = False
    head_bytes: int = 0
    head_error: str | None = None
    # What an exact temperature-0 request gets here: "speculate" (verify is bit-identical
    # to serial), "serial" or "guarded" (it is not; speculation.exact_on_inexact_backend).
    exact_decode: str = "speculate"
    decode_path: str = ""
    depth: int = 0
    active: list[dict] = field(default_factory=list)
    queued: dict[str, int] = field(default_factory=dict)
    tokens_total: int = 0
    prefill_tokens_total: int = 0
    prefix_cache: dict = field(default_factory=dict)
    recent_tokens_per_s: float = 0.0
    steps_total: int = 0
    last_step_at: float = 0.0
    seats: dict[str, dict] = field(default_factory=dict)
    governor: dict = field(default_factory=dict)
    shedding: tuple[bool, float] = (False, 0.0)
    memory: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)  # Tallies.to_dict(): counters and latency histograms
    # The engine step (worker._step): StepUse.to_dict() with the budget, and the prefill
    # queue: prompts being prefilled, in the order their chunks go, with tokens left.
    step: dict = field(default_factory=dict)
    # Start-up warm-up (daemon/warmup.py): per stage, its seconds; empty until it ran.
    warmup: dict = field(default_factory=dict)
    # While the weights are read: {"percent", "bytes_loaded", "bytes_total", "seconds"}.
    load_progress: dict = field(default_factory=dict)
    # Serving tensor-parallel (daemon/distributed/): size, backend, each rank's host and memory.
    group: dict = field(default_factory=dict)


class InjectedFault(RuntimeError):
    """Raised by the debug_fail_after_tokens fault injection (config.py)."""


def _fail_after(gen, limit: int):
    """Pass decode steps through until ``limit`` tokens were committed, then raise from the
    next cycle, as a model failing mid-decode would. Test-only (debug_fail_after_tokens)."""
    n = 0
    try:
        for step in gen:
            yield step
            n += len(step.tokens)
            if n >= limit:
                raise InjectedFault(f"injected fault after {n} tokens (debug_fail_after_tokens = {limit})")
    finally:
        gen.close()


class EngineWorker(threading.Thread):
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

        Intake(self.commands, self._ready, self.lm, self.max_prompt_tokens, Submit, chat=self.cfg.chat).start()
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

    def _load(self) -> None:
        from .engine.loading import load_model
        from .logs import route_library_logs

        route_library_logs()
        t0 = time.perf_counter()
        self.lm = load_model(self.model_path, compile_decode=self.cfg.compile_decode, progress=self._load_progress,
                             group=self.group)
        context = self._prompt_limit()
        log.info("model.loaded", path=str(self.lm.path), model_type=self.lm.model_type,
                 decode_path=self.lm.decode_path, seconds=round(time.perf_counter() - t0, 3),
                 context_tokens=context, max_prompt_tokens=self.max_prompt_tokens)
        from .head_slot import HeadSlot

        self.slot = HeadSlot(self.lm, self.cfg.speculation.depth, on_change=self._head_changed)
        if self.cfg.speculation.mode != "off" or self.cfg.speculation.load_head:
            self.slot.load_at_startup(keep=self.cfg.speculation.load_head)
            if self.slot.error is not None:
                with self.snapshot_lock:
                    self.snapshot.head_error = self.slot.error
        self.verify_exact = True
        from .probe_verdicts import verdicts_for

        self.verdicts = verdicts_for(self.lm, self.group)
        if self.slot.available:
            self._probe_exactness()
        self.batch = None
        self.prefix_cache = None
        if self.cfg.prefix_cache.enabled:
            self._open_prefix_cache(self.cfg.scheduler.prefill_chunk)
        # Whether the continuous batch speculates (engine/batch_spec.py) or decodes at depth 0.
        self.batch_speculates = False
        if self.cfg.scheduler.batching:
            from .engine.batch import BatchDecoder, batch_matches_serial
            from .engine.exactness import ragged_verify_matches_serial

            t0 = time.perf_counter()
            spec = self.cfg.speculation
            rows = self.cfg.scheduler.max_active
            # Both verdicts are cached across starts (probe_verdicts.py), like the verify's.
            exact_ok, verdict = self.verdicts.get("batch", str(rows), lambda: batch_matches_serial(self.lm, rows))
            if spec.in_batch and spec.mode != "off" and self.slot.available and self.group is None:
                from .engine.batch_spec import SpecBatchDecoder

                if exact_ok and self.verify_exact:
                    exact_ok, verdict = self.verdicts.get("ragged_verify", "3", lambda: ragged_verify_matches_serial(self.lm))
                else:
                    exact_ok = False
                slot = self.slot
                self.batch = SpecBatchDecoder(self.lm, head=lambda: slot.head, depth_for=slot.depth_for,
                                              max_rows=rows, exact_ok=exact_ok)
                self.batch_speculates = True
            else:
                self.batch = BatchDecoder(self.lm, max_rows=rows, exact_ok=exact_ok)
            log.info("batch.ready", rows=self.batch.max_rows, exact_rows_batch=self.batch.exact_ok, verdict=verdict,
                     speculates=self.batch_speculates, probe_ms=round((time.perf_counter() - t0) * 1000, 1))
        if self.cfg.governor_enabled:
            from .governance import Governance

            self.governance = Governance(self.slot, self.cfg.governor, self.lm.path, prefix_cache=self.prefix_cache,
                                         holding_head=self.requests_holding_head, trace=self.cfg.governor_trace)
            self.tuned_profile = self.governance.tuned_profile
        if self.group is None:  # a group warms up after its hello, once the ranks agree (lockstep.py)
            self._warm_up()
        # The first status answer already has every row (step, seats, memory): publish before
        # ready rather than at the step loop's first turn, which a status read can beat.
        self._publish()
        with self.snapshot_lock:
            self.snapshot.model = self.lm.name
            self.snapshot.model_type = self.lm.model_type
            self.snapshot.decode_path = self.lm.decode_path
            self.snapshot.ready = True

    def warmup_mode(self) -> str:
        """``warmup`` resolved on this machine: "full", "light" or "off"."""
        import mlx.core as mx

        from .warmup import resolve

        return resolve(self.cfg.warmup, mx.default_device() == mx.gpu)

    def _warm_up(self, level: str | None = None) -> None:
        """Run the shapes this daemon serves once before it is ready (daemon/warmup.py), after
        the start-up probes; ``warmup`` in the config says how much (``level``: rank 0's
        resolved mode, which the other ranks of a group adopt)."""
        from governor import load_config as load_governor_config

        from . import warmup

        level = level or self.warmup_mode()
        if level == "off":
            log.info("warmup.done", mode=level, seconds=0.0, stages={})
            return
        # Every rank of a group must run the same forwards: a rank's [governor] table is its
        # own (not in the group's fingerprint), so a group warms the default depths; and no
        # near-tie guard (its serial re-decisions depend on this rank's probe verdict).
        max_depth = load_governor_config({} if self.group is not None else self.cfg.governor).max_depth
        t0 = time.perf_counter()
        stages = warmup.run(
            level, self.lm, chunk=self.cfg.scheduler.prefill_chunk,
            head=self.slot.head if self.slot.resident else None,
            depths=list(range(1, max_depth + 1)),
            batch=self.batch, max_rows=self.cfg.scheduler.max_active,
            emit=lambda event, **fields: log.info(event, **fields),
            spec_options={"rollback": self.cfg.speculation.rollback, "pipeline": self._build_ahead(),
                          "guard_margin": None})
        seconds = round(time.perf_counter() - t0, 3)
        with self.snapshot_lock:
            self.snapshot.warmup = {"mode": level, "seconds": seconds, "stages": stages}
        log.info("warmup.done", mode=level, seconds=seconds, stages=stages)

    def _open_prefix_cache(self, chunk: int) -> None:
        """The prefix cache for this prefill chunk: whether off-grid splits are exact on this
        backend (checked now), and its disk tier under this model's and settings' key."""
        from .engine import prefix_disk
        from .engine.prefix_cache import PrefixCache, splits_agree
        from .paths import cache_dir

        pc_cfg = self.cfg.prefix_cache
        t0 = time.perf_counter()
        # Not probed in a tensor-parallel group: this runs before the ranks' hello compares
        # their settings, and a rank with another chunk would issue other forwards (other
        # collectives); off-grid snapshots then count as inexact, the safe answer.
        exact = splits_agree(self.lm, chunk) if self.group is None else False
        probe_ms = round((time.perf_counter() - t0) * 1000, 1)
        disk = None
        # Not in a tensor-parallel group: every rank must take the same hits, and a disk
        # (a write still queued on one rank, a file torn on another) cannot promise that.
        if pc_cfg.disk and self.group is None:
            try:
                root = Path(pc_cfg.disk_dir) if pc_cfg.disk_dir else cache_dir() / "prefix"
                fingerprint = prefix_disk.model_fingerprint(self.lm.path, prefix_disk.numerics_key(self.lm, chunk))
                disk = prefix_disk.DiskTier(root, fingerprint, pc_cfg.disk_max_bytes, log,
                                            ttl_s=pc_cfg.disk_ttl_s or None, min_free_bytes=pc_cfg.disk_min_free_bytes)
            except OSError as exc:  # an unusable folder: RAM only, never a failed start
                log.warning("prefix_cache.disk_unusable", path=str(pc_cfg.disk_dir), error=repr(exc))
        old = getattr(self, "prefix_cache", None)
        if old is not None and old.disk is not None:
            old.disk.close()
        self.prefix_cache = PrefixCache(pc_cfg.max_bytes, chunk, make_cache=self.lm.make_cache, disk=disk,
                                        splits_exact=exact)
        if self.governance is not None:
            self.governance.prefix_cache = self.prefix_cache
        log.info("prefix_cache.ready", chunk=chunk, splits_exact=exact, inexact_reuse=pc_cfg.inexact_reuse,
                 probe_ms=probe_ms, disk=None if disk is None else str(disk.dir),
                 disk_files=None if disk is None else len(disk.index))

    def _prompt_limit(self) -> int | None:
        """Set ``max_prompt_tokens`` from the model's context: the config may lower it, and
        raises it past the context only with max_prompt_tokens_beyond_context. Returns the
        context (None when the model's config does not say)."""
        context = getattr(self.lm.text_args, "max_position_embeddings", None)
        context = context if isinstance(context, int) and context > 0 else None
        configured = self.cfg.max_prompt_tokens
        if configured is None:
            self.max_prompt_tokens = context or 32768
        elif context is not None and configured > context and not self.cfg.max_prompt_tokens_beyond_context:
            self.max_prompt_tokens = context
            log.warning("config.clamped", key="max_prompt_tokens", configured=configured, used=context,
                        reason=f"the model's context is {context} tokens; set "
                               "max_prompt_tokens_beyond_context = true to allow longer prompts")
        else:
            self.max_prompt_tokens = configured
        return context

    def _load_progress(self, done: int, total: int, seconds: float) -> None:
        """One log event per ~5% of the weights read; the status snapshot and the service
        manager (EXTEND_TIMEOUT_USEC, through the hooks) hear of each."""
        percent = int(100 * done / total) if total else 100
        with self.snapshot_lock:
            last = self.snapshot.load_progress.get("percent", -1)
            self.snapshot.load_progress = {"percent": percent, "bytes_loaded": done, "bytes_total": total,
                                           "seconds": round(seconds, 2)}
        if percent == last:
            return
        log.info("model.load_progress", percent=percent, bytes_loaded=done, bytes_total=total,
                 seconds=round(seconds, 2))
        if self.hooks is not None and hasattr(self.hooks, "on_load_progress"):
            self.hooks.on_load_progress(percent)

    def _probe_exactness(self) -> None:
        """Whether a verify reproduces serial decode bit for bit on this backend, and so
        what exact temperature-0 requests get (engine/exactness.py)."""
        from .engine.exactness import verify_matches_serial
        from .engine.speculative import resolve_rollback

        spec = self.cfg.speculation
        rollback = resolve_rollback(spec.rollback)
        t0 = time.perf_counter()
        bit_identical, verdict = self.verdicts.get("verify", rollback, lambda: verify_matches_serial(self.lm, rollback))
        self.verify_exact = bit_identical and not self.cfg.debug_inexact_verify
        exact_decode = "speculate" if self.verify_exact else spec.exact_on_inexact_backend
        with self.snapshot_lock:
            self.snapshot.exact_decode = exact_decode
        log.info("speculation.exactness", verify_bit_identical=self.verify_exact, rollback=rollback,
                 forced_inexact=self.cfg.debug_inexact_verify, verdict=verdict,
                 exact_requests=exact_decode, near_tie_guard="off" if self.verify_exact else "on",
                 probe_ms=round((time.perf_counter() - t0) * 1000, 1),
                 reason=("a verify here computes what serial steps compute, bit for bit" if self.verify_exact else
                         "a verify here rounds differently from serial steps, so speculation cannot promise "
                         "serial's tokens at temperature 0: exact requests "
                         + ("decode serially" if exact_decode == "serial" else
                            "speculate with the near-tie guard, which bounds flips but cannot exclude them")))

    def _head_changed(self, resident: bool, nbytes: int) -> None:
        # Written at once rather than at the next publish: a status read right after a
        # head.loaded / head.evicted line shows it.
        with self.snapshot_lock:
            self.snapshot.head_resident = resident
            if resident:
                self.snapshot.head_bytes = nbytes

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

    # ------------------------------------------------------------------ commands
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

    # ------------------------------------------------------------------ decoding
    def _start(self, job: Job) -> None:
        """Begin an admitted job: its prompt's chunked prefill (engine/prefill.py), run one
        chunk per cycle by ``_advance``; its decode path is chosen when that ends."""
        from .engine.prefill import ChunkedPrefill
        from .engine.sampling import Sampler
        from .engine.types import SamplingParams

        if job.generator is not None:  # back from parking: its state was kept
            if job.parked_state is not None:
                state, job.parked_state = job.parked_state, None
                self._rejoin_batch(job, state)
            return
        if job.prefill is not None:  # parked mid-prefill: it continues where it stopped
            return
        p = job.msg
        job.sampler = Sampler(SamplingParams(
            temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed,
            **{name: p.option(name) for name in m.SAMPLING_DEFAULTS}), prompt=job.prompt,
            constraint=job.constraint)
        job.mode = p.speculation or self.cfg.speculation.mode
        # Only "fast" accepts batch-height rounding flips; "exact" and "off" promise serial's
        # tokens at temperature 0 (BatchDecoder.admits knows whether this backend keeps them).
        job.exact = job.mode != "fast"
        if (job.mode == "exact" and job.sampler.greedy and not self.verify_exact
                and self.cfg.speculation.exact_on_inexact_backend == "serial"):
            job.mode = "off"  # this backend's verify rounds unlike serial steps: only serial is exact
        chunk = self.scheduler.cfg.prefill_chunk
        want_head = job.mode != "off" and self.slot.resident
        cache, history, start = None, None, 0
        pc = self.prefix_cache
        if pc is not None:
            if chunk != pc.chunk:  # SIGHUP changed it: exact snapshots are per chunk size
                self._open_prefix_cache(chunk)
                pc = self.prefix_cache
            # Inexact snapshots (engine/prefix_cache.py) only for requests that accept
            # near-tie flips, unless the operator allows them for all.
            allow_inexact = self.cfg.prefix_cache.inexact_reuse or job.mode == "fast"
            snap, start = pc.lookup(job.prompt, want_head, allow_inexact=allow_inexact)
            job.exact_chain = snap is None or snap.exact
            if snap is not None:
                cache, history = pc.restore(snap, job.prompt[start], self.slot.head if want_head else None)
            job.snapshot_at = pc.boundaries(len(job.prompt), start, job.segment_ends,
                                            fine=pc.splits_exact or allow_inexact)
        if history is None and want_head:
            from .engine.speculative import HeadHistory

            history = HeadHistory(self.slot.head)  # primed during prefill, in case it speculates
        job.cached_tokens = start
        job.started_at = time.monotonic()
        job.prefill = ChunkedPrefill(self.lm, job.prompt, chunk, cache if cache is not None else self.lm.make_cache(),
                                     history, start=start)

    def _begin_decode(self, job: Job) -> None:
        """The prefill is done: give the job its decode path, continuing from the prefilled
        cache: speculation when it runs alone, a row in the continuous batch when others
        run too (speculating there where the batch does, engine/batch_spec.py), else its
        own serial generator."""
        from .engine.serial import serial_decode

        pre, job.prefill = job.prefill, None
        job.decode_cache = pre.cache  # the decoder advances it in place: the continuation
        last = [pre.last_token]
        sampler, mode = job.sampler, job.mode
        # Interactive work is latency-bound: it decodes on its own (the scheduler's class
        # order gives it every forward first), speculating if it can, rather than sharing
        # each forward with background rows.
        latency_first = job.priority == "interactive"
        alone = len(self.scheduler.active) <= 1 or latency_first
        drafting = self._drafting_options()
        # Prompt lookup drafts at depth 0 too, and without a resident head (hybrid models).
        can_draft = self.slot.resident and self.slot.current_depth() > 0 or "lookup" in drafting
        speculate = mode != "off" and can_draft and alone
        if not speculate and self._batchable(job):
            if self.batch_speculates:
                history = pre.history if pre.history is not None and pre.history.head is self.slot.head else None
                self.batch.add(job.key, sampler, last, cache=pre.cache, history=history, exact=job.exact,
                               depth=self._row_depth(job))
                job.batched = True
                self._hand_solo_to_batch()
            else:
                self.batch.add(job.key, sampler, last, cache=pre.cache, exact=job.exact)
                job.batched = True
                mode = "off"
            job.start(self.batch.handle(job.key), CommittedText(self.lm.tokenizer, job.prompt), mode)
            return
        if mode != "off" and (self.slot.resident or "lookup" in drafting):
            from .engine.speculative import speculative_decode

            spec = self.cfg.speculation
            history = pre.history if pre.history is not None and pre.history.head is self.slot.head else None
            job.decode_history = history
            # The cache holds the prompt but its last token (prefilled in chunks, or restored
            # from the prefix cache); prompt lookup and the loop guard read the whole prompt.
            # Where the start-up probe proved verify bit-identical to serial steps, the
            # near-tie guard cannot change a token: exact mode runs without it (issue 18).
            job.handoff = False  # set to move this solo decode into the batch (_hand_solo_to_batch)
            gen = speculative_decode(self.lm, self.slot.head, last, sampler, depth=self._request_depth(job),
                                     exact=mode == "exact",
                                     guard_margin=None if self.verify_exact else spec.guard_margin,
                                     rollback=spec.rollback, cache=pre.cache, history=history,
                                     context=job.prompt,
                                     pipeline=self._build_ahead(), handoff=lambda: job.handoff, **drafting)
            job.solo_spec = True
        else:
            mode = "off"
            gen = serial_decode(self.lm, last, sampler, cache=pre.cache)
        if self.cfg.debug_fail_after_tokens is not None:  # fault injection, off by default
            gen = _fail_after(gen, self.cfg.debug_fail_after_tokens)
        job.start(gen, CommittedText(self.lm.tokenizer, job.prompt), mode)

    def _batchable(self, job: Job) -> bool:
        """Whether the job may decode as a row of the continuous batch."""
        return (job.priority != "interactive" and self.batch is not None and self.cfg.debug_fail_after_tokens is None
                and self.batch.admits(job.sampler, job.exact))

    def _row_depth(self, job: Job):
        """A batched row's own depth ceiling (the batch's depth is ``HeadSlot.depth_for``)."""
        if job.mode == "off":
            return lambda: 0
        request_depth = self._request_depth(job)
        return None if request_depth == self.slot.current_depth else request_depth

    def _rejoin_batch(self, job: Job, state: tuple) -> None:
        """A parked batch row comes back with the state ``extract`` gave it."""
        if self.batch_speculates:
            cache, primary, history = state
            self.batch.add(job.key, job.sampler, [primary], cache=cache, history=history, exact=job.exact,
                           depth=self._row_depth(job))
        else:
            cache, next_token = state
            self.batch.add(job.key, job.sampler, cache=cache, next_token=next_token, exact=job.exact)

    def _hand_solo_to_batch(self) -> None:
        """Others now decode in the speculating batch: move each running solo speculative
        decode that may batch into it at its cycle boundary (its generator hands back its
        cache, primary token and head history), so they all share one verify per cycle."""
        for job in list(self.scheduler.active):
            if not job.solo_spec or job.batched or job.generator is None:
                continue
            if not self._batchable(job) or len(self.batch) >= self.batch.max_rows:
                continue
            job.handoff = True
            try:
                step = next(job.generator)
            except StopIteration as done:
                job.solo_spec = False
                cache, primary, history = done.value
                self.batch.add(job.key, job.sampler, [primary], cache=cache, history=history, exact=job.exact,
                               depth=self._row_depth(job))
                job.batched = True
                job.generator = self.batch.handle(job.key)
                log.info("batch.joined", request_id=job.request_id, seat=job.seat, rows=len(self.batch),
                         completion_tokens=len(job.token_ids))
                continue
            except Exception as exc:
                self._failed(job, exc)
                continue
            job.handoff = False  # a cycle built ahead was running: it stays solo this time
            self._deliver(job, step)

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

    def _request_depth(self, job: Job):
        """The depth a request drafts at: the governor's, capped by the best depth `councild
        tune` measured at the request's sampling settings (when it measured them)."""
        from .profile import best_depth, sampling_entry

        p = job.msg
        entry = sampling_entry(self.tuned_profile, p.temperature, p.top_p, p.top_k)
        if entry is None:
            job.depth_ceiling = None
            return self.slot.current_depth
        ceiling = job.depth_ceiling = best_depth(entry)
        return lambda: min(self.slot.current_depth(), ceiling)

    def _drafting_options(self) -> dict:
        """speculative_decode's prompt-lookup, per-request-depth and loop-guard options."""
        from .engine.lookup import DraftStopConfig, LookupConfig
        from .engine.model import HYBRID_MTP_TYPES

        spec = self.cfg.speculation
        out: dict = {}
        if spec.prompt_lookup and self.lm.model_type in HYBRID_MTP_TYPES:  # rollback needs the hybrid cache
            out["lookup"] = LookupConfig(max_draft=spec.lookup_max_draft)
        # An operator's pinned depth is drafted in full; under the governor it is a ceiling.
        pinned = self.depth_pinned()
        if spec.draft_stop_threshold > 0 and not pinned:
            out["draft_stop"] = DraftStopConfig(threshold=spec.draft_stop_threshold)
        if spec.loop_guard:  # speculative_decode arms it for sampled requests only
            from .engine.loop_guard import LoopGuardConfig

            out["loop_guard"] = LoopGuardConfig()
        return out

    def _build_ahead(self) -> bool | None:
        """speculative_decode's ``pipeline``. Never in a group: whether a cycle is built ahead
        depends on this rank's wall-clock cycle time, so ranks could build (and run) their
        forwards' collectives in different graphs and orders; lockstep needs every rank to
        make the same choice, and only a fixed one is."""
        if self.group is not None:
            return False
        spec = self.cfg.speculation
        return None if spec.build_ahead == "auto" else spec.build_ahead

    def depth_pinned(self) -> bool:
        return self.governance is not None and self.governance.gov.state.override == "pin_depth"

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
                accepted_mask=[ok for s in rows for ok in s.accepted_mask], cycle_s=dt), batch=len(rows))
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

    def _keep_continuation(self, job: Job) -> None:
        """Store a finished request's state (its prompt and what it generated) for the
        seat's next turn, where a hit on it may be used (engine/prefix_cache.py)."""
        pc = self.prefix_cache
        if pc is None:
            return
        session = None if job.msg.session is m.UNSET else job.msg.session
        if session == "drop":
            n, freed = pc.forget_seat(job.seat)
            log.info("prefix_cache.session_dropped", request_id=job.request_id, seat=job.seat, snapshots=n,
                     freed_bytes=freed)
            return
        # Kept when a later request may use it (it is inexact unless splits are exact here),
        # or when the client asked.
        if not (session == "keep" or pc.splits_exact or self.cfg.prefix_cache.inexact_reuse) or not job.decoded:
            return
        try:
            cache, history = job.decode_cache, job.decode_history
            if job.batched:
                if self.batch is None or job.key not in self.batch:
                    return
                # BatchDecoder gives (cache, next token), the speculating batch (cache,
                # primary, head history): either cache holds a prefix of what was decoded.
                state = self.batch.extract(job.key)
                cache, history = state[0], (state[2] if len(state) == 3 else None)
            if cache is None:
                return
            snap = pc.store_final(job.prompt + job.decoded, cache, history, seat=job.seat)
            if snap is not None:
                log.info("prefix_cache.continuation", request_id=job.request_id, seat=job.seat,
                         tokens=len(snap.tokens), head=snap.head is not None, exact=snap.exact, bytes=snap.nbytes)
        except Exception as exc:  # noqa: BLE001 - a lost snapshot is a later miss, never a failed request
            log.warning("prefix_cache.continuation_failed", request_id=job.request_id, error=repr(exc))

    # ------------------------------------------------------------------ plumbing
    def _send(self, identity: bytes, msg, key: tuple[str, str] | None = None, terminal: bool = False) -> None:
        """Hand a message to the socket loop: [identity, payload, request key, terminal flag].
        The key (on every message of a request) lets the loop drop the chunks of a request
        it has cut; the flag marks the request's one terminal message."""
        k = b"" if key is None else f"{key[0]}\x00{key[1]}".encode()
        self._out.send_multipart([identity, encode(msg), k, b"T" if terminal else b""])

    def _count_tokens(self, seat: str, n: int) -> None:
        now = time.monotonic()
        self._seat_stats.count(seat, n)
        with self.snapshot_lock:
            self.snapshot.tokens_total += n
            self.snapshot.steps_total += 1
            self.snapshot.last_step_at = now

    def _publish(self) -> None:
        """Refresh what status readers see, at most every 100 ms (not per token)."""
        now = time.monotonic()
        if now - self._published_at < 0.1:
            return
        self._published_at = now
        import mlx.core as mx

        memory = {"active_bytes": mx.get_active_memory(), "cache_bytes": mx.get_cache_memory(),
                  "peak_bytes": mx.get_peak_memory()}
        stats = self._seat_stats
        busy = {job.seat for job in self.jobs.values()}
        stats.mark_busy(busy)
        stats.prune(busy)
        total_rate, per_seat = stats.rates()
        active = [
            {"request_id": j.request_id, "seat": j.seat, "priority": j.priority, "tokens": len(j.token_ids)}
            | ({"prefill": {"done": j.prefill.pos, "total": j.prefill.total}} if j.prefill is not None else {})
            | ({"batched": True, "depth": j.row_depth} if j.batched else {})
            for j in self.scheduler.active
        ]
        seats: dict[str, dict] = {}
        for job in self.jobs.values():
            s = seats.setdefault(job.seat, {"active": 0, "queued": 0, "tokens": 0})
            s["active" if job in self.scheduler.active else "queued"] += 1
        for seat, w in self.scheduler.waiting_by_seat().items():
            seats.setdefault(seat, {"active": 0, "queued": 0, "tokens": 0}).update(w)
        step = self.step_use.to_dict() | {
            "budget": self._step_budget(),
            "prefill_queue": [{"request_id": j.request_id, "seat": j.seat, "left": j.prefill_left,
                               "cached_tokens": j.cached_tokens} for j in self.scheduler.prefill_order(every_class=True)]}
        for seat, n in stats.totals.items():
            s = seats.setdefault(seat, {"active": 0, "queued": 0, "tokens": 0})
            s["tokens"] = n
            # Over the same last-10-seconds window as the daemon's total.
            s["tokens_per_s"] = per_seat.get(seat, 0.0)
        with self.snapshot_lock:
            self.snapshot.active = active
            self.snapshot.depth = self.slot.current_depth()
            self.snapshot.queued = {s: v["queued"] for s, v in seats.items() if v["queued"]}
            self.snapshot.recent_tokens_per_s = total_rate
            self.snapshot.seats = seats
            self.snapshot.memory = memory
            self.snapshot.stats = self.tallies.to_dict()
            self.snapshot.step = step
            if self.prefix_cache is not None:
                self.snapshot.prefix_cache = self.prefix_cache.stats()
            if self.governance is not None:
                self.snapshot.governor = self.governance.snapshot()
                self.snapshot.shedding = self.governance.shed

    def read_snapshot(self) -> EngineSnapshot:
        with self.snapshot_lock:
            snap = EngineSnapshot(**vars(self.snapshot))
        return snap
