"""What status readers see of the engine: the snapshot and its publishing.

The socket loop answers status requests from ``EngineSnapshot``, a copy the engine thread
refreshes at most every 100 ms (``EngineStatus.publish``) and the socket loop reads under
its lock (``read_snapshot``), so a status read never waits on, or touches, engine state.

``EngineStatus`` is a part of ``EngineWorker`` (worker.py) that owns the snapshot, its lock
and the seats' token rates; it is handed the scheduler, jobs, tallies and step use, and the
loaded engine (head slot, prefix cache, governance) once start-up built it (``attach``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from .seat_stats import SeatStats

if TYPE_CHECKING:
    from .loaded_engine import LoadedEngine
    from .prefill_pacer import PrefillPacer
    from .prefill_phase import PrefillPhase
    from .scheduler import Scheduler
    from .stats import StepUse, Tallies


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
    # "mlx", "invariant" or "mlx+qmm" (kernel_choice.py), and why.
    kernels: str = "mlx"
    kernels_reason: str = ""
    # The GatedDeltaNet conv and recurrence (LoadedModel.recurrence): "fused" (conv folded in),
    # "fused recurrence, conv in mlx ops: <why>" or "mlx-lm: <why not>".
    recurrence: str = ""
    linears: str = ""  # "merged N" or "separate: <why>" (LoadedModel.linears, merged_linears.py)
    decode_path: str = ""
    # "compiled" when batched steps and verifies (B >= 2) run the compiled forward, else
    # "eager: <why>" (engine/model/compiled.py; its batch self-check decides).
    batch_decode_path: str = ""
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
    # Start-up warm-up (daemon/engine_thread/warmup.py): per stage, its seconds; empty until it ran.
    warmup: dict = field(default_factory=dict)
    # The start-up parts that switch faster paths in after ready (warming.py): "pending" (in
    # order), "running", and per part done whether it switched in, why, and when ("at_s").
    warming: dict = field(default_factory=dict)
    # While the weights are read: {"percent", "bytes_loaded", "bytes_total", "seconds"}.
    load_progress: dict = field(default_factory=dict)
    # Serving tensor-parallel (daemon/distributed/): size, backend, each rank's host and memory.
    group: dict = field(default_factory=dict)
    # How many requests decode at once (rows_status): the limit, who sets it, and why.
    rows: dict = field(default_factory=dict)


class EngineStatus:
    """The snapshot and its publishing: ``publish``, ``read_snapshot``, ``count_tokens``,
    ``head_changed``."""

    def __init__(self, scheduler: Scheduler, jobs: dict, tallies: Tallies, step_use: StepUse,
                 step_budget: Callable[[], int], pacer: PrefillPacer):
        self.scheduler = scheduler
        self.jobs = jobs
        self.tallies = tallies
        self.step_use = step_use
        self.pacer = pacer
        self.prefill_phase: PrefillPhase | None = None  # the worker's, once start-up built the engine
        self._step_budget = step_budget
        self.snapshot = EngineSnapshot()
        self.snapshot_lock = threading.Lock()
        self._seat_stats = SeatStats()
        self.published_at = 0.0
        self.engine: LoadedEngine | None = None

    def attach(self, engine: LoadedEngine) -> None:
        """The engine start-up built: publishing reads its head slot, prefix cache and governance."""
        self.engine = engine

    def count_tokens(self, seat: str, n: int) -> None:
        now = time.monotonic()
        self._seat_stats.count(seat, n)
        with self.snapshot_lock:
            self.snapshot.tokens_total += n
            self.snapshot.steps_total += 1
            self.snapshot.last_step_at = now

    def first_token(self, seat: str, seconds: float) -> None:
        self._seat_stats.first_token(seat, seconds)

    def publish(self) -> None:
        """Refresh what status readers see, at most every 100 ms (not per token)."""
        now = time.monotonic()
        if now - self.published_at < 0.1:
            return
        self.published_at = now
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
            "pacing": self.pacer.to_dict(),
            "together": self.prefill_phase.to_dict() if self.prefill_phase is not None else None,
            "mixed": self.prefill_phase.mixed_dict() if self.prefill_phase is not None else None,
            "prefill_queue": [{"request_id": j.request_id, "seat": j.seat, "left": j.prefill_left,
                               "cached_tokens": j.cached_tokens} for j in self.scheduler.prefill_order(every_class=True)]}
        cycles = self.batch_cycles()
        if cycles is not None:
            step["batch_cycles"] = cycles
        for seat, n in stats.totals.items():
            s = seats.setdefault(seat, {"active": 0, "queued": 0, "tokens": 0})
            s["tokens"] = n
            # Over the same last-10-seconds window as the daemon's total.
            s["tokens_per_s"] = per_seat.get(seat, 0.0)
            if seat in stats.ttft_s:
                s["ttft_s"] = round(stats.ttft_s[seat], 4)
        with self.snapshot_lock:
            self.snapshot.active = active
            self.snapshot.depth = self.engine.slot.current_depth()
            self.snapshot.queued = {s: v["queued"] for s, v in seats.items() if v["queued"]}
            self.snapshot.recent_tokens_per_s = total_rate
            self.snapshot.seats = seats
            self.snapshot.memory = memory
            self.snapshot.stats = self.tallies.to_dict()
            self.snapshot.step = step
            if self.engine.prefix_cache is not None:
                self.snapshot.prefix_cache = self.engine.prefix_cache.stats()
            if self.engine.governance is not None:
                self.snapshot.governor = self.engine.governance.snapshot()
                self.snapshot.shedding = self.engine.governance.shed
            self.snapshot.rows = self.rows_status()

    def batch_cycles(self) -> dict | None:
        """The speculating batch's cycles since start: all, those queued ahead of the host's
        read of the one before (depth 0; drafting, engine/decoders/batch_ahead.py), those
        undone (a row joined or left before they were read, or a lookup cycle came), and the
        lookup cycles with the blocks' tokens drafted and accepted. None: no speculating batch."""
        if self.engine is None or not self.engine.batch_speculates:
            return None
        st = self.engine.batch.stats
        return {"cycles": st.cycles, "depth0_ahead": st.ahead_used, "depth0_undone": st.ahead_undone,
                "drafting_ahead": st.spec_ahead_used, "drafting_undone": st.spec_ahead_undone,
                "lookup": st.lookup_cycles, "lookup_drafted": st.lookup_drafted, "lookup_accepted": st.lookup_accepted}

    def rows_status(self) -> dict:
        """How many requests decode at once: ``limit`` (the scheduler's, now), ``mode``
        ("auto": the governor's, up to ``ceiling``; "pinned": scheduler.max_active), the
        governor's last ``decision`` and ``why`` in a sentence, ``active`` and ``waiting``."""
        sched, gov = self.scheduler, self.engine.governance if self.engine is not None else None
        cfg = sched.cfg
        out = {"limit": sched.max_active, "mode": "auto" if cfg.height_auto else "pinned",
               "ceiling": cfg.max_active_ceiling if cfg.height_auto else None,
               "active": len(sched.active), "waiting": sched.queued_count(), "decision": None, "why": None}
        if not cfg.height_auto:
            out["why"] = f"pinned by scheduler.max_active = {cfg.max_active}"
        elif gov is None or gov.gov.rows()["ceiling"] is None:
            out["why"] = (f"the start height {sched.max_active}: no governor to move it"
                          + (" (a tensor-parallel group)" if gov is not None else ""))
        else:
            r = gov.gov.rows()
            out["decision"], out["why"] = r["decision"], r["why"] or f"{sched.max_active} to start, until the governor's first look"
        return out

    def count_prefilled(self, tokens: int) -> None:
        with self.snapshot_lock:
            self.snapshot.prefill_tokens_total += tokens

    def read_snapshot(self) -> EngineSnapshot:
        with self.snapshot_lock:
            snap = EngineSnapshot(**vars(self.snapshot))
        return snap

    def head_changed(self, resident: bool, nbytes: int) -> None:
        # Written at once rather than at the next publish: a status read right after a
        # head.loaded / head.evicted line shows it.
        with self.snapshot_lock:
            self.snapshot.head_resident = resident
            if resident:
                self.snapshot.head_bytes = nbytes
