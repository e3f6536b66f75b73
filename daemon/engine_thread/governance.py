"""The daemon's side of the governor: build it, tick it, apply what it decides.

Everything here runs on the engine thread between decode cycles (the safe points). What the
governor changes lives in the head slot (head_slot.py: depth, residency, the background
load) and the prefix cache; both are handed in, so governance never holds the worker.
"""

from __future__ import annotations

import time
from typing import Callable

import mlx.core as mx
from msgspec.structs import replace

from governor import (
    ClearCache,
    CycleTelemetry,
    EvictHead,
    Governor,
    LimitPromptCache,
    LoadHead,
    LoadTracker,
    MlxMemoryProbe,
    SetDepth,
    SetHeightDepth,
    SetMaxActive,
    ShedAdmissions,
    default_memory_probes,
    load_config,
)

from .head_slot import HeadSlot
from .learned_profile import LearnedSaver, load_learned, merged
from .profile import governor_profile, load_profile
from ..logs import get_logger

log = get_logger("councild.governor")


def _recommended_working_set() -> int | None:
    try:
        return mx.device_info().get("max_recommended_working_set_size")
    except Exception:
        return None


class Governance:
    """Ticks the governor at the engine's safe points and applies its decisions to the head
    slot (depth, residency) and to the prompt caches. It holds those two, not the worker."""

    def __init__(self, slot: HeadSlot, table: dict, model_path, *, prefix_cache=None,
                 holding_head: Callable[[], int] = lambda: 0, trace: str | None = None, learn: bool = True):
        self.slot = slot
        self.prefix_cache = prefix_cache
        # How many requests hold the head now (reported when it is evicted under them).
        self._holding_head = holding_head
        self.cfg = load_config(table)
        self.load = LoadTracker(tau_s=self.cfg.arrival_tau_s)
        # Start from this machine's tuned profile (`councild tune`) and what its last run
        # learned (learned_profile.py) when they match the model and versions; otherwise from
        # the config's priors. The worker also reads the tuned one: it caps each request's
        # depth by its sampling settings' tuned best depth. A rank of a tensor-parallel group
        # (learn=False) neither reads nor writes the learned one: its costs are the group's.
        self.tuned_profile = load_profile(model_path)
        learned = load_learned(model_path) if learn else None
        self.gov = Governor(
            self.cfg,
            clock=time.monotonic,
            memory_probes=default_memory_probes(self.cfg),
            mlx_probe=MlxMemoryProbe(mx.get_active_memory, mx.get_cache_memory, mx.get_peak_memory,
                                     _recommended_working_set),
            load=self.load,
            profile=merged(governor_profile(self.tuned_profile), learned),
            head_available=slot.available,
            head_resident=slot.resident,
            head_bytes=slot.nbytes,
            initial_depth=slot.depth,
            trace=trace,
        )
        self.next_tick = 0.0
        # Buckets of batch heights given a tick at their first measurement (safe_point): each once.
        self._early_ticked: set[int] = set()
        self.saver = LearnedSaver(self.gov.learned, model_path) if learn else None
        # The cycle shapes (rows, depth, drafter) this process has decoded: a shape's first
        # cycle pays first-use costs (a trace, a kernel's first launch, first allocations)
        # that its later cycles do not, so its cost is not booked (the cycle's acceptance is).
        self._shapes_seen: set[tuple[int, int, str]] = set()
        # Shedding is read by the socket thread: a (on, retry_after) tuple swaps atomically.
        self.shed: tuple[bool, float] = (False, 0.0)
        slot.depth = self.gov.depth
        slot.height_depths = self._height_depths()
        # How many requests decode at once (attach_rows): the scheduler's setter, while the
        # config leaves the limit to the governor.
        self._set_max_active: Callable[[int], None] | None = None

    # ------------------------------------------------------------------ inputs
    def after_step(self, step, batch: int = 1) -> None:
        """Every decode cycle: a batched one (``batch`` rows) feeds cost(B, k) of its height's
        bucket and its rows' acceptance; a solo one the solo depth's cost. The first cycle of
        each shape (height, depth, draft source) is a transition: first use (on a GPU the step
        compiles and plans per shape; everywhere its first allocations) is not booked as a steady
        cost, so neither the depth policy nor the row limit's probe of a new height judges it."""
        t = CycleTelemetry.from_step(step, batch=batch)
        shape = (t.batch, t.depth, t.source)
        if shape not in self._shapes_seen:
            self._shapes_seen.add(shape)
            t = replace(t, transition=True)
        self.gov.record_cycle(t)

    def attach_rows(self, scheduler_cfg, set_max_active: Callable[[int], None], row_cache_bytes: int,
                    limit: int) -> None:
        """The scheduler's live limit becomes the governor's where the config says "auto"
        (governor/row_limit.py): ``set_max_active`` applies its SetMaxActive; one row's
        caches at its context are ``row_cache_bytes``; ``limit`` is the scheduler's now."""
        self._set_max_active = set_max_active
        self.gov.note_rows(row_cache_bytes=row_cache_bytes, row_limit=limit)
        self.note_scheduler(scheduler_cfg)

    def note_scheduler(self, scheduler_cfg) -> None:
        """New scheduler settings (start-up, SIGHUP): the ceiling the governor may reach, or 0
        where an int pins max_active (the governor then leaves the limit alone)."""
        auto = self._set_max_active is not None and scheduler_cfg.height_auto
        self.gov.note_rows(row_ceiling=scheduler_cfg.max_active_ceiling if auto else 0)
        if not auto:
            self.gov.state = replace(self.gov.state, row_limit=None, row_probe_from=None)

    def update_rows(self, active: int, waiting: int, limit: int) -> None:
        """Every loop turn: requests holding a slot, those waiting for one (queued or
        parked), and the limit the scheduler applies now."""
        self.gov.note_rows(rows_active=active, rows_waiting=waiting, row_limit=limit)

    def _height_depths(self) -> tuple[int | None, ...]:
        return tuple(h.depth for h in self.gov.state.heights)

    def on_arrival(self) -> None:
        self.load.record_arrival(time.monotonic())

    def update_load(self, active: int, queued: dict[str, int]) -> None:
        # The governor's "several streams: depth 0" rule is about streams decoded together
        # in one batched forward. The step loop time-slices its active requests, each with
        # its own cycles, so at most one stream shares a forward: speculation still pays
        # per stream, and contention shows up in the measured cycle cost instead.
        self.load.set_active(min(active, 1))
        for seat, n in queued.items():
            self.load.set_queued(seat, n)

    # ------------------------------------------------------------------ safe point
    def safe_point(self) -> None:
        """Called by the step loop between cycles."""
        self._finish_load()
        now = time.monotonic()
        if self.prefix_cache is not None:
            self.gov.note_prompt_cache(self.prefix_cache.nbytes)
        # A bucket's first measurement ticks at once, not at the next tick_s: its batches run
        # at a borrowed depth until that decision. Once per bucket: a bucket the policy leaves
        # unchosen (no usable head, say) must not tick every cycle.
        first = self.gov.first_measurements() - self._early_ticked
        if now >= self.next_tick or first:
            self._early_ticked |= first
            self.next_tick = now + self.cfg.tick_s
            self.apply(self.gov.tick())
            if self.saver is not None:
                self.saver.maybe_save(self.gov.cost.decode_s)

    def override(self, action: str, depth: int | None) -> tuple[bool, str]:
        """Apply an operator command; the reply says in words what now holds."""
        if action == "pin_depth" and depth is not None and depth > self.cfg.max_depth:
            # Refused rather than clamped: an operator who asked for 9 and silently got 4
            # would misread every measurement taken under the pin.
            return False, (f"depth {depth} is above governor.max_depth = {self.cfg.max_depth}; "
                           f"pin a depth from 0 to {self.cfg.max_depth} (or raise max_depth in the config)")
        before = (self.gov.depth, self.slot.resident)
        try:
            actions = self.gov.override(action, depth)
        except ValueError as exc:
            return False, str(exc)
        self.apply(actions)
        return True, describe_override(action, depth, actions, before, self.gov.depth)

    def apply(self, actions) -> None:
        for action in actions:
            if isinstance(action, SetDepth):
                self.slot.depth = action.depth
            elif isinstance(action, SetHeightDepth):
                # The whole table, as the governor holds it now (one action per bucket changed).
                self.slot.height_depths = self._height_depths()
            elif isinstance(action, EvictHead):
                self._evict()
            elif isinstance(action, LoadHead):
                self._start_load()
            elif isinstance(action, ShedAdmissions):
                self.shed = (action.on, action.retry_after_s)
            elif isinstance(action, ClearCache):
                mx.clear_cache()
            elif isinstance(action, LimitPromptCache):
                self._limit_prompt_cache(action.max_bytes)
            elif isinstance(action, SetMaxActive) and self._set_max_active is not None:
                self._set_max_active(action.rows)

    # ------------------------------------------------------------------ prompt caches
    def _limit_prompt_cache(self, max_bytes: int | None) -> None:
        """Cap the prefix cache (oldest snapshots go first), each one logged; None lifts
        the cap."""
        pc = self.prefix_cache
        if pc is None:
            return
        held = pc.nbytes
        before = mx.get_active_memory()
        dropped = pc.set_limit(max_bytes)
        for nbytes, tokens in dropped:
            log.info("prefix_cache.evicted", bytes=nbytes, tokens=tokens, reason="governor",
                     limit_bytes=max_bytes, held_bytes=held)
            held -= nbytes
        if dropped:
            mx.clear_cache()
        log.info("prefix_cache.limit", limit_bytes=max_bytes, budget_bytes=pc.budget, held_bytes=pc.nbytes,
                 dropped=len(dropped), freed_bytes=before - mx.get_active_memory())
        self.gov.note_prompt_cache(pc.nbytes)

    # ------------------------------------------------------------------ head residency
    def _evict(self) -> None:
        t0 = time.perf_counter()
        holding = self._holding_head()
        evicted = self.slot.evict()
        if evicted is None:
            return
        nbytes, freed = evicted
        self.gov.note_head(resident=False)
        log.info("head.evicted", bytes=nbytes, freed_bytes=freed, ms=round((time.perf_counter() - t0) * 1000, 1),
                 requests_going_serial=holding)

    def _start_load(self) -> None:
        if self.slot.start_load():
            self.gov.note_head(loading=True)

    def _finish_load(self) -> None:
        done = self.slot.finish_load()
        if done is None:
            return
        if done.error is not None:
            self.gov.note_head(loading=False, resident=False)
            log.error("head.load_failed", error=repr(done.error), ms=done.ms)
            return
        head = done.head
        self.gov.note_head(loading=False, resident=True, head_bytes=head.nbytes)
        log.info("head.loaded", bytes=head.nbytes, ms=done.ms, source=getattr(head, "source", "?"), reason="governor")

    def reconfigure(self, table: dict) -> None:
        """New [governor] settings from a SIGHUP, applied between cycles. The table was
        validated by the socket loop before it was sent here."""
        cfg = load_config(table)
        changed = self.gov.reconfigure(cfg, memory_probes=default_memory_probes(cfg))
        self.slot.height_depths = self._height_depths()  # a new max_depth restarts the table
        self.cfg = cfg
        self.load.tau_s = cfg.arrival_tau_s
        log.info("governor.reconfigured", changed=changed)

    def snapshot(self) -> dict:
        snap = self.gov.snapshot()
        snap["shedding"] = self.shed[0]
        return snap

    def close(self) -> None:
        """At the stop: what was learned goes to the cache folder; the trace is closed."""
        if self.saver is not None:
            self.saver.save(self.gov.cost.decode_s)
        self.gov.close()


def describe_override(action: str, depth: int | None, actions, before: tuple[int, bool], depth_now: int) -> str:
    """An operator's reply in words: what the command set, and what it changed now."""
    was_depth, head_was = before
    said = {
        "pin_depth": f"depth pinned to {depth}" + (" (speculation off)" if depth == 0 else ""),
        "evict_head": "head eviction forced: the head stays out until `auto`",
        "load_head": "head load forced: the head stays in until `auto`",
        "auto": "override released: the governor decides depth and head again",
    }.get(action, action)
    changes = []
    for a in actions:
        if isinstance(a, SetDepth) and a.depth != was_depth:
            changes.append(f"depth {was_depth} -> {a.depth}")
        elif isinstance(a, EvictHead) and head_was:
            changes.append("evicting the MTP head")
        elif isinstance(a, LoadHead) and not head_was:
            changes.append("loading the MTP head (it swaps in at the next safe point)")
        elif isinstance(a, ShedAdmissions):
            changes.append("shedding new requests" if a.on else "admitting new requests again")
    if not changes:
        changes.append(f"nothing had to change now (depth {depth_now}, head "
                       f"{'resident' if head_was else 'not resident'})")
    return f"{said}; " + ", ".join(changes)
