"""The governor's policy: one pure function.

    decide(state, obs, now, cfg) -> (new_state, actions, reasons)

``start_depth(obs, cfg, configured)`` picks the depth a governor starts at (pure too).

No clock, no probes, no randomness, no I/O: the same inputs always give the same outputs,
which is what makes a recorded trace replayable and every rule below testable with fakes.

Order within a tick (the order the actions come out in, and the step loop applies them):
  1. timers        pressure episodes (normal since, warn episode, not critical since)
  1b. prompt caches shed first under pressure (critical: all, warn: the oldest half per
                   tick), the cap lifted after the restore window; the head waits for them
  2. head          shed fast (critical now, warn sustained, idle), restore slowly
  3. admissions    shed under critical, clear MLX's cache, release once it passes
  4. depth         forced 0 / pinned, else the cost model's best, one step, a margin as
                   wide as the measured noise of the scores (depth_rules.margin_for),
                   with a neighbour probed now and then (on the decode clock)
  5. heights       the same per bucket of batch heights (height_policy.py): the depth a
                   batched cycle of that height drafts, by E(k) / cost per row (B, k)
  6. rows          how many requests decode at once, with scheduler.max_active = "auto"
                   (row_limit.py): one more row while the next bucket of heights is measured
                   (or probed) to pay and memory holds its caches; back off when it does not
                   pay or under pressure
Overrides (pin_depth, force_evict, force_load) win over 2 and 4 until "auto" releases them.

A stale estimate is a reason to look, never to move: the depth that looks best is probed
directly (not one step at a time), paired against the current one.

Probes are paired: the probed and the current depth alternate tick by tick until both have
a window of new cycles, so a change of load, council or text during a probe (a probe on the
decode clock may span an idle gap and the regime change after it) weighs on both sides
instead of deciding the verdict (bench/results/README_governor.md, runs 7-9).

A head that left because it did not pay comes back on trial (rate-limited, with back-off):
once the reload conditions hold except a predicted gain, it is loaded, depth 1 is probed
against serial, and it stays only if that pays; a regime where speculation pays (other
text, other load, one stream again) is found that way, since no cost measured without the
head can show it.

``pin_depth 0``: serial decode; the head is left where it is. A resident head stays (so
"auto" can resume at once) until the ordinary rules take it out (the idle rule after
idle_evict_s at depth 0, or pressure); an absent head is not loaded while the pin holds (no
reload, no trial): memory for a head that cannot be used buys nothing. ``evict_head`` is
the command that takes it out now.
"""

from __future__ import annotations

from typing import Any

from msgspec.structs import replace

from .config import GovernorConfig
from .depth_rules import (clear_verdict, fmt_margin, forced_depth, margin_for, margin_inputs, move_toward,
                          new_samples, probed_depth_wins)
from .height_policy import decide_heights, settled_depth
from .row_limit import decide_rows
from .types import (
    CRITICAL,
    NORMAL,
    WARN,
    Action,
    ClearCache,
    EvictHead,
    LimitPromptCache,
    LoadHead,
    Observation,
    SetDepth,
    ShedAdmissions,
    State,
)

Reason = dict[str, Any]


class _Out:
    """The actions and reasons of one tick, in order."""

    def __init__(self, obs: Observation):
        self.obs = obs
        self.actions: list[Action] = []
        self.reasons: list[Reason] = []

    def emit(self, action: Action | None, decision: str, sentence: str, **inputs: Any) -> None:
        if action is not None:
            self.actions.append(action)
        self.reasons.append(
            {
                "decision": decision,
                "sentence": sentence,
                "pressure": self.obs.pressure,
                "active_streams": self.obs.active_streams,
                **inputs,
            }
        )


def _scores(obs: Observation) -> list[float | None]:
    return [e.score for e in obs.estimates]


def _rounded(obs: Observation) -> list[float | None]:
    """Scores for the decision log (tokens/s to 3 places)."""
    return [None if e.score is None else round(e.score, 3) for e in obs.estimates]


def _fmt(x: float | None) -> str:
    return "?" if x is None else f"{x:.1f}"


def _margin_inputs(obs: Observation, margin: float, noise: float | None) -> dict[str, Any]:
    """A solo depth decision's inputs for the log: the scores and what the margin the change
    needed was made of (depth_rules.margin_inputs)."""
    return {"scores": _rounded(obs), **margin_inputs(obs.estimates, obs.acceptance, margin, noise)}


# ---------------------------------------------------------------- 1. timers


def _timers(s: State, obs: Observation, now: float, cfg: GovernorConfig) -> State:
    p = obs.pressure
    normal_since = (s.normal_since if s.normal_since is not None else now) if p == NORMAL else None
    not_crit = (s.not_critical_since if s.not_critical_since is not None else now) if p != CRITICAL else None
    warn_since, last_bad = s.warn_since, s.last_not_normal_at
    if p != NORMAL:
        last_bad = now
        warn_since = warn_since if warn_since is not None else now
    elif warn_since is not None and last_bad is not None and now - last_bad >= cfg.warn_clear_s:
        # Only a calm stretch ends the episode: a flapping signal stays one episode.
        warn_since = None
    return replace(
        s, normal_since=normal_since, not_critical_since=not_crit, warn_since=warn_since, last_not_normal_at=last_bad
    )


# ---------------------------------------------------------------- 1b. prompt caches


def _prompt_caches(s: State, obs: Observation, now: float, cfg: GovernorConfig, out: _Out) -> State:
    """Prompt caches are the cheapest memory to give back (a miss costs one prefill), so
    they go before the head; the cap comes off only after the head's restore window."""
    held = obs.prompt_cache_bytes
    inputs = {"prompt_cache_bytes": held, "prompt_cache_limit": s.prompt_cache_limit,
              "available_bytes": obs.available_bytes, "detail": obs.pressure_detail}  # fmt: skip
    # (Critical with nothing held and no cap yet, e.g. no prefix cache at all: nothing to do.)
    if obs.pressure == CRITICAL and (held > 0 or s.prompt_cache_limit not in (None, 0)):
        out.emit(LimitPromptCache(0), "shed_prompt_caches",
                 "critical memory pressure: every prompt cache goes, before the head", **inputs)  # fmt: skip
        return replace(s, prompt_cache_limit=0, prompt_cache_shed_at=now)
    if obs.pressure == WARN and held > 0:
        target = held // 2
        out.emit(LimitPromptCache(target), "shed_prompt_caches",
                 f"memory pressure warn: the oldest prompt caches go, down to {target >> 20}MiB", **inputs)  # fmt: skip
        return replace(s, prompt_cache_limit=target, prompt_cache_shed_at=now)
    if (s.prompt_cache_limit is not None and obs.pressure == NORMAL and s.normal_since is not None
            and now - s.normal_since >= cfg.restore_window_s):  # fmt: skip
        out.emit(LimitPromptCache(None), "restore_prompt_caches",
                 f"normal for {now - s.normal_since:.0f}s (restore window {cfg.restore_window_s:.0f}s): "
                 "prompt caches may use their configured budget again", **inputs)  # fmt: skip
        return replace(s, prompt_cache_limit=None)
    return s


# ---------------------------------------------------------------- 2. head


def _evict(s: State, out: _Out, now: float, decision: str, sentence: str, **inputs: Any) -> State:
    if s.depth != 0:
        out.emit(SetDepth(0), "depth", "depth 0 before the head goes", depth_from=s.depth, depth_to=0)
    out.emit(EvictHead(), decision, sentence, **inputs)
    return replace(
        s, depth=0, head_target=False, last_evict_at=now, last_depth_change_at=now, idle_since=None,
        probe_depth=None, probe_return=None, probe_until_decode_s=None, probe_samples_at=None,
        probe_started_decode_s=None, head_trial=False, last_trial_decode_s=out.obs.decode_s,
    )  # fmt: skip


def _load(s: State, out: _Out, now: float, decision: str, sentence: str, trial: bool = False, **inputs: Any) -> State:
    out.emit(LoadHead(), decision, sentence, **inputs)
    return replace(s, head_target=True, last_load_at=now, idle_since=None, head_trial=trial,
                   last_trial_decode_s=out.obs.decode_s if trial else s.last_trial_decode_s)  # fmt: skip


def _trial_wait(s: State, cfg: GovernorConfig) -> float:
    """Seconds of decoding before the next trial: doubled per failed trial, capped."""
    return cfg.head_trial_interval_s * min(2 ** s.trial_failures, cfg.head_trial_backoff_max)


def _predicted_gain(obs: Observation, cfg: GovernorConfig) -> tuple[bool, str]:
    """Does speculation pay, as far as the cost model knows? Costs measured under another
    CPU load say nothing about now (load moves costs), so they do not count against it."""
    ests = obs.estimates
    if not ests or ests[0].score is None:
        return True, "no cost data yet: the prior says try"
    here = [
        e.score
        for e in ests[1:]
        if e.score is not None
        and not (e.load_at is not None and obs.cpu_load is not None
                 and abs(e.load_at - obs.cpu_load) > cfg.stale_load_delta)  # fmt: skip
    ]
    if not here:
        return True, "speculation was measured under another load: worth a new try"
    best, serial = max(here), ests[0].score
    return best >= serial * (1 + cfg.depth_margin), f"best speculative score {_fmt(best)} vs serial {_fmt(serial)}"


def _reload_blocker(s: State, obs: Observation, now: float, cfg: GovernorConfig, need_gain: bool = True) -> str | None:
    """Why the head may not come back yet, or None when every condition holds (every one
    but the predicted gain, with ``need_gain`` False: the conditions of a trial)."""
    if not obs.head_available:
        return "the model has no MTP head"
    if obs.head_loading:
        return "a load is in flight"
    if obs.pressure != NORMAL or s.normal_since is None:
        return f"pressure is {obs.pressure}"
    if now - s.normal_since < cfg.restore_window_s:
        return f"normal for {now - s.normal_since:.0f}s of the {cfg.restore_window_s:.0f}s restore window"
    if s.last_evict_at is not None and now - s.last_evict_at < cfg.min_reload_gap_s:
        return f"evicted {now - s.last_evict_at:.0f}s ago (< {cfg.min_reload_gap_s:.0f}s anti-thrash gap)"
    need = obs.head_bytes + cfg.head_margin_bytes
    if obs.available_bytes is None:
        return "headroom unknown"
    if obs.available_bytes < need:
        return f"headroom {obs.available_bytes >> 20}MiB < head + margin {need >> 20}MiB"
    if obs.active_streams >= cfg.batch_streams:
        return f"{obs.active_streams} active streams batch at depth 0"
    if s.override == "pin_depth" and s.pin_depth == 0:
        return "operator pinned depth 0"
    if not need_gain:
        return None
    gain, why = _predicted_gain(obs, cfg)
    return None if gain else f"no predicted gain ({why})"


def _head(s: State, obs: Observation, now: float, cfg: GovernorConfig, out: _Out) -> State:
    inputs = {"available_bytes": obs.available_bytes, "head_bytes": obs.head_bytes, "detail": obs.pressure_detail}
    if s.head_target is None:  # first tick: adopt what the daemon has
        s = replace(s, head_target=obs.head_resident or obs.head_loading)
    if s.head_target and not obs.head_available:
        out.emit(None, "head_unavailable", "the model has no MTP head: serial only", **inputs)
        return replace(s, head_target=False)
    if (
        not s.head_target
        and obs.head_resident
        and obs.head_available
        and (s.last_evict_at is None or now - s.last_evict_at >= cfg.load_timeout_s)
    ):
        # Resident though we did not ask for it (loaded by the daemon itself, or an evict
        # that never landed): take it as ours; the rules below evict it again if they must.
        out.emit(None, "head_adopted", "head resident without a pending eviction: adopted", **inputs)
        s = replace(s, head_target=True)
    if (
        s.head_target
        and not obs.head_resident
        and not obs.head_loading
        and s.last_load_at is not None
        and now - s.last_load_at >= cfg.load_timeout_s
    ):
        out.emit(None, "load_failed", f"head not resident {cfg.load_timeout_s:.0f}s after LoadHead", **inputs)
        return replace(s, head_target=False, last_evict_at=now)

    mode = s.override
    if cfg.critical_beats_override and obs.pressure == CRITICAL and mode in ("pin_depth", "force_load"):
        mode = "auto"
    wants_head = mode == "force_load" or (mode == "pin_depth" and (s.pin_depth or 0) > 0)
    if mode == "force_evict":
        if s.head_target:
            return _evict(s, out, now, "evict_head", "operator override: force_evict", **inputs)
        return s
    if wants_head:
        if not s.head_target and obs.head_available and not obs.head_loading:
            return _load(s, out, now, "load_head", f"operator override: {mode}", **inputs)
        return s

    if s.head_target:
        pressed = obs.pressure == CRITICAL or (s.warn_since is not None and now - s.warn_since >= cfg.warn_evict_s)
        if pressed and obs.prompt_cache_bytes > 0:
            # The prompt caches were shed this tick (1b): see whether that was enough first.
            out.emit(None, "evict_head_deferred", "prompt caches go before the head",
                     prompt_cache_bytes=obs.prompt_cache_bytes, **inputs)  # fmt: skip
            return s
        if obs.pressure == CRITICAL:
            return _evict(s, out, now, "evict_head", "critical memory pressure: head out now", **inputs)
        if s.warn_since is not None and now - s.warn_since >= cfg.warn_evict_s:
            return _evict(
                s, out, now, "evict_head",
                f"memory pressure not calm for {now - s.warn_since:.0f}s (>= {cfg.warn_evict_s:.0f}s)", **inputs,
            )  # fmt: skip
        if s.idle_since is not None and now - s.idle_since >= cfg.idle_evict_s:
            return _evict(
                s, out, now, "evict_head", f"head unused at depth 0 for {now - s.idle_since:.0f}s", **inputs
            )
        return s
    if _reload_blocker(s, obs, now, cfg) is None:
        _, why = _predicted_gain(obs, cfg)
        calm = now - s.normal_since if s.normal_since is not None else 0.0
        return _load(s, out, now, "load_head", f"normal for {calm:.0f}s, headroom covers the head, {why}", **inputs)
    if (
        cfg.head_trial_interval_s > 0
        and obs.active_streams >= 1
        and _reload_blocker(s, obs, now, cfg, need_gain=False) is None
        and obs.decode_s - (s.last_trial_decode_s or 0.0) >= _trial_wait(s, cfg)
    ):
        waited = obs.decode_s - (s.last_trial_decode_s or 0.0)
        return _load(
            s, out, now, "load_head",
            f"trial: no predicted gain, but {waited:.0f}s of decoding since the head left or was last tried "
            f"(>= {_trial_wait(s, cfg):.0f}s): load it and measure depth 1 against serial", trial=True,
            trial_failures=s.trial_failures, **inputs,
        )  # fmt: skip
    return s


# ---------------------------------------------------------------- 3. admissions


def _admissions(s: State, obs: Observation, now: float, cfg: GovernorConfig, out: _Out) -> State:
    crit = obs.pressure == CRITICAL
    if crit and (s.last_pressure != CRITICAL or s.last_clear_cache_at is None
                 or now - s.last_clear_cache_at >= cfg.clear_cache_interval_s):  # fmt: skip
        out.emit(ClearCache(), "clear_cache", "critical memory pressure: drop MLX's buffer cache")
        s = replace(s, last_clear_cache_at=now)
    if crit and not s.shedding:
        out.emit(
            ShedAdmissions(True, cfg.shed_retry_after_s), "shed_admissions",
            "critical memory pressure: refuse new requests until it passes", detail=obs.pressure_detail,
        )  # fmt: skip
        return replace(s, shedding=True)
    if s.shedding and not crit and s.not_critical_since is not None:
        if now - s.not_critical_since >= cfg.shed_release_s:
            out.emit(ShedAdmissions(False), "admit", f"below critical for {now - s.not_critical_since:.0f}s")
            return replace(s, shedding=False)
    return s


# ---------------------------------------------------------------- 4. depth


def _set_depth(s: State, out: _Out, now: float, k: int, decision: str, sentence: str, **inputs: Any) -> State:
    if k == s.depth:
        return s
    out.emit(SetDepth(k), decision, sentence, depth_from=s.depth, depth_to=k, **inputs)
    return replace(s, depth=k, last_depth_change_at=now)


def _forced_depth(s: State, obs: Observation, cfg: GovernorConfig) -> tuple[int, str] | None:
    forced = forced_depth(s, obs, cfg)
    if forced is not None:
        return (0 if forced[0] is None else forced[0]), forced[1]  # no usable head: serial
    if obs.active_streams >= cfg.batch_streams:
        return 0, f"{obs.active_streams} active streams: batch at depth 0"
    if s.depth > cfg.max_depth:
        return cfg.max_depth, "above max_depth"
    return None


def _depth(s: State, obs: Observation, now: float, cfg: GovernorConfig, out: _Out) -> State:
    sc = _scores(obs)
    forced = _forced_depth(s, obs, cfg)
    if forced is not None:
        s = replace(s, probe_depth=None, probe_return=None, probe_until_decode_s=None, probe_samples_at=None,
                    probe_started_decode_s=None)  # fmt: skip
        return _set_depth(s, out, now, forced[0], "depth", forced[1])
    if s.last_probe_decode_s is None:  # the first probe waits a full interval of decoding
        s = replace(s, last_probe_decode_s=obs.decode_s)
    cur = s.depth
    score = (lambda k: sc[k] if k < len(sc) else None)  # noqa: E731
    if s.probe_depth is not None:
        back, probed = s.probe_return if s.probe_return is not None else cur, s.probe_depth
        if not _probe_done(s, obs, cfg, probed, back):
            # Paired: alternate tick by tick, so both depths are measured over the same seconds.
            nxt = back if cur == probed else probed
            out.emit(SetDepth(nxt), "probe_step", f"paired probe: depth {nxt}", depth_from=cur, depth_to=nxt)
            return replace(s, depth=nxt, last_depth_change_at=now)
        trial = s.head_trial
        s = replace(s, probe_depth=None, probe_return=None, probe_until_decode_s=None, probe_samples_at=None,
                    probe_started_decode_s=None, head_trial=False)  # fmt: skip
        sp, sb = score(probed), score(back)
        margin, noise = margin_for(obs.estimates, obs.acceptance, probed, back, cfg)
        mlog = _margin_inputs(obs, margin, noise)
        if probed_depth_wins(probed, back, sp, sb, margin, obs, cfg):
            s = replace(s, trial_failures=0) if trial else s
            return _end_probe(s, out, now, probed, f"{'trial: ' if trial else ''}probed depth {probed} scores "
                                                   f"{_fmt(sp)} vs {_fmt(sb)}, {fmt_margin(margin, noise)}: stay",
                              **mlog)  # fmt: skip
        if trial:
            s = replace(s, trial_failures=s.trial_failures + 1)
            return _evict(
                s, out, now, "evict_head",
                f"trial: depth {probed} ({_fmt(sp)}) not {fmt_margin(margin, noise)} better than serial ({_fmt(sb)}): "
                f"head out again; next trial after {_trial_wait(s, cfg):.0f}s of decoding", **mlog,
            )  # fmt: skip
        return _end_probe(s, out, now, back, f"probed depth {probed} ({_fmt(sp)}) not better than {back} ({_fmt(sb)}) "
                                             f"by the {fmt_margin(margin, noise)}", **mlog)  # fmt: skip
    if s.head_trial and cur == 0 and 1 <= cfg.max_depth:
        return _probe(s, obs, out, now, 1, cfg, "trial: measure depth 1 against serial (paired probe)")
    if s.last_depth_change_at is not None and now - s.last_depth_change_at < cfg.depth_dwell_s:
        return s
    cs = score(cur)
    ests = obs.estimates
    if cs is None or cur >= len(ests) or ests[cur].stale:
        return s  # no fresh measurement of where we are (no traffic): nothing to judge by
    move = move_toward(ests, cur, cs, obs, cfg, obs.acceptance)  # none: _maybe_probe (waits under warn)
    if move is not None:
        best, best_score, step, margin, noise = move
        why = f"depth {best} scores {_fmt(best_score)} vs {_fmt(cs)} at {cur} ({fmt_margin(margin, noise)})"
        mlog = _margin_inputs(obs, margin, noise)
        if ests[best].stale and best != step:
            # Measure the depth that looks best directly (paired with this one) rather than
            # climbing one probed step at a time: after batching or a reload every estimate
            # is stale, and a stepwise climb spent most of a burst below the best depth (the
            # replay evaluation: 5-6% of a quiet regime after council load).
            return _probe(s, obs, out, now, best, cfg, f"{why}, but its estimate is stale: probe it against {cur}",
                          **mlog)
        if ests[step].stale:
            # A stale or prior estimate is a reason to look, not to move: probe, and stay
            # only if the measurement confirms it.
            return _probe(s, obs, out, now, step, cfg, f"{why}, but depth {step}'s estimate is stale: probe it", **mlog)
        if (score(step) or 0.0) <= cs:
            return _maybe_probe(s, obs, now, cfg, out)  # a measured valley lies between: no blind step
        return _set_depth(s, out, now, step, "depth", f"{why}: one step to {step}", **mlog)
    return _maybe_probe(s, obs, now, cfg, out)


def _end_probe(s: State, out: _Out, now: float, k: int, sentence: str, **inputs: Any) -> State:
    """The verdict, and the depth it leaves (the alternation may stand on either side)."""
    if k == s.depth:
        out.emit(None, "probe_end", sentence, **inputs)
        return s
    out.emit(SetDepth(k), "probe_end", sentence, depth_from=s.depth, depth_to=k, **inputs)
    return replace(s, depth=k, last_depth_change_at=now)


def _samples(obs: Observation, k: int) -> int:
    return obs.estimates[k].samples if k < len(obs.estimates) else 0


def _probe_done(s: State, obs: Observation, cfg: GovernorConfig, probed: int, back: int) -> bool:
    """probe_s of decoding passed and both depths have cost_window new cycles, or the probe
    has run probe_max_factor x probe_s. Sooner when the verdict is clear: both have
    trust_samples new cycles and one scores twice the margin better than the other (half a
    probe spent at a much worse depth is what a long paired probe costs). (A count below
    its start means the cost model started that depth afresh: what it holds now is all new.)"""
    started = s.probe_started_decode_s if s.probe_started_decode_s is not None else obs.decode_s - cfg.probe_s
    ran = obs.decode_s - started
    if ran >= cfg.probe_s * cfg.probe_max_factor:
        return True
    if s.probe_until_decode_s is not None and obs.decode_s < s.probe_until_decode_s:
        return False
    if s.probe_samples_at is None:
        return True

    n_p = new_samples(_samples(obs, probed), s.probe_samples_at[0])
    n_b = new_samples(_samples(obs, back), s.probe_samples_at[1])
    if n_p >= cfg.cost_window and n_b >= cfg.cost_window:
        return True
    sc = _scores(obs)
    sp, sb = (sc[probed] if probed < len(sc) else None), (sc[back] if back < len(sc) else None)
    return clear_verdict(n_p, n_b, sp, sb, margin_for(obs.estimates, obs.acceptance, probed, back, cfg)[0], cfg)


def _probe(s: State, obs: Observation, out: _Out, now: float, n: int, cfg: GovernorConfig, sentence: str,
           **inputs: Any) -> State:
    s = replace(s, probe_depth=n, probe_return=s.depth, probe_until_decode_s=obs.decode_s + cfg.probe_s,
                last_probe_decode_s=obs.decode_s, probe_count=s.probe_count + 1,
                probe_samples_at=(_samples(obs, n), _samples(obs, s.depth)), probe_started_decode_s=obs.decode_s)  # fmt: skip
    return _set_depth(s, out, now, n, "probe", sentence, **inputs)


def _maybe_probe(s: State, obs: Observation, now: float, cfg: GovernorConfig, out: _Out) -> State:
    """Now and then, measure a neighbour whose estimate is stale (load moves costs). "Now and
    then" is on the decode clock: probe_interval_s seconds of decoding, so a burst that follows
    an idle gap does not start with a probe just because the wall clock moved."""
    if obs.pressure != NORMAL or obs.active_streams > 1:
        return s
    if s.last_probe_decode_s is not None and obs.decode_s - s.last_probe_decode_s < cfg.probe_interval_s:
        return s
    cur = s.depth
    # Alternate which side is tried first: deterministic, and both sides get their turn.
    sides = (cur + 1, cur - 1) if s.probe_count % 2 == 0 else (cur - 1, cur + 1)
    for n in sides:
        if 0 <= n <= cfg.max_depth and n < len(obs.estimates) and obs.estimates[n].stale:
            return _probe(s, obs, out, now, n, cfg,
                          f"depth {n}'s estimate is stale: measure it for {cfg.probe_s}s of decoding")
    return replace(s, last_probe_decode_s=obs.decode_s)


# ---------------------------------------------------------------- start


def start_depth(obs: Observation, cfg: GovernorConfig, configured: int) -> tuple[int, Reason]:
    """The depth to start at, before any cycle is measured, and why.

    With a tuned profile (``councild tune``: estimates whose source is "profile"), the
    profile's best depth by the score the policy uses, E(k) / cost(k), over the depths the
    profile measured up to max_depth, if it beats serial by ``depth_margin``; else 0. Only
    measured depths count: a depth the profile lacks would be priced by the optimistic
    prior, which is what the profile is there to replace. Without one, ``configured`` (the
    daemon's speculation.depth), as before. No head resident: 0. An operator pin wins.

    This is a start, not a move: the estimates stay "profile" (stale) until this daemon
    measures them, so the policy holds here until it has a measurement of its own, and
    reaches any other depth only through a probe that confirms it.
    """
    out = _Out(obs)
    ests = obs.estimates
    rounded = _rounded(obs)
    configured = min(max(configured, 0), cfg.max_depth)

    def done(k: int, sentence: str) -> tuple[int, Reason]:
        out.emit(None, "start_depth", sentence, depth_from=configured, depth_to=k, scores=rounded,
                 sources=[e.source for e in ests])  # fmt: skip
        return k, out.reasons[0]

    if not (obs.head_available and obs.head_resident):
        return done(0, "head not resident: serial")
    serial = ests[0] if ests else None
    tuned = [e for e in ests[1:cfg.max_depth + 1] if e.source == "profile" and e.score is not None]
    if serial is None or serial.source != "profile" or serial.score is None or not tuned:
        return done(configured, f"no tuned costs: configured depth {configured} (a prior)")
    best = max(tuned, key=lambda e: (e.score, -e.depth))  # ties go to the shallower depth
    margin = f"{cfg.depth_margin:.0%}"
    if best.score >= serial.score * (1 + cfg.depth_margin):
        return done(best.depth, f"tuned profile: depth {best.depth} scores {_fmt(best.score)} vs serial "
                                f"{_fmt(serial.score)} (>= {margin} better)")  # fmt: skip
    return done(0, f"tuned profile: no depth beats serial by {margin}: best depth {best.depth} scores "
                   f"{_fmt(best.score)} vs serial {_fmt(serial.score)}")  # fmt: skip


# ---------------------------------------------------------------- decide


def decide(
    state: State, obs: Observation, now: float, cfg: GovernorConfig
) -> tuple[State, list[Action], list[Reason]]:
    out = _Out(obs)
    s = _timers(state, obs, now, cfg)
    s = _prompt_caches(s, obs, now, cfg, out)
    s = _head(s, obs, now, cfg, out)
    s = _admissions(s, obs, now, cfg, out)
    s = _depth(s, obs, now, cfg, out)
    s = decide_heights(s, obs, now, cfg, out)
    s = decide_rows(s, obs, now, cfg, out)
    # The idle clock runs while the head is resident and unused: depth 0 alone and in
    # every batch height (a height not chosen yet runs at the solo depth).
    # A bucket's probe does not count as use (it measures; its verdict is what counts).
    idle = s.head_target and obs.head_resident and s.depth == 0 and all(not settled_depth(h) for h in s.heights)
    s = replace(
        s,
        idle_since=(s.idle_since if s.idle_since is not None else now) if idle else None,
        last_pressure=obs.pressure,
        ticks=s.ticks + 1,
    )
    if not out.reasons:
        why = None if s.head_target else _reload_blocker(s, obs, now, cfg)
        out.emit(
            None,
            "hold",
            f"depth {s.depth} kept" + (f"; head stays out: {why}" if why else ""),
            depth=s.depth,
            head=bool(s.head_target),
            scores=_rounded(obs),
        )
    return s, out.actions, out.reasons


def apply_override(state: State, action: str, depth: int | None = None) -> State:
    """An operator command (protocol GovernorCommand.action) -> the state that carries it.

    pin_depth k (k > 0 also keeps the head in), evict_head, load_head, auto (release all).
    """
    if action == "pin_depth":
        if depth is None or depth < 0:
            raise ValueError("pin_depth needs a depth >= 0")
        return replace(state, override="pin_depth", pin_depth=depth)
    if action in ("evict_head", "force_evict"):
        return replace(state, override="force_evict", pin_depth=None)
    if action in ("load_head", "force_load"):
        return replace(state, override="force_load", pin_depth=None)
    if action == "auto":
        return replace(state, override="auto", pin_depth=None)
    raise ValueError(f"unknown governor override {action!r}")


__all__ = ["decide", "apply_override", "start_depth", "Reason"]
