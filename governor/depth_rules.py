"""The depth rules the solo depth (policy.py, stage 4) and the per-height depths
(height_policy.py, stage 5) share: what forces a depth, which depth a move heads for, how
a paired probe is judged, and the margin a change needs. Pure functions of their
arguments, as the policy is.

The margin is noise-aware (``margin_for``): a depth must score better than another by more
than the noise of the two estimates compared, measured live: the spread of each depth's
recent cycle costs (DepthEstimate.cost_rse) and the sampling noise of the acceptance
estimates behind E(k) (Observation.acceptance). With the noise n (the standard error of
log(score p / score b)) the margin is max(depth_margin_min, exp(depth_noise_z * n) - 1):
where cycles cost the same every time (a GPU) a 3% edge moves the depth, where they swing
(a contended CPU: one window's median is uncertain by 10%) only an edge that noise does not
explain does. Where no live measurement stands behind an estimate (a tuned profile, the
prior) its noise is unknown and the fixed ``depth_margin`` holds, as before.
"""

from __future__ import annotations

import math

from .config import GovernorConfig
from .cost_model import expected_tokens
from .types import CRITICAL, NORMAL, DepthEstimate, Observation, State


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


def _tokens_slope(acc: list[float], k: int, i: int) -> float:
    """dE(k) / da_i (positions 1-based): sum over j = i..k of prod_{l<=j, l != i} a_l."""
    total, run = 0.0, 1.0
    for j in range(1, min(k, len(acc)) + 1):
        run *= 1.0 if j == i else acc[j - 1]
        if j >= i:
            total += run
    return total


def tokens_ratio_var(acceptance: tuple[tuple[float, float], ...], p: int, b: int) -> float:
    """The variance of log(E(p) / E(b)) from the acceptance estimates' variances (the delta
    method). The positions both depths draft move both E alike and mostly cancel: what is
    left is chiefly the noise of the positions only the deeper one drafts."""
    acc = [a for a, _ in acceptance]
    ep, eb = expected_tokens(acc, p), expected_tokens(acc, b)
    var = 0.0
    for i, (_, v) in enumerate(acceptance[: max(p, b)], start=1):
        g = _tokens_slope(acc, p, i) / ep - _tokens_slope(acc, b, i) / eb
        var += g * g * v
    return var


def score_noise(ests: tuple[DepthEstimate, ...], acceptance: tuple[tuple[float, float], ...], p: int,
                b: int) -> float | None:
    """The standard error of log(score(p) / score(b)): both costs' relative standard errors
    (independent windows) and E(p) / E(b)'s; None when either cost's noise is unknown."""
    if not (0 <= p < len(ests) and 0 <= b < len(ests)):
        return None
    rp, rb = ests[p].cost_rse, ests[b].cost_rse
    if rp is None or rb is None:
        return None
    return math.sqrt(rp * rp + rb * rb + tokens_ratio_var(acceptance, p, b))


def margin_for(ests: tuple[DepthEstimate, ...], acceptance: tuple[tuple[float, float], ...], p: int, b: int,
               cfg: GovernorConfig) -> tuple[float, float | None]:
    """(margin, noise): depth p must score (1 + margin) x depth b's to win over it. With the
    noise measured: the larger of depth_margin_min and exp(depth_noise_z x noise) - 1 (the
    noise is on the log of the ratio); unknown (a profile or a prior on either side): the
    fixed depth_margin."""
    noise = score_noise(ests, acceptance, p, b)
    if noise is None:
        return cfg.depth_margin, None
    return max(cfg.depth_margin_min, math.expm1(cfg.depth_noise_z * noise)), noise


def move_toward(ests: tuple[DepthEstimate, ...], cur: int, cs: float, obs: Observation, cfg: GovernorConfig,
                acceptance: tuple[tuple[float, float], ...] = ()) -> tuple[int, float, int, float, float | None] | None:
    """(best depth, its score, the one step toward it, the margin it beat, the noise behind
    that margin) when a depth up to max_depth scores the margin (margin_for, best against
    ``cur``) better than ``cs`` at ``cur`` (ties go to the shallower depth); None when none
    does, or the step is deeper under memory pressure (more memory; lower is still fine)."""
    valid = [(e.score, k) for k, e in enumerate(ests) if e.score is not None and k <= cfg.max_depth]
    best_score, best = max(valid, key=lambda t: (t[0], -t[1]))
    if best == cur:
        return None
    margin, noise = margin_for(ests, acceptance, best, cur, cfg)
    if best_score < cs * (1 + margin):
        return None
    step = cur + (1 if best > cur else -1)
    if step > cur and obs.pressure != NORMAL:
        return None
    return best, best_score, step, margin, noise


def new_samples(now: int, at_start: int) -> int:
    """A depth's cycles since a probe started (a count below its start means the cost model
    started that depth afresh: what it holds now is all new)."""
    return now - at_start if now >= at_start else now


def clear_verdict(n_probed: int, n_back: int, sp: float | None, sb: float | None, margin: float,
                  cfg: GovernorConfig) -> bool:
    """A probe may end early: both depths have trust_samples new cycles and one scores twice
    the margin (margin_for, with the noise of these samples) better than the other."""
    clear = 1 + 2 * margin
    return (n_probed >= cfg.trust_samples and n_back >= cfg.trust_samples and sp is not None and sb is not None
            and (sp >= sb * clear or sb >= sp * clear))  # fmt: skip


def probed_depth_wins(probed: int, back: int, sp: float | None, sb: float | None, margin: float, obs: Observation,
                      cfg: GovernorConfig) -> bool:
    """A probe's verdict: the probed depth stays when it scores the margin (margin_for)
    better than the depth it was paired with, and is not a deeper one under memory pressure."""
    deeper_under_warn = probed > back and obs.pressure != NORMAL
    return sp is not None and sb is not None and sp >= sb * (1 + margin) and not deeper_under_warn


def margin_inputs(ests: tuple[DepthEstimate, ...], acceptance: tuple[tuple[float, float], ...], margin: float,
                  noise: float | None) -> dict:
    """What a depth decision's margin was made of, for the decision log (solo and per
    height): the margin, the noise of the scores' log ratio, each depth's cost noise and
    the acceptance's standard error per position, so a move or a refusal can be checked."""
    return {"margin": round(margin, 4), "noise": None if noise is None else round(noise, 4),
            "cost_rse": [None if e.cost_rse is None else round(e.cost_rse, 4) for e in ests],
            "acceptance_se": [round(v ** 0.5, 4) for _, v in acceptance]}  # fmt: skip


def fmt_margin(margin: float, noise: float | None) -> str:
    """For the decision's sentence: "margin 7% (noise 3%)", or "margin 10% (noise unknown)"."""
    return f"margin {margin:.0%} (noise {'unknown' if noise is None else format(noise, '.1%')})"
