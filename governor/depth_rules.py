"""The depth rules the solo depth (policy.py, stage 4) and the per-height depths
(height_policy.py, stage 5) share: what forces a depth, which depth a move heads for, and
how a paired probe is judged. Pure functions of their arguments, as the policy is.
"""

from __future__ import annotations

from .config import GovernorConfig
from .types import CRITICAL, NORMAL, Observation, State


def forced_depth(s: State, obs: Observation, cfg: GovernorConfig) -> tuple[int | None, str] | None:
    """(depth, why) the operator or memory pressure forces: a pin (capped at max_depth; one
    above 0 only with a usable head), 0 for a forced eviction or critical pressure; (None,
    "head not resident") where no head is usable, for the caller to read (the solo depth is
    then 0, the height table holds); None: nothing forces it."""
    usable = bool(s.head_target) and obs.head_resident
    if s.override == "pin_depth" and s.pin_depth is not None:
        k = min(s.pin_depth, cfg.max_depth)
        if k == 0 or usable:
            return k, f"operator pinned depth {k}"
    if not usable:
        return None, "head not resident"
    if s.override == "force_evict":
        return 0, "operator override: force_evict"
    if obs.pressure == CRITICAL:
        return 0, "critical memory pressure"
    return None


def move_toward(scores, cur: int, cs: float, obs: Observation, cfg: GovernorConfig) -> tuple[int, float, int] | None:
    """(best depth, its score, the one step toward it) when a depth up to max_depth scores a
    ``depth_margin`` better than ``cs`` at ``cur`` (ties go to the shallower depth); None
    when none does, or the step is deeper under memory pressure (more memory; lower is
    still fine)."""
    valid = [(x, k) for k, x in enumerate(scores) if x is not None and k <= cfg.max_depth]
    best_score, best = max(valid, key=lambda t: (t[0], -t[1]))
    if best == cur or best_score < cs * (1 + cfg.depth_margin):
        return None
    step = cur + (1 if best > cur else -1)
    if step > cur and obs.pressure != NORMAL:
        return None
    return best, best_score, step


def new_samples(now: int, at_start: int) -> int:
    """A depth's cycles since a probe started (a count below its start means the cost model
    started that depth afresh: what it holds now is all new)."""
    return now - at_start if now >= at_start else now


def clear_verdict(n_probed: int, n_back: int, sp: float | None, sb: float | None, cfg: GovernorConfig) -> bool:
    """A probe may end early: both depths have trust_samples new cycles and one scores twice
    the margin better than the other."""
    clear = 1 + 2 * cfg.depth_margin
    return (n_probed >= cfg.trust_samples and n_back >= cfg.trust_samples and sp is not None and sb is not None
            and (sp >= sb * clear or sb >= sp * clear))  # fmt: skip


def probed_depth_wins(probed: int, back: int, sp: float | None, sb: float | None, obs: Observation,
                      cfg: GovernorConfig) -> bool:
    """A probe's verdict: the probed depth stays when it scores a margin better than the
    depth it was paired with, and is not a deeper one under memory pressure."""
    deeper_under_warn = probed > back and obs.pressure != NORMAL
    return sp is not None and sb is not None and sp >= sb * (1 + cfg.depth_margin) and not deeper_under_warn
