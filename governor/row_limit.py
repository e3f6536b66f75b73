"""How many requests decode at once: stage 6 of ``policy.decide``, pure as the rest.

With ``scheduler.max_active = "auto"`` the scheduler's limit is the governor's. A decode step
of a large model is bound by reading its weights, so on a GPU carrying more rows through
the same weights should cost little (the batch's tokens per second grows with its height);
on this CPU the forward is compute-bound and a row costs about what it gives. Nothing here
assumes either: the cost model learns each bucket of heights' cost per row
(governor/heights.py: 1, 2, 3-4, 5-8, 9+) and its score, E(k) / cost per row, which is the
batch's aggregate tokens per second. The rule, one row at a time:

- up, when demand waits (a request queued or parked while every slot is taken), the limit
  is below the ceiling, and the headroom holds one more row's caches at the context a
  request may reach: within the bucket the limit runs in, at once (that bucket is where
  the council already is); into the next bucket only once the limit's own bucket is
  measured (``trust_samples`` cycles: the reference), and then at once where the next is
  measured to score the margin better, else a probe: one row more until the probed bucket has ``trust_samples``
  cycles of its own (first-use cycles of a new height do not count: the engine marks them
  ``transition``), kept if it scores the margin better than the bucket it came from, else
  back; a probe that scores the fixed ``depth_margin`` better but not the noise-aware margin
  runs on to ``PROBE_EXTEND`` x ``trust_samples`` cycles first (noisy, not worse). A bucket
  never measured is probed at once; a measured one again only when its estimate is stale, at
  most every ``probe_interval_s`` of decoding;
- down one row when the bucket the limit runs in scores the margin worse than the bucket
  below it (both measured, neither stale);
- memory: warn stops raising and steps down one row per ``row_dwell_s``; critical goes
  straight to ``row_floor``. Lowering the limit drops nothing: rows above it finish their
  requests and no new one is admitted until below it (the scheduler's rule).

The margin is the depth rules' noise-aware one (depth_rules.margin_for): max(depth_margin_min,
exp(depth_noise_z x noise) - 1) with the noise of the two costs measured (their relative
standard errors), ``depth_margin`` where either is not known.

No decision while nothing runs or waits; a move waits ``row_dwell_s`` after the last (except
critical pressure). Every move, probe, verdict and blocker is one ``governor.decision`` with
its inputs; a blocker is logged when it changes, not every tick.
"""

from __future__ import annotations

import math
from typing import Any

from msgspec.structs import replace

from .config import GovernorConfig
from .depth_rules import fmt_margin
from .heights import bucket_label, bucket_of
from .types import CRITICAL, NORMAL, WARN, DepthEstimate, Observation, SetMaxActive, State

# An inconclusive probe (``_inconclusive``) runs on to this many times trust_samples new cycles
# before its verdict; the cost window (32 cycles) keeps them, so its noise falls ~1/sqrt(n).
PROBE_EXTEND = 3
_NO_PROBE = dict(row_probe_from=None, row_probe_started_s=None, row_probe_samples_at=None, row_probe_bucket_s=None)


def bucket_clock(obs: Observation, height: int) -> float:
    """The decode clock of the bucket ``height`` falls in (its cycles' seconds, first-use
    ones too); the solo clock is the whole decode clock."""
    b = bucket_of(height)
    if b == 0:
        return obs.decode_s
    return obs.batch_decode_s[b - 1] if b - 1 < len(obs.batch_decode_s) else 0.0


def bucket_estimate(obs: Observation, height: int, trust: int = 1) -> DepthEstimate | None:
    """What a batch of ``height`` rows scores: its bucket's best estimate among the depths
    measured there with ``trust`` cycles or more (fresh ones first: the depth policy moves
    each bucket to its best depth, so that is what the height delivers; the depth it drafts
    now may have a few cycles only, after a depth probe), else the depth it ran most; None
    when no cycle of that bucket was measured. Height 1 is the solo table."""
    b = bucket_of(height)
    if b == 0:
        ests = obs.estimates
    else:
        ests = obs.batch_estimates[b - 1] if b - 1 < len(obs.batch_estimates) else ()
    measured = [e for e in ests if e.samples > 0 and e.score is not None]
    if not measured:
        return None
    trusted = [e for e in measured if e.samples >= trust]
    if trusted:
        return max(trusted, key=lambda e: (not e.stale, e.score, -e.depth))
    return max(measured, key=lambda e: (e.samples, -e.depth))


def bucket_samples(obs: Observation, height: int) -> int:
    """Cost samples of the bucket ``height`` falls in, over every depth (the probe counts
    the new ones: first-use cycles of a height are not among them)."""
    b = bucket_of(height)
    ests = obs.estimates if b == 0 else (obs.batch_estimates[b - 1] if b - 1 < len(obs.batch_estimates) else ())
    return sum(e.samples for e in ests)


def row_margin(hi: DepthEstimate, lo: DepthEstimate, cfg: GovernorConfig) -> tuple[float, float | None]:
    """(margin, noise): ``hi`` must score (1 + margin) x ``lo`` to win. As depth_rules.margin_for,
    between two buckets: the noise is both costs' relative standard errors (independent
    windows); unknown on either side, the fixed depth_margin."""
    if hi.cost_rse is None or lo.cost_rse is None:
        return cfg.depth_margin, None
    noise = math.sqrt(hi.cost_rse ** 2 + lo.cost_rse ** 2)
    return max(cfg.depth_margin_min, math.expm1(cfg.depth_noise_z * noise)), noise


def _inconclusive(there: DepthEstimate | None, here: DepthEstimate | None, cfg: GovernorConfig) -> bool:
    """A probe's bucket scores at least the fixed ``depth_margin`` better than the one it came
    from, yet not the noise-aware margin: what its first ``trust_samples`` cycles say is
    "better, but noisy", not "not better". Seen on an H100 council's first round: 5 rows
    scored 1.81x 4 rows with 32% noise (a 90% margin) and went back to 4 for the rest of the
    round; the next round kept 5 at 9.6% noise (bench/results/h100_2026-12-06h, call5)."""
    if not (_trusted(there, cfg) and _trusted(here, cfg)):
        return False
    margin, _ = row_margin(there, here, cfg)
    return here.score * (1 + cfg.depth_margin) <= there.score < here.score * (1 + margin)


def _trusted(e: DepthEstimate | None, cfg: GovernorConfig) -> bool:
    return e is not None and e.score is not None and e.samples >= cfg.trust_samples


def _fmt(e: DepthEstimate | None) -> str:
    return "?" if e is None or e.score is None else f"{e.score:.1f} tok/s"


class _Rows:
    """This tick's inputs, and how a decision about the limit speaks to the log."""

    def __init__(self, s: State, obs: Observation, now: float, cfg: GovernorConfig, out: Any):
        self.obs, self.now, self.cfg, self.out = obs, now, cfg, out
        self.ceiling = obs.row_ceiling
        ests = [bucket_estimate(obs, h, cfg.trust_samples) for h in (1, 2, 3, 5, 9)]  # one height per bucket
        self.scores = [{"heights": bucket_label(b), "score": None if e is None else round(e.score, 3),
                        "samples": 0 if e is None else e.samples, "depth": None if e is None else e.depth}
                       for b, e in enumerate(ests)]  # fmt: skip

    def emit(self, s: State, to: int, decision: str, sentence: str, **inputs: Any) -> State:
        """Log one decision; with ``to`` other than the limit, set the limit to it."""
        frm = s.row_limit or to
        action = SetMaxActive(to) if to != frm else None
        obs = self.obs
        self.out.emit(action, decision, f"rows at once: {sentence}", rows_from=frm, rows_to=to, ceiling=self.ceiling,
                      rows_active=obs.rows_active, rows_waiting=obs.rows_waiting,
                      available_bytes=obs.available_bytes, row_cache_bytes=obs.row_cache_bytes,
                      by_height=self.scores, **inputs)  # fmt: skip
        s = replace(s, row_decision=decision, row_why=sentence, row_hold="")
        return replace(s, row_limit=to, row_changed_at=self.now) if action is not None else s

    def hold(self, s: State, blocker: str, decision: str, sentence: str, **inputs: Any) -> State:
        """A blocker (``blocker`` names its kind): logged when it changes, not every tick
        (its sentence carries live numbers: the status shows the latest)."""
        if s.row_hold == blocker:
            return replace(s, row_why=sentence)
        return replace(self.emit(s, s.row_limit or 1, decision, sentence, **inputs), row_hold=blocker)


def decide_rows(s: State, obs: Observation, now: float, cfg: GovernorConfig, out: Any) -> State:
    ceiling = obs.row_ceiling
    if ceiling <= 0:  # pinned by the config (or a trace from before this stage): not ours
        return s
    if s.row_limit is None:  # the first tick adopts what the engine runs at (no decision: nothing measured)
        start = min(max(obs.row_limit, 1), ceiling) if obs.row_limit > 0 else min(cfg.row_floor, ceiling)
        s = replace(s, row_limit=start, row_decision="rows_start",
                    row_why=f"{start} to start, the scheduler's start height, until measurements say otherwise")
        if s.row_learned is not None and obs.pressure == NORMAL:
            return start_rows(s, _Rows(s, obs, now, cfg, out), start)
    r = _Rows(s, obs, now, cfg, out)
    lim = s.row_limit or 1
    floor = min(cfg.row_floor, ceiling)
    if lim > ceiling:
        return r.emit(replace(s, **_NO_PROBE), ceiling, "rows_ceiling", f"the ceiling is {ceiling} now: {lim} -> {ceiling}")
    if obs.pressure == CRITICAL:
        s = replace(s, **_NO_PROBE)
        if lim > floor:
            return r.emit(s, floor, "rows_pressure", f"critical memory pressure: {lim} -> {floor} (row_floor); "
                                                     "requests above it finish, none is admitted until below it",
                          detail=obs.pressure_detail)  # fmt: skip
        return r.hold(s, "critical", "rows_pressure", f"critical memory pressure: held at {lim} (row_floor)")
    dwelt = s.row_changed_at is None or now - s.row_changed_at >= cfg.row_dwell_s
    if obs.pressure == WARN:
        s = replace(s, **_NO_PROBE)
        if lim > floor and dwelt:
            return r.emit(s, lim - 1, "rows_pressure", f"memory pressure warn: one row fewer, {lim} -> {lim - 1}",
                          detail=obs.pressure_detail)
        return r.hold(s, "warn", "rows_pressure", f"memory pressure warn: no more rows ({lim})")
    if obs.rows_active == 0 and obs.rows_waiting == 0:
        return s
    if s.row_probe_from is not None:
        return _probe_verdict(s, r, lim)
    if not dwelt:
        return s
    down = _back_off(s, r, lim)
    if down is not None:
        return down
    if obs.rows_waiting > 0 and obs.rows_active >= lim:
        return _raise(s, r, lim)
    return s


def start_rows(s: State, r: _Rows, start: int) -> State:
    """The first tick with a learned limit (``s.row_learned``): start where this machine's last
    run settled, at most the ceiling, and above the engine's start only as many rows as the
    headroom holds the caches of (each at its context, plus row_margin_bytes once); below the
    engine's start where the last run backed off. One ``rows_start`` decision says which."""
    obs, learned = r.obs, s.row_learned or start
    want = min(learned, r.ceiling)
    to, held = want, ""
    if want > start:
        fits = _rows_fit(r)
        if fits is None:
            to, held = start, "the headroom is unknown"
        else:
            to = max(start, min(want, start + fits))
            if to < want:
                held = (f"the headroom {obs.available_bytes >> 20}MiB holds {to - start} more row(s)' caches at "
                        f"{obs.row_cache_bytes >> 20}MiB each + row_margin_bytes {r.cfg.row_margin_bytes >> 20}MiB")
    s = replace(s, row_learned=None)
    sentence = f"{to} to start, where this machine's last run settled (learned profile: {learned}"
    sentence += f", the ceiling {r.ceiling})" if learned > r.ceiling else ")"
    sentence += f"; {held}" if held else ""
    return r.emit(replace(s, row_limit=start), to, "rows_start", sentence, rows_learned=learned)


def _back_off(s: State, r: _Rows, lim: int) -> State | None:
    """One row fewer when the bucket the limit runs in scores the margin worse than the one
    below it (both measured, neither stale)."""
    if bucket_of(lim) == 0:
        return None
    below = _top_of_bucket_below(lim)
    cur, low = (bucket_estimate(r.obs, h, r.cfg.trust_samples) for h in (lim, below))
    if not (_trusted(cur, r.cfg) and _trusted(low, r.cfg)) or cur.stale or low.stale:
        return None
    margin, noise = row_margin(low, cur, r.cfg)
    if low.score < cur.score * (1 + margin):
        return None
    return r.emit(s, lim - 1, "rows_back_off",
                  f"height {bucket_label(bucket_of(lim))} scores {_fmt(cur)} vs {_fmt(low)} at "
                  f"{bucket_label(bucket_of(below))} ({fmt_margin(margin, noise)}): another row does not pay, "
                  f"{lim} -> {lim - 1}", margin=round(margin, 4), noise=None if noise is None else round(noise, 4))


def _top_of_bucket_below(h: int) -> int:
    """The largest height in the bucket below ``h``'s."""
    while h > 1 and bucket_of(h - 1) == bucket_of(h):
        h -= 1
    return max(h - 1, 1)


def _rows_fit(r: _Rows) -> int | None:
    """How many more rows' caches at their context the headroom holds beside row_margin_bytes
    (None: the headroom is unknown; rows of no bytes: as many as asked while the margin holds)."""
    obs = r.obs
    if obs.available_bytes is None:
        return None
    spare = obs.available_bytes - r.cfg.row_margin_bytes
    if spare < 0:
        return 0
    return spare // obs.row_cache_bytes if obs.row_cache_bytes > 0 else r.ceiling


def _room(r: _Rows) -> str | None:
    """Why the headroom does not hold one more row's caches at its context, or None."""
    obs, fits = r.obs, _rows_fit(r)
    if fits is None:
        return "headroom unknown"
    if fits < 1:
        return (f"headroom {obs.available_bytes >> 20}MiB < one more row's caches at its context "
                f"{obs.row_cache_bytes >> 20}MiB + row_margin_bytes {r.cfg.row_margin_bytes >> 20}MiB")
    return None


def _raise(s: State, r: _Rows, lim: int) -> State:
    obs, cfg, nxt = r.obs, r.cfg, lim + 1
    if lim >= r.ceiling:
        return r.hold(s, "ceiling", "rows_hold", f"demand waits, the limit is at the ceiling ({r.ceiling})")
    blocked = _room(r)
    if blocked is not None:
        return r.hold(s, "headroom", "rows_hold", f"demand waits, but {blocked}: no more rows ({lim})")
    here = bucket_estimate(obs, lim, cfg.trust_samples)
    if bucket_of(nxt) == bucket_of(lim):
        return r.emit(s, nxt, "rows_raise", f"demand waits and {nxt} rows run in the bucket "
                                            f"{bucket_label(bucket_of(lim))} the limit is in ({_fmt(here)}): "
                                            f"{lim} -> {nxt}")  # fmt: skip
    there = bucket_estimate(obs, nxt, cfg.trust_samples)
    label = bucket_label(bucket_of(nxt))
    if not _trusted(here, cfg):
        # A probe weighs the next heights against these: without their cost it would be
        # kept on nothing (seen on this CPU: a probe at start-up, before heights 3-4 had a
        # cycle of their own past its first use).
        return r.hold(s, "unmeasured", "rows_hold", f"demand waits, but heights {bucket_label(bucket_of(lim))} are not "
                                                    f"measured yet: measure them before trying more rows ({lim})")  # fmt: skip
    if _trusted(there, cfg) and not there.stale:
        margin, noise = row_margin(there, here, cfg)
        mlog = {"margin": round(margin, 4), "noise": None if noise is None else round(noise, 4)}
        if there.score >= here.score * (1 + margin):
            return r.emit(s, nxt, "rows_raise", f"demand waits and heights {label} score {_fmt(there)} vs {_fmt(here)} "
                                                f"at {lim} ({fmt_margin(margin, noise)}): {lim} -> {nxt}", **mlog)  # fmt: skip
        why = f"demand waits, but heights {label} measured {_fmt(there)} vs {_fmt(here)} at {lim}: not better by the "
        return r.hold(s, "not_better", "rows_hold", why + f"{fmt_margin(margin, noise)}, {lim} kept", **mlog)
    due = s.row_last_probe_s is None or obs.decode_s - s.row_last_probe_s >= cfg.probe_interval_s
    if not due:
        return s
    what = "never measured" if there is None or there.samples == 0 else (
        "measured too little" if not _trusted(there, cfg) else "stale")
    s = replace(s, row_probe_from=lim, row_probe_started_s=obs.decode_s, row_last_probe_s=obs.decode_s,
                row_probe_samples_at=bucket_samples(obs, nxt), row_probe_bucket_s=bucket_clock(obs, nxt))
    return r.emit(s, nxt, "rows_probe", f"demand waits and heights {label} are {what}: probe {nxt} rows "
                                        f"against {lim} ({_fmt(here)})")  # fmt: skip


def _probe_verdict(s: State, r: _Rows, lim: int) -> State:
    """The probe ends once the probed bucket has trust_samples new cycles (kept if it scores
    the margin better than the bucket it came from, else back), or unmeasured after
    probe_s x probe_max_factor of decoding at other heights (back: a look, never a move).
    Time at the probed height does not count toward that: its first-use cycles (seconds on
    a GPU, where a new height compiles) are the height arriving, not the council leaving."""
    obs, cfg = r.obs, r.cfg
    frm = s.row_probe_from or 1
    got = bucket_samples(obs, lim) - (s.row_probe_samples_at or 0)
    started = s.row_probe_started_s if s.row_probe_started_s is not None else obs.decode_s
    there_s = bucket_clock(obs, lim) - (s.row_probe_bucket_s if s.row_probe_bucket_s is not None else bucket_clock(obs, lim))
    ran = obs.decode_s - started - max(there_s, 0.0)
    there, here = (bucket_estimate(obs, h, cfg.trust_samples) for h in (lim, frm))
    if got < cfg.trust_samples:
        if ran < cfg.probe_s * cfg.probe_max_factor:
            return s
        return r.emit(replace(s, **_NO_PROBE), frm, "rows_probe_end",
                      f"the probe of {lim} rows got {max(got, 0)} cycles (< {cfg.trust_samples}) in {ran:.1f}s of "
                      f"decoding at other heights: not measured, back to {frm}")  # fmt: skip
    if (_inconclusive(there, here, cfg) and got < cfg.trust_samples * PROBE_EXTEND
            and ran < cfg.probe_s * cfg.probe_max_factor):
        return s  # better by the fixed edge, inside the noise: more cycles narrow it (the window holds them)
    s = replace(s, **_NO_PROBE, row_changed_at=r.now)  # a verdict: the next move waits row_dwell_s after it
    if not _trusted(here, cfg):  # (its measurements forgotten during the probe) a look, never a move
        return r.emit(s, frm, "rows_probe_end", f"probed {lim} rows: {_fmt(there)}, nothing measured at {frm} to "
                                                f"weigh it against: back to {frm}")  # fmt: skip
    margin, noise = row_margin(there, here, cfg)
    mlog = {"margin": round(margin, 4), "noise": None if noise is None else round(noise, 4)}
    if there.score >= here.score * (1 + margin):
        return r.emit(s, lim, "rows_keep", f"probed {lim} rows: {_fmt(there)} vs {_fmt(here)} at {frm} "
                                           f"({fmt_margin(margin, noise)}): another row pays, kept", **mlog)  # fmt: skip
    return r.emit(s, frm, "rows_probe_end", f"probed {lim} rows: {_fmt(there)} vs {_fmt(here)} at {frm}, not better "
                                            f"by the {fmt_margin(margin, noise)}: back to {frm}", **mlog)  # fmt: skip
