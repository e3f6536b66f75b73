"""What a governor learned on this machine, kept for the next start, and the start it gives.

A governor without a profile starts from the config's priors, and its first minutes on a
council are exploration: on this CPU the priors put heights 3-4 at depth 1-2, the first
round's batches speculated at low acceptance, and the policy reached depth 0 only 6-8 s
later, so a restart's first round ran at 0.44x the rounds after it. What it measured and
chose is the same on the next start of the same stack, model and device; the daemon keeps
it (daemon/engine_thread/learned_profile.py) and hands it back as a profile:

    {"cost_s": {...}, "acceptance": [...], "batch_cost_s": {...},   # CostModel.measured()
     "depths": {"1": 0, "2": 0, "4": 0},                               # chosen, by bucket top
     "lost": {"4": {"2": {"to": 0, "cost_s": 0.0012, "samples": 3, "age_s": 41.5}}},
     "rows": 7}                                                         # the row limit settled at

The costs become priors (never measurements: the first live cycles replace them); the
depths are where each bucket starts, as paired probes left it. ``lost`` keeps the probes'
verdicts by bucket top: each depth that lost a paired probe there, or that the bucket's
first decision left on its first few cycles, to which depth, its cost per row then and the
cycles behind it (``batch_cost_s`` keeps only costs with trust_samples cycles: a first
decision's loser has fewer, and the cost model starts a stale depth's window afresh), and
``age_s``, the bucket's decode seconds since. A restart seeds those costs as the profile's too (so the
depth is "profiled": no never-measured neighbour to probe at once, nor priced from priors
as the best depth: on the H200 both ran in a restart's first round) and keeps the verdicts,
ageing, until a probe in its turn (probe_interval_s) judges the depth again. A file without
``lost`` (written before it existed) loads as one with no verdicts. ``rows`` is the limit on
requests decoded at once (row_limit.py, ``max_active = "auto"``) where the last run settled:
a fresh governor starts at 4 and climbs one row per dwell, each new bucket of heights behind a
probe (an H100 council of 8: 4-5 rows in round 0, up to 7 after), so a restart would climb
again. The first tick starts there as far as the headroom holds those rows' caches
(row_limit.start_rows); the usual rules move it from there. Measured on H100s, a restart's
first round gained nothing beyond the spread from it (1.04x, 0.75-1.22x over 7 pairs,
bench/results/h100_2026-12-06i): the climb was not what that round pays; it is kept so that a
restart resumes the limit it had rather than probing its way back. Pure: no clock, no I/O.
"""

from __future__ import annotations

from typing import Any

from .config import GovernorConfig
from .cost_model import CostModel
from .heights import N_BUCKETS, bucket_label, bucket_of, bucket_top
from .types import NORMAL, HeightState, LostProbe, State


def settled(depth: int | None, probe_depth: int | None, probe_return: int | None) -> int | None:
    """The depth outside a probe (during one: the depth it returns to)."""
    return probe_return if probe_depth is not None else depth


def learned_table(cost: CostModel, state: State, pressure: str) -> dict[str, Any]:
    """``cost.measured()`` plus the depths chosen, by bucket top ("1" is the solo depth).
    Depths an operator pinned or pressure forced are no choice of the policy's and are left
    out, as are buckets not chosen yet."""
    out = cost.measured()
    out["lost"] = lost_table(state.heights, cost.batch_decode_s())
    rows = state.row_probe_from if state.row_probe_from is not None else state.row_limit
    if rows is not None and pressure == NORMAL:  # under pressure the limit was forced, not chosen
        out["rows"] = rows
    if state.override != "auto" or pressure != NORMAL:
        out["depths"] = {}
        return out
    depths = {"1": settled(state.depth, state.probe_depth, state.probe_return)}
    for b, h in enumerate(state.heights, start=1):
        k = settled(h.depth, h.probe_depth, h.probe_return)
        if k is not None:
            depths[str(bucket_top(b))] = k
    out["depths"] = depths
    return out


def lost_table(heights: tuple[HeightState, ...], clocks: tuple[float, ...]) -> dict[str, Any]:
    """The probes' verdicts by bucket top, then depth: ``{"4": {"2": {"to", "cost_s",
    "samples", "age_s"}}}``, ``age_s`` on the bucket's decode clock (``clocks``)."""
    out: dict[str, Any] = {}
    for b, h in enumerate(heights, start=1):
        clock = clocks[b - 1] if b - 1 < len(clocks) else 0.0
        by_depth = {str(v.depth): {"to": v.to, "cost_s": v.cost_s, "samples": v.samples,
                                   "age_s": round(max(clock - v.at_s, 0.0), 3)} for v in h.lost}  # fmt: skip
        if by_depth:
            out[str(bucket_top(b))] = by_depth
    return out


def lost_probes(lost: dict[str, Any], max_depth: int) -> dict[int, tuple[LostProbe, ...]]:
    """A learned profile's ``lost`` as verdicts by bucket (>= 1), dated before this start
    (``at_s`` = -age_s on the bucket's new decode clock); entries out of range or malformed
    are left out (a profile is a hint: a bad entry costs a probe, never the start)."""
    out: dict[int, tuple[LostProbe, ...]] = {}
    for key, by_depth in (lost or {}).items():
        try:
            b = bucket_of(int(key))
            got = tuple(LostProbe(depth=int(d), to=int(v["to"]), cost_s=float(v["cost_s"]), samples=int(v["samples"]),
                                  at_s=-max(float(v.get("age_s") or 0.0), 0.0))
                        for d, v in sorted(by_depth.items(), key=lambda kv: int(kv[0])))  # fmt: skip
        except (TypeError, ValueError, KeyError, AttributeError):
            continue
        got = tuple(v for v in got if 0 <= v.depth <= max_depth and 0 <= v.to <= max_depth and v.cost_s > 0)
        if b > 0 and got:
            out[b] = got
    return out


def start_heights(depths: dict[str, Any], cfg: GovernorConfig, head_resident: bool,
                  lost: dict[str, Any] | None = None) -> tuple[tuple[HeightState, ...], list[dict[str, Any]]]:
    """The height table a learned profile's depths give (clamped to ``max_depth``; 0 with no
    head resident), each bucket with the verdicts the profile kept (``lost``, so that the
    next save keeps them until a probe judges again), and one reason per bucket set, for
    the decision log."""
    verdicts = lost_probes(lost or {}, cfg.max_depth)
    table: list[HeightState] = [HeightState(lost=verdicts.get(b, ())) for b in range(1, N_BUCKETS)]
    reasons = []
    for key, k in sorted(depths.items(), key=lambda kv: int(kv[0])):
        b = bucket_of(int(key))
        if b == 0:
            continue
        k = min(max(int(k), 0), cfg.max_depth) if head_resident else 0
        table[b - 1] = HeightState(depth=k, lost=verdicts.get(b, ()), learned=True)
        n = len(verdicts.get(b, ()))
        kept = f"; {n} probe verdict{'s' if n != 1 else ''} kept, not probed again before their turn" if n else ""
        kept += "; depths it never measured here are probed in their turn, not at once"
        reasons.append({"decision": "height_start", "heights": bucket_label(b), "depth_to": k,
                        "lost": [v.depth for v in verdicts.get(b, ())],
                        "sentence": f"batch heights {bucket_label(b)}: start at depth {k}, where this machine's "
                                    f"last run left them (learned profile){kept}"})  # fmt: skip
    return (tuple(table) if reasons or verdicts else ()), reasons


def learned_solo_depth(depths: dict[str, Any], cfg: GovernorConfig, head_resident: bool) -> int | None:
    """The solo depth a learned profile's depths give, or None where it has none."""
    if "1" not in depths:
        return None
    return min(max(int(depths["1"]), 0), cfg.max_depth) if head_resident else 0


def learned_rows(profile: dict[str, Any] | None) -> int | None:
    """The row limit a learned profile kept (``rows``), or None: absent (a file from before it
    was kept, or a run whose limit was pinned or forced), or not a positive int (a hint: a bad
    value costs the climb, never the start)."""
    rows = (profile or {}).get("rows")
    return rows if isinstance(rows, int) and not isinstance(rows, bool) and rows >= 1 else None
