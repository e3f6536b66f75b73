"""The depth per bucket of batch heights: stage 5 of ``policy.decide``, pure as the rest.

A batched cycle drafts one depth for all its rows and verifies rows x (depth + 1) positions
in one forward. What that costs depends on the height: on the H200 (27B shape) extra verify
positions are nearly free inside a batch of 4-8, so a batch speculates deeper than a solo
stream would; on this CPU the forward is compute-bound and every position costs, so a batch
should not speculate at all. Nothing here assumes either: each bucket (governor/heights.py)
learns cost(B, k) per row and picks

    argmax_k  E(k) / cost_per_row(B, k)      (the batch's tokens per second)

with the solo depth's rules: depth 0 the floor, a move only for a score better by the
noise-aware margin (depth_rules.margin_for), one step at a time (or straight to a stale
depth that looks best), a measured
neighbour re-probed every ``probe_interval_s`` of that bucket's decoding. Stricter than the
solo rules in one way: every move is the verdict of a paired probe (the two depths
alternating tick by tick, so both are measured over the same seconds), never a comparison
of medians taken at different moments. Each bucket decides only on ticks in which
it decoded (its clock moved): a bucket the council is not using now keeps its depth, so a
height that alternates (2, 3, 2, 3) finds each bucket where it left it, and no probe runs
in a bucket that is not running. A never-measured neighbour is probed at once: the prior
for another depth in a batch is the solo cost ratio, which is wrong both ways on real
machines (too high on a GPU, too low on this CPU), so it must not stand in for a look.

Until a bucket has its first measurement its depth is None: batches there run at the
nearest measured bucket's depth, else the solo depth (``heights.depth_at``). The first
decision does not adopt the depth they ran at on the strength of a cycle or two: it takes
the depth the cost model prices best from what it already knows (that measurement blended
with its prior, the other heights' measured cost ratios, the solo ratios, a profile), a
depth above 0 only where it beats depth 0 by ``depth_margin`` (priors carry no noise
estimate). On the H200 every bucket adopted depth 1 from its first batched cycles, each
carrying a first-use cost, then spent a paired probe per bucket finding depth 0 better.

Forced: an operator pin sets every height; critical pressure or a forced eviction sets 0;
no usable head holds the table (a batch without a head runs serially anyway).
"""

from __future__ import annotations

from typing import Any

from msgspec.structs import replace

from .config import GovernorConfig
from .depth_rules import (clear_verdict, fmt_margin, forced_depth, margin_for, margin_inputs, move_toward,
                          new_samples, probed_depth_wins)
from .heights import N_BUCKETS, bucket_label
from .learned import settled
from .types import NORMAL, DepthEstimate, HeightState, LostProbe, Observation, SetHeightDepth, State


def settled_depth(h: HeightState) -> int | None:
    """The bucket's depth outside a probe (during one: the depth it returns to)."""
    return settled(h.depth, h.probe_depth, h.probe_return)


def first_depth(ests: tuple[DepthEstimate, ...], ran: int, cfg: GovernorConfig) -> int:
    """A new bucket's first depth: the best-scored depth from 0 up to the one batches ran
    at, where a depth above 0 must beat depth 0 by ``depth_margin``; where depth 0 has no
    score yet (nothing to price it from), the depth batches ran at. Never above it: a depth
    no batch ran at is priced by priors alone, a reason to probe it, never to move there
    (the replay: a CPU-like batch adopted depth 3 on solo ratios and took 30 probes down)."""
    s0 = _score(ests, 0)
    if s0 is None:
        return ran
    best, best_s = 0, s0
    for e in ests[1 : min(ran, cfg.max_depth) + 1]:
        if e.score is not None and e.score > best_s and e.score >= s0 * (1 + cfg.depth_margin):
            best, best_s = e.depth, e.score
    return best


def _score(ests: tuple[DepthEstimate, ...], k: int) -> float | None:
    return ests[k].score if 0 <= k < len(ests) else None


def _fmt(x: float | None) -> str:
    return "?" if x is None else f"{x:.1f}"


class _Bucket:
    """One bucket's inputs for this tick, and how it speaks to the decision log."""

    def __init__(self, b: int, obs: Observation, out: Any, now: float):
        self.b, self.obs, self.out, self.now = b, obs, out, now
        self.label = bucket_label(b)
        self.ests = obs.batch_estimates[b - 1] if b - 1 < len(obs.batch_estimates) else ()
        self.clock = obs.batch_decode_s[b - 1] if b - 1 < len(obs.batch_decode_s) else 0.0

    def samples(self, k: int) -> int:
        return self.ests[k].samples if 0 <= k < len(self.ests) else 0

    def margin(self, p: int, b: int, cfg: GovernorConfig) -> tuple[float, float | None]:
        """The margin depth p needs over b at this height (depth_rules.margin_for)."""
        return margin_for(self.ests, self.obs.acceptance, p, b, cfg)

    def margin_inputs(self, margin: float, noise: float | None) -> dict[str, Any]:
        """depth_rules.margin_inputs at this height (scores and samples are logged by emit)."""
        return margin_inputs(self.ests, self.obs.acceptance, margin, noise)

    def emit(self, h: HeightState, k: int | None, decision: str, sentence: str, **inputs: Any) -> HeightState:
        """Log one decision about this bucket; with ``k`` not None, set its depth to k."""
        frm = h.depth
        action = SetHeightDepth(self.b, k) if k is not None and k != frm else None
        self.out.emit(action, decision, f"batch heights {self.label}: {sentence}", heights=self.label,
                      bucket_decode_s=round(self.clock, 3), depth_from=frm, depth_to=k if k is not None else frm,
                      scores=[None if e.score is None else round(e.score, 3) for e in self.ests],
                      samples=[e.samples for e in self.ests], **inputs)  # fmt: skip
        if action is None:
            return h
        return replace(h, depth=k, last_change_at=self.now)


_NO_PROBE = dict(probe_depth=None, probe_return=None, probe_started_s=None, probe_samples_at=None)


def decide_heights(s: State, obs: Observation, now: float, cfg: GovernorConfig, out: Any) -> State:
    hs = list(s.heights) + [HeightState() for _ in range(N_BUCKETS - 1 - len(s.heights))]
    forced = forced_depth(s, obs, cfg)  # (depth, why) every bucket takes; (None, why): hold the table
    for b in range(1, N_BUCKETS):
        bk = _Bucket(b, obs, out, now)
        h = hs[b - 1]
        if forced is not None:
            k, why = forced
            h = replace(h, **_NO_PROBE)
            if k is not None and k != h.depth:
                h = bk.emit(h, k, "height_depth", why)
        else:
            ran = h.seen_s is None or bk.clock > h.seen_s
            if ran and bk.ests:
                h = _decide_bucket(h, bk, obs, cfg)
        hs[b - 1] = replace(h, seen_s=bk.clock)
    return replace(s, heights=tuple(hs))


def _decide_bucket(h: HeightState, bk: _Bucket, obs: Observation, cfg: GovernorConfig) -> HeightState:
    ests = bk.ests
    if h.depth is None:
        measured = [e for e in ests if e.samples > 0 and not e.stale and e.depth <= cfg.max_depth]
        if not measured:
            return h
        ran = max(measured, key=lambda e: (e.samples, -e.depth)).depth
        k = first_depth(ests, ran, cfg)
        h = replace(h, last_probe_s=bk.clock)
        if k != ran:  # the depth batches ran at lost, on its first few cycles: kept as a verdict
            h = _verdict(h, bk, lost=ran, to=k)
        why = "the cost model's best" if k != ran else "also the cost model's best" if k else "the floor"
        return bk.emit(h, k, "height_adopt", f"first measurement (batches ran at depth {ran}): start at depth {k}, "
                                             f"{why}; this height's depth is its own now", depth_ran=ran)
    cur = h.depth
    if h.probe_depth is not None:
        return _probe_step(h, bk, obs, cfg)
    if h.last_change_at is not None and bk.now - h.last_change_at < cfg.depth_dwell_s:
        return h
    cs = _score(ests, cur)
    if cs is None or cur >= len(ests) or ests[cur].stale:
        return h
    move = move_toward(ests, cur, cs, obs, cfg, obs.acceptance)  # none: _maybe_probe (waits under warn)
    if move is not None:
        best, best_score, step, margin, noise = move
        why = f"depth {best} scores {_fmt(best_score)} vs {_fmt(cs)} at {cur} ({fmt_margin(margin, noise)})"
        mlog = bk.margin_inputs(margin, noise)
        if ests[best].stale and best != step and _may_probe(h, bk, best, cfg):
            return _probe(h, bk, best, f"{why}, but its estimate is stale: probe it against {cur}", **mlog)
        if (_score(ests, step) or 0.0) > cs and _may_probe(h, bk, step, cfg):
            # A move is a paired probe's verdict, never a comparison of medians taken at
            # other moments: on a contended CPU a bucket's cost swings 40% within seconds
            # (the replay: a batch of 2 stepped to a depth 30% worse on one such swing).
            return _probe(h, bk, step, f"{why}: probe depth {step} against {cur} (paired) before moving", **mlog)
    return _maybe_probe(h, bk, obs, cfg)


def _may_probe(h: HeightState, bk: _Bucket, n: int, cfg: GovernorConfig) -> bool:
    """After a probe that ran none of its depth's cycles (an engine that does not draft in
    this batch), the next only once probe_interval_s of this bucket's decoding passed: else
    such an engine is asked tick after tick."""
    return h.unmeasured is None or bk.clock - (h.last_probe_s or 0.0) >= cfg.probe_interval_s


def _probe(h: HeightState, bk: _Bucket, n: int, sentence: str, **inputs: Any) -> HeightState:
    h = replace(h, probe_depth=n, probe_return=h.depth, probe_started_s=bk.clock, last_probe_s=bk.clock,
                probe_samples_at=(bk.samples(n), bk.samples(h.depth or 0)), probe_count=h.probe_count + 1)  # fmt: skip
    return bk.emit(h, n, "height_probe", sentence, **inputs)


def _maybe_probe(h: HeightState, bk: _Bucket, obs: Observation, cfg: GovernorConfig) -> HeightState:
    """A neighbour this bucket never measured is probed at once (depth 0 always; another
    unless the bucket's own line, two measured depths (cost_model._batch_anchor), prices it
    more than the margin worse, or the bucket started at a learned profile's depth: the
    last run decoded here and settled, so that waits for its turn, probe_interval_s of this
    bucket's decoding); a measured one, or one a profile measured (a restart's first round
    must not pay the exploration again), when its estimate is stale and probe_interval_s
    of this bucket's decoding passed since the last."""
    if obs.pressure != NORMAL:
        return h
    cur = h.depth or 0
    sides = (cur + 1, cur - 1) if h.probe_count % 2 == 0 else (cur - 1, cur + 1)
    sides = tuple(n for n in sides if 0 <= n <= cfg.max_depth and n < len(bk.ests))
    measured = sum(1 for e in bk.ests if e.samples >= cfg.trust_samples)
    cs = _score(bk.ests, cur)
    # Never measured: the lower side first, and depth 0 always (the floor, no head forward:
    # the reference every bucket needs, and the cheapest look).
    for n in sorted(sides):
        sn = _score(bk.ests, n)
        priced_worse = (n > 0 and measured >= 2 and sn is not None and cs is not None
                        and sn * (1 + bk.margin(cur, n, cfg)[0]) < cs)  # fmt: skip
        not_yet = h.learned and n > 0 and bk.clock < cfg.probe_interval_s
        if (bk.ests[n].samples == 0 and not bk.ests[n].profiled and not priced_worse and not not_yet
                and _may_probe(h, bk, n, cfg)):
            return _probe(h, bk, n, f"depth {n} was never measured at this height: probe it against {cur}")
    last = h.last_probe_s if h.last_probe_s is not None else bk.clock
    if bk.clock - last < cfg.probe_interval_s:
        return h if h.last_probe_s is not None else replace(h, last_probe_s=bk.clock)
    for n in sides:
        if bk.ests[n].stale:
            return _probe(h, bk, n, f"depth {n}'s estimate is stale: measure it for {cfg.probe_s}s of decoding")
    return replace(h, last_probe_s=bk.clock)


def _probe_done(h: HeightState, bk: _Bucket, cfg: GovernorConfig, probed: int, back: int) -> bool:
    """As the solo probe's rule, on this bucket's clock: probe_s passed and both depths have
    cost_window new cycles, or probe_max_factor x probe_s at most; or, at any time, a clear
    verdict (both with trust_samples new cycles, 2x the margin apart). A batched cycle is
    several steps long (0.1 s on the H200 at 4-8 rows), so a window of 32 a side is seconds
    of a worse depth; neighbouring depths in a batch differ by 10-40% there, which the early
    verdict settles in 8 cycles a side."""
    ran = bk.clock - (h.probe_started_s if h.probe_started_s is not None else bk.clock)
    if ran >= cfg.probe_s * cfg.probe_max_factor:
        return True
    at = h.probe_samples_at or (0, 0)
    n_p, n_b = new_samples(bk.samples(probed), at[0]), new_samples(bk.samples(back), at[1])
    if ran >= cfg.probe_s and n_p >= cfg.cost_window and n_b >= cfg.cost_window:
        return True
    return clear_verdict(n_p, n_b, _score(bk.ests, probed), _score(bk.ests, back), bk.margin(probed, back, cfg)[0], cfg)


def _verdict(h: HeightState, bk: _Bucket, lost: int, to: int) -> HeightState:
    """Keep the verdict: ``lost`` lost to ``to`` here (a paired probe, or a first decision
    that left the depth batches ran at), at the cost its own cycles measured, few as they
    may be (a restart's first round must not probe it again: governor/learned.py). The
    winner's old verdict, if any, is void."""
    e = bk.ests[lost] if 0 <= lost < len(bk.ests) else None
    kept = tuple(v for v in h.lost if v.depth not in (lost, to))
    if e is None or e.sample_cost_s is None:
        return replace(h, lost=kept)
    v = LostProbe(depth=lost, to=to, cost_s=e.sample_cost_s, samples=e.samples, at_s=bk.clock)
    return replace(h, lost=tuple(sorted(kept + (v,), key=lambda v: v.depth)))


def _probe_step(h: HeightState, bk: _Bucket, obs: Observation, cfg: GovernorConfig) -> HeightState:
    probed = h.probe_depth if h.probe_depth is not None else 0
    back = h.probe_return if h.probe_return is not None else 0
    if not _probe_done(h, bk, cfg, probed, back):
        # Paired: alternate tick by tick, so both depths are measured over the same seconds.
        return bk.emit(h, back if h.depth == probed else probed, "height_probe_step", "paired probe")
    at = h.probe_samples_at or (0, 0)
    h = replace(h, **_NO_PROBE)
    sp, sb = _score(bk.ests, probed), _score(bk.ests, back)
    # Only a measurement can win: a probe whose depth never ran (an engine that did not
    # draft it: a batch path without speculation) leaves a prior in its place, and a prior
    # is a reason to look, never to move.
    got = new_samples(bk.samples(probed), at[0])
    h = replace(h, unmeasured=probed if got == 0 else None)
    if got < cfg.trust_samples:
        return bk.emit(h, back, "height_probe_end", f"probed depth {probed} got {got} cycles (< {cfg.trust_samples}): "
                                                    f"not measured, back to {back}")  # fmt: skip
    margin, noise = bk.margin(probed, back, cfg)
    mlog = bk.margin_inputs(margin, noise)
    if probed_depth_wins(probed, back, sp, sb, margin, obs, cfg):
        h = _verdict(h, bk, lost=back, to=probed)
        return bk.emit(h, probed, "height_probe_end", f"probed depth {probed} scores {_fmt(sp)} vs {_fmt(sb)}, "
                                                      f"{fmt_margin(margin, noise)}: stay", **mlog)  # fmt: skip
    h = _verdict(h, bk, lost=probed, to=back)
    return bk.emit(h, back, "height_probe_end", f"probed depth {probed} ({_fmt(sp)}) not better than {back} "
                                                f"({_fmt(sb)}) by the {fmt_margin(margin, noise)}", **mlog)  # fmt: skip
