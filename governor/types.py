"""The governor's values: pressure levels, observations, state, actions, telemetry.

All are frozen msgspec Structs, so the policy cannot mutate what it is given and every
value serialises to JSON for the trace and the status reply as it is.
"""

from __future__ import annotations

from typing import Literal, Union

from msgspec import Struct

from .heights import bucket_label

Level = Literal["normal", "warn", "critical"]
NORMAL: Level = "normal"
WARN: Level = "warn"
CRITICAL: Level = "critical"
_RANK = {NORMAL: 0, WARN: 1, CRITICAL: 2}


def rank(level: Level) -> int:
    return _RANK[level]


def worst(levels) -> Level:
    """The most severe of ``levels`` (normal when empty: no signal is no alarm)."""
    out: Level = NORMAL
    for lv in levels:
        if _RANK[lv] > _RANK[out]:
            out = lv
    return out


# ---------------------------------------------------------------- telemetry in


class CycleTelemetry(Struct, frozen=True, kw_only=True):
    """One decode cycle, reported by the engine after it commits.

    ``accepted`` is the length of the accepted draft prefix (0..drafted); a serial step is
    depth=0, drafted=0, accepted=0, emitted=1. ``accepted_by_position`` may be given
    instead (True/False per drafted position); only its leading run of True counts.
    ``batch`` > 1 marks a batched cycle of that many rows (every row drafting ``depth``):
    the cost model learns its cost per row in that height's bucket, and each row's accepted
    prefix (``row_accepted``) in the one acceptance table.
    """

    depth: int
    cycle_s: float
    drafted: int = 0
    accepted: int = 0
    emitted: int = 1
    accepted_by_position: tuple[bool, ...] | None = None
    batch: int = 1
    # Who drafted: "head" (the MTP head; serial steps too) or "lookup" (a prompt-lookup
    # block: no head forward, a verify as wide as the block). Lookup cycles are kept apart,
    # so their cost and acceptance never stand in for a head depth's.
    source: str = "head"
    # A batched cycle's accepted prefix per row; None when unknown (a serial batch, or rows
    # that drafted unequal counts, so the concatenated mask cannot be split).
    row_accepted: tuple[int, ...] | None = None
    # The first cycle at its depth (a catch-up feed of queued head pairs, first-use costs,
    # a cycle built ahead and thrown away): its acceptance is learned, its cost is not.
    transition: bool = False

    @classmethod
    def from_step(cls, step, batch: int = 1) -> "CycleTelemetry":
        """From the engine's DecodeStep (duck-typed: depth, drafted, accepted, tokens,
        cycle_s, accepted_mask), so the governor needs no import of the daemon. A batched
        step's mask is the rows' masks concatenated (SHAPE.md): split into rows when every
        row drafted the batch's depth."""
        depth = int(getattr(step, "depth", 0))
        drafted = int(getattr(step, "drafted", 0))
        mask = list(getattr(step, "accepted_mask", None) or ())
        rows = None
        if batch > 1 and depth > 0 and drafted == batch * depth and len(mask) == drafted:
            rows = tuple(_leading_true(mask[r * depth:(r + 1) * depth]) for r in range(batch))
        return cls(
            depth=depth,
            cycle_s=float(step.cycle_s),
            drafted=drafted,
            accepted=int(getattr(step, "accepted", 0)),
            emitted=len(getattr(step, "tokens", ())) or 1,
            batch=batch,
            source=str(getattr(step, "draft_source", "head")),
            row_accepted=rows,
            transition=bool(getattr(step, "transition", False)),
        )

    def accepted_prefix(self) -> int:
        if self.accepted_by_position is None:
            return max(0, min(self.accepted, self.drafted))
        n = 0
        for ok in self.accepted_by_position:
            if not ok:
                break
            n += 1
        return min(n, self.drafted)


def _leading_true(flags) -> int:
    n = 0
    for ok in flags:
        if not ok:
            break
        n += 1
    return n


class DepthEstimate(Struct, frozen=True, kw_only=True):
    """The cost model's view of one depth. ``score`` is None when nothing is known."""

    depth: int
    expected_tokens: float
    cost_s: float | None
    score: float | None
    samples: int
    # "measured" (trusted data), "blend" (some data, shrunk to the prior), "profile"
    # (tuned profile), "prior" (config prior), or "none".
    source: str
    stale: bool
    # CPU load (per core) under which the cost was measured; None for priors.
    load_at: float | None = None
    # The relative standard error of cost_s, from the spread of the samples behind it
    # (cost_model.median_rse); None where no live cost stands behind it (a profile, a
    # prior). The policy's margin for a depth change grows with it (depth_rules.margin_for).
    cost_rse: float | None = None
    # A profile (tuned, or learned on this machine's last run) carries a cost for this depth
    # at this height: it was measured once, so it is no never-measured neighbour to probe at
    # once (height_policy._maybe_probe), only a stale one to probe in its turn.
    profiled: bool = False
    # The median of this depth's own recent samples alone (None without any): what a probe's
    # verdict keeps as the depth's cost (governor/learned.py), where ``cost_s`` is still
    # shrunk towards a prior (fewer than trust_samples samples).
    sample_cost_s: float | None = None


class LookupEstimate(Struct, frozen=True, kw_only=True):
    """Prompt-lookup cycles, measured apart from the head's depths: how many ran, their
    acceptance (accepted / drafted block tokens), tokens per cycle, median cycle cost, and
    tokens per second (None until a cycle has a cost)."""

    cycles: int
    drafted: int
    accepted: int
    acceptance: float
    tokens_per_cycle: float
    cost_s: float | None
    score: float | None


# ---------------------------------------------------------------- observation


class Observation(Struct, frozen=True, kw_only=True):
    """Everything the policy may look at in one tick, already sampled."""

    pressure: Level = NORMAL
    # Which signals said what, for the decision log ("psi some=12.0 -> warn; ...").
    pressure_detail: str = ""
    # Bytes that could be allocated now without pressure (min over the sources); None when
    # no probe knows.
    available_bytes: int | None = None
    # The model has an MTP head at all; it is resident; a load is in flight; its size.
    head_available: bool = True
    head_resident: bool = False
    head_loading: bool = False
    head_bytes: int = 0
    active_streams: int = 0
    queued: int = 0
    arrival_rate: float = 0.0
    cpu_load: float | None = None
    # Indexed by depth, 0..max_depth.
    estimates: tuple[DepthEstimate, ...] = ()
    # The decode clock: seconds the engine has spent decoding so far (the cost model's sum
    # of cycle times). Probe timing runs on it, so idle time between bursts does not make a
    # probe due; it stands still while nothing decodes.
    decode_s: float = 0.0
    # Bytes held by the daemon's prompt (prefix) caches: shed before the head.
    prompt_cache_bytes: int = 0
    # Prompt-lookup cycles (engine/decoders/lookup.py), apart from the head's estimates; None when
    # none has run.
    lookup: LookupEstimate | None = None
    # Batched cycles, per bucket of batch height (index b - 1 for bucket b >= 1 of
    # governor/heights.py): estimates by depth (cost per row), and each bucket's decode clock.
    batch_estimates: tuple[tuple[DepthEstimate, ...], ...] = ()
    batch_decode_s: tuple[float, ...] = ()
    # Per draft position 1..max_depth: (conditional acceptance, the variance of its
    # estimate) (CostModel.acceptance_noise); empty: not known, counted as no noise.
    acceptance: tuple[tuple[float, float], ...] = ()
    # How many requests decode at once (governor/row_limit.py), from the engine: requests
    # holding a slot now, those waiting for one (queued or parked), the limit the scheduler
    # applies now, the most it may be ("auto"'s max_active_ceiling; 0: the limit is pinned
    # by the config, or a trace from before the governor decided it: no decision), and the
    # bytes one row's caches take at the context a request may reach (0: not known).
    rows_active: int = 0
    rows_waiting: int = 0
    row_limit: int = 0
    row_ceiling: int = 0
    row_cache_bytes: int = 0


# ---------------------------------------------------------------- state


class LostProbe(Struct, frozen=True, kw_only=True):
    """A verdict against a depth in one bucket of batch heights (a paired probe's, or the
    bucket's first decision leaving the depth its batches ran at): ``depth`` lost to
    ``to``, its cost per row then (``samples`` cycles behind it, fewer than
    trust_samples possibly: the cost model keeps no such cost, this verdict keeps it), at
    ``at_s`` on the bucket's decode clock (negative: before this start, from a learned
    profile). A restart treats it as measured, so its first round does not probe it again."""

    depth: int
    to: int
    cost_s: float
    samples: int
    at_s: float


class HeightState(Struct, frozen=True, kw_only=True):
    """The depth chosen for one bucket of batch heights, and its probe; times of the probe
    are on that bucket's decode clock, ``last_change_at`` on the injected clock."""

    # None: not chosen yet (no measurement at this height): the batch runs at the solo depth.
    depth: int | None = None
    last_change_at: float | None = None
    probe_depth: int | None = None
    probe_return: int | None = None
    probe_started_s: float | None = None
    probe_samples_at: tuple[int, int] | None = None
    last_probe_s: float | None = None
    probe_count: int = 0
    # The bucket's decode clock at the last tick: the bucket decides only when it moved.
    seen_s: float | None = None
    # The depth of the last probe when it ran none of that depth's cycles (the engine did
    # not draft it), else None: until then the next probe waits for the probe interval.
    unmeasured: int | None = None
    # Depths that lost here (LostProbe: one verdict per depth, the latest): kept in the
    # learned profile (governor/learned.py); a later win of that depth drops its verdict.
    lost: tuple[LostProbe, ...] = ()
    # Started at a learned profile's depth (governor/learned.py): the last run on this machine
    # decoded at these heights and settled here, so a depth it never measured is explored in
    # its turn (probe_interval_s), not in a restart's first round.
    learned: bool = False

Override = Literal["auto", "pin_depth", "force_evict", "force_load"]


class State(Struct, frozen=True, kw_only=True):
    """What the governor remembers between ticks. Times are the injected clock's seconds,
    except the ``*_decode_s`` fields, which are on the decode clock (Observation.decode_s)."""

    depth: int = 0
    # Pressure seen on the previous tick (to act on entering critical).
    last_pressure: Level = NORMAL
    # What the governor last asked of the head; None until the first tick adopts reality.
    head_target: bool | None = None
    override: Override = "auto"
    pin_depth: int | None = None
    shedding: bool = False
    last_depth_change_at: float | None = None
    # Current warn episode: its start, and the last tick that was not normal.
    warn_since: float | None = None
    last_not_normal_at: float | None = None
    normal_since: float | None = None
    not_critical_since: float | None = None
    # Head resident and unused (depth 0) since.
    idle_since: float | None = None
    last_evict_at: float | None = None
    last_load_at: float | None = None
    last_clear_cache_at: float | None = None
    # A probe in flight: the neighbour being measured, where to go back, and until when
    # (decode clock: a probe measures probe_s seconds of decoding, however long that takes).
    probe_depth: int | None = None
    probe_return: int | None = None
    probe_until_decode_s: float | None = None
    # When the last probe started (decode clock): the next is due probe_interval_s later.
    last_probe_decode_s: float | None = None
    probe_count: int = 0
    # A paired probe alternates the probed and the return depth tick by tick; it ends once
    # both have this many more cost samples than they had at its start (probe_samples_at:
    # (probed, return)), so both medians come from the same seconds.
    probe_samples_at: tuple[int, int] | None = None
    probe_started_decode_s: float | None = None
    # The head is in on an optimistic trial (loaded without a predicted gain, to measure
    # depth 1 once); when trials last started or the head last left (decode clock); and
    # how many trials in a row found no gain (each doubles the wait, up to a cap).
    head_trial: bool = False
    last_trial_decode_s: float | None = None
    trial_failures: int = 0
    ticks: int = 0
    # The governor's cap on the prompt caches' bytes (None: their configured budget) and
    # when it last lowered it.
    prompt_cache_limit: int | None = None
    prompt_cache_shed_at: float | None = None
    # The depth per bucket of batch heights (index b - 1 for bucket b >= 1); ``depth`` is
    # the solo one (height 1).
    heights: tuple[HeightState, ...] = ()
    # How many requests decode at once (row_limit.py); None until the first tick adopts the
    # engine's. A probe of one more row: the limit it returns to, when it started (decode
    # clock), the probed bucket's cost samples and decode clock then. The last move
    # (injected clock), the last probe (decode clock), and the last decision and its
    # sentence (the status says why the limit is what it is).
    row_limit: int | None = None
    # The limit a learned profile says this machine's last run settled at (learned.py): the
    # first tick starts there instead of at the engine's, as far as the headroom holds.
    row_learned: int | None = None
    row_probe_from: int | None = None
    row_probe_started_s: float | None = None
    row_probe_samples_at: int | None = None
    row_probe_bucket_s: float | None = None
    row_changed_at: float | None = None
    row_last_probe_s: float | None = None
    row_decision: str = ""
    row_why: str = ""
    # The kind of blocker last logged ("ceiling", "headroom", ...; "" after a move): a
    # blocker is logged when it changes, not every tick.
    row_hold: str = ""


# ---------------------------------------------------------------- actions out


class SetDepth(Struct, frozen=True, tag=True):
    depth: int


class EvictHead(Struct, frozen=True, tag=True):
    pass


class LoadHead(Struct, frozen=True, tag=True):
    pass


class ShedAdmissions(Struct, frozen=True, tag=True):
    on: bool
    retry_after_s: float | None = None


class ClearCache(Struct, frozen=True, tag=True):
    pass


class LimitPromptCache(Struct, frozen=True, tag=True):
    """Cap the prompt caches at ``max_bytes`` (oldest go first); None lifts the cap."""

    max_bytes: int | None


class SetHeightDepth(Struct, frozen=True, tag=True):
    """Draft ``depth`` in batched cycles whose height falls in bucket ``bucket`` (>= 1,
    governor/heights.py); height 1 is SetDepth's."""

    bucket: int
    depth: int


class SetMaxActive(Struct, frozen=True, tag=True):
    """Decode at most ``rows`` requests at once (the scheduler's live limit). Lowering it
    drops no request: those above it finish, and no new one is admitted until below it."""

    rows: int


Action = Union[SetDepth, SetHeightDepth, EvictHead, LoadHead, ShedAdmissions, ClearCache, LimitPromptCache,
               SetMaxActive]


def action_name(a: Action) -> str:
    if isinstance(a, SetDepth):
        return f"SetDepth({a.depth})"
    if isinstance(a, SetHeightDepth):
        return f"SetHeightDepth({bucket_label(a.bucket)}: {a.depth})"
    if isinstance(a, ShedAdmissions):
        return f"ShedAdmissions({'on' if a.on else 'off'})"
    if isinstance(a, SetMaxActive):
        return f"SetMaxActive({a.rows})"
    if isinstance(a, LimitPromptCache):
        return f"LimitPromptCache({'none' if a.max_bytes is None else a.max_bytes})"
    return type(a).__name__
