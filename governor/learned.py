"""What a governor learned on this machine, kept for the next start, and the start it gives.

A governor without a profile starts from the config's priors, and its first minutes on a
council are exploration: on this CPU the priors put heights 3-4 at depth 1-2, the first
round's batches speculated at low acceptance, and the policy reached depth 0 only 6-8 s
later, so a restart's first round ran at 0.44x the rounds after it. What it measured and
chose is the same on the next start of the same stack, model and device; the daemon keeps
it (daemon/engine_thread/learned_profile.py) and hands it back as a profile:

    {"cost_s": {...}, "acceptance": [...], "batch_cost_s": {...},   # CostModel.measured()
     "depths": {"1": 0, "2": 0, "4": 0}}                               # chosen, by bucket top

The costs become priors (never measurements: the first live cycles replace them); the
depths are where each bucket starts, as paired probes left it. Pure: no clock, no I/O.
"""

from __future__ import annotations

from typing import Any

from .config import GovernorConfig
from .cost_model import CostModel
from .heights import N_BUCKETS, bucket_label, bucket_of, bucket_top
from .types import NORMAL, HeightState, State


def settled(depth: int | None, probe_depth: int | None, probe_return: int | None) -> int | None:
    """The depth outside a probe (during one: the depth it returns to)."""
    return probe_return if probe_depth is not None else depth


def learned_table(cost: CostModel, state: State, pressure: str) -> dict[str, Any]:
    """``cost.measured()`` plus the depths chosen, by bucket top ("1" is the solo depth).
    Depths an operator pinned or pressure forced are no choice of the policy's and are left
    out, as are buckets not chosen yet."""
    out = cost.measured()
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


def start_heights(depths: dict[str, Any], cfg: GovernorConfig,
                  head_resident: bool) -> tuple[tuple[HeightState, ...], list[dict[str, Any]]]:
    """The height table a learned profile's depths give (clamped to ``max_depth``; 0 with no
    head resident), and one reason per bucket set, for the decision log."""
    table: list[HeightState] = [HeightState() for _ in range(N_BUCKETS - 1)]
    reasons = []
    for key, k in sorted(depths.items(), key=lambda kv: int(kv[0])):
        b = bucket_of(int(key))
        if b == 0:
            continue
        k = min(max(int(k), 0), cfg.max_depth) if head_resident else 0
        table[b - 1] = HeightState(depth=k)
        reasons.append({"decision": "height_start", "heights": bucket_label(b), "depth_to": k,
                        "sentence": f"batch heights {bucket_label(b)}: start at depth {k}, where this machine's "
                                    f"last run left them (learned profile)"})  # fmt: skip
    return (tuple(table) if reasons else ()), reasons


def learned_solo_depth(depths: dict[str, Any], cfg: GovernorConfig, head_resident: bool) -> int | None:
    """The solo depth a learned profile's depths give, or None where it has none."""
    if "1" not in depths:
        return None
    return min(max(int(depths["1"]), 0), cfg.max_depth) if head_resident else 0
