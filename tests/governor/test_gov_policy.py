"""The pure policy, tick by tick on a fake clock: residency, admissions, depth, overrides."""

from __future__ import annotations

import pytest
from msgspec.structs import replace

from governor.config import GovernorConfig
from governor.fakes import make_estimates
from governor.policy import apply_override, decide, start_depth
from governor.types import (
    ClearCache,
    EvictHead,
    LoadHead,
    Observation,
    SetDepth,
    SetHeightDepth,
    ShedAdmissions,
    State,
)

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)

GiB, MiB = 1 << 30, 1 << 20
CFG = GovernorConfig()
GOOD = [10.0, 13.0, 12.0, 11.0, 10.0]  # depth 1 best, fresh everywhere


class Harness:
    """decide() on a fake clock, with a fake head that applies Load/Evict at once
    (unless ``apply_head`` is off, to model a load that never completes). The decode clock
    (Observation.decode_s) advances with the fake clock while ``decoding`` (the default), and
    stands still while not (``tick(decoding=False)``: an idle gap between bursts)."""

    def __init__(self, cfg: GovernorConfig = CFG, state: State | None = None, apply_head: bool = True, **obs):
        self.cfg, self.t, self.apply_head = cfg, 0.0, apply_head
        self.decode_s, self.decoding = 0.0, True
        self.state = state or State(depth=1, head_target=True)
        self.obs = dict(pressure="normal", available_bytes=16 * GiB, head_resident=True, head_bytes=850 * MiB,
                        active_streams=1, cpu_load=0.1, estimates=make_estimates(GOOD))  # fmt: skip
        if "scores" in obs:
            obs["estimates"] = make_estimates(obs.pop("scores"))
        self.obs.update(obs)
        self.samples: dict[int, int] = {}
        self.decisions: list[tuple[float, str, int | None]] = []
        self.cycles_per_tick = 25
        self.log: list[tuple[float, object]] = []
        self.pressure_log: list[tuple[float, str]] = []

    def tick(self, **changes):
        if "scores" in changes:
            changes["estimates"] = make_estimates(changes.pop("scores"), stale=changes.pop("stale", False))
        self.decoding = changes.pop("decoding", self.decoding)
        self.obs.update(changes)
        if self.decoding and self.obs["estimates"]:
            # The cost model's sample counts grow at the depth decoding now (~25 cycles a
            # tick), which is what a paired probe waits on.
            k = self.state.depth if self.obs["head_resident"] else 0
            self.samples[k] = self.samples.get(k, 0) + self.cycles_per_tick
            self.obs["estimates"] = tuple(
                replace(e, samples=e.samples + self.samples.get(e.depth, 0)) if e.depth == k else e
                for e in self.obs["estimates"]
            )
            self.samples = {}
        obs = Observation(**self.obs, decode_s=self.decode_s)
        before = self.state.depth
        self.state, actions, reasons = decide(self.state, obs, self.t, self.cfg)
        assert reasons and all("decision" in r and "sentence" in r for r in reasons)
        probing = any(r["decision"] in ("probe", "probe_step", "probe_end") for r in reasons)
        assert (abs(self.state.depth - before) <= 1 or self.state.depth == 0 or self.state.override == "pin_depth"
                or probing)  # moves are one step at a time; a probe measures any depth
        for a in actions:
            self.log.append((self.t, a))
            if self.apply_head and isinstance(a, LoadHead):
                self.obs["head_resident"] = True
            if isinstance(a, EvictHead):
                self.obs["head_resident"] = False
        self.pressure_log.append((self.t, obs.pressure))
        self.decisions += [(self.t, r["decision"], r.get("depth_to")) for r in reasons]
        self.t += self.cfg.tick_s
        if self.decoding:
            self.decode_s += self.cfg.tick_s
        return actions, reasons

    def run(self, seconds: float, **changes):
        out = []
        end = self.t + seconds
        first = True
        while self.t < end - 1e-9:
            acts, _ = self.tick(**(changes if first else {}))
            first = False
            out.extend(acts)
        return out

    def times(self, kind) -> list[float]:
        return [t for t, a in self.log if isinstance(a, kind)]

    def moves(self) -> list[int]:
        """Depths moved to, leaving out a paired probe's alternations (its start and its
        verdict's depth stay)."""
        return [k for _, d, k in self.decisions if k is not None and d != "probe_step"]

    def move_times(self) -> list[float]:
        return [t for t, d, k in self.decisions if k is not None and d != "probe_step"]


# ---------------------------------------------------------------- shed fast


def test_critical_evicts_sheds_and_zeroes_depth_within_one_tick():
    h = Harness(state=State(depth=2, head_target=True))
    acts, reasons = h.tick(pressure="critical", available_bytes=200 * MiB)
    assert acts == [SetDepth(0), EvictHead(), ClearCache(), ShedAdmissions(True, CFG.shed_retry_after_s)]
    assert h.state.depth == 0 and h.state.shedding and h.state.head_target is False
    ev = next(r for r in reasons if r["decision"] == "evict_head")
    assert ev["pressure"] == "critical" and ev["available_bytes"] == 200 * MiB and "critical" in ev["sentence"]
    # Staying critical: no second eviction or shed; the cache is cleared at most every 5 s.
    more = h.run(20.0)
    assert not any(isinstance(a, (EvictHead, ShedAdmissions, LoadHead, SetDepth)) for a in more)
    clears = h.times(ClearCache)
    assert all(b - a >= CFG.clear_cache_interval_s - 1e-9 for a, b in zip(clears, clears[1:]))


def test_shedding_released_when_pressure_drops():
    h = Harness(state=State(depth=0, head_target=False), head_resident=False)
    acts, _ = h.tick(pressure="critical")
    assert ShedAdmissions(True, CFG.shed_retry_after_s) in acts and ClearCache() in acts
    h.run(3.0, pressure="warn")
    assert h.state.shedding  # not yet: held shed_release_s
    h.run(3.0)
    assert not h.state.shedding
    offs = [a for _, a in h.log if isinstance(a, ShedAdmissions) and not a.on]
    assert len(offs) == 1
    # Critical again sheds again, at once.
    acts, _ = h.tick(pressure="critical")
    assert ShedAdmissions(True, CFG.shed_retry_after_s) in acts


def test_warn_sustained_evicts_after_warn_evict_s():
    h = Harness()
    h.run(CFG.warn_evict_s - 1.0, pressure="warn")
    assert not h.times(EvictHead)
    h.run(1.5)
    (t_ev,) = h.times(EvictHead)
    assert CFG.warn_evict_s - 0.5 <= t_ev <= CFG.warn_evict_s + 0.5
    assert h.state.depth == 0


def test_warn_blocks_deeper_but_allows_shallower():
    h = Harness(state=State(depth=1, head_target=True))
    h.run(10.0, pressure="warn", scores=[10, 11, 20, 11, 10])
    assert h.state.depth == 1
    h.run(5.0, scores=[20, 11, 10, 9, 8])
    assert h.state.depth == 0


@pytest.mark.parametrize("period", [1.0, 2.0, 5.0, 13.0, 37.0, 61.0, 97.0, 150.0])
def test_flapping_at_most_one_load_evict_pair_per_restore_window(period):
    """A signal flipping normal <-> warn every ``period`` s for 30 simulated minutes."""
    h = Harness()
    while h.t < 1800.0:
        h.tick(pressure="warn" if int(h.t // period) % 2 else "normal")
    loads, evicts = h.times(LoadHead), h.times(EvictHead)
    w = CFG.restore_window_s
    for times in (loads, evicts):
        for t in times:
            assert sum(1 for u in times if t <= u < t + w) <= 1, (period, loads, evicts)
    # Every load came after a full restore window of normal pressure.
    for t in loads:
        window = [p for u, p in h.pressure_log if t - w <= u <= t]
        assert window and all(p == "normal" for p in window)
    if period <= CFG.warn_clear_s:
        # Fast flapping is one long warn episode: out once, never back.
        assert len(evicts) == 1 and not loads


# ---------------------------------------------------------------- restore slowly


def _evicted_by_critical(**obs) -> Harness:
    h = Harness(**obs)
    h.tick(pressure="critical")
    assert h.times(EvictHead)
    return h


def test_reload_waits_for_restore_window_and_anti_thrash_gap():
    h = _evicted_by_critical()
    h.run(CFG.min_reload_gap_s + CFG.restore_window_s + 5, pressure="normal", scores=[10, None, None, None, None])
    (t_load,) = h.times(LoadHead)
    assert t_load >= CFG.min_reload_gap_s - 1e-9  # the gap dominates: normal since ~0.25 s


def test_reload_needs_normal_for_the_whole_window():
    cfg = GovernorConfig(min_reload_gap_s=0.0)
    h = _evicted_by_critical(cfg=cfg)
    h.run(50.0, pressure="normal")
    h.run(1.0, pressure="warn")
    h.run(59.0, pressure="normal")
    assert not h.times(LoadHead)
    h.run(2.0)
    assert h.times(LoadHead)


def test_reload_needs_headroom_for_head_plus_margin():
    cfg = GovernorConfig(min_reload_gap_s=0.0)
    h = _evicted_by_critical(cfg=cfg)
    need = 850 * MiB + cfg.head_margin_bytes
    h.run(600.0, pressure="normal", available_bytes=need - 1)
    assert not h.times(LoadHead)
    _, reasons = h.tick()
    assert "headroom" in reasons[-1]["sentence"]
    h.run(1.0, available_bytes=need)
    assert h.times(LoadHead)
    h2 = _evicted_by_critical(cfg=cfg)
    h2.run(600.0, pressure="normal", available_bytes=None)  # headroom unknown: stay out
    assert not h2.times(LoadHead)


def test_reload_needs_a_predicted_gain():
    cfg = GovernorConfig(min_reload_gap_s=0.0, head_trial_interval_s=0.0)  # trials: their own tests
    h = _evicted_by_critical(cfg=cfg)
    h.run(600.0, pressure="normal", scores=[20.0, 12.0, 11.0, 10.0, 9.0])
    assert not h.times(LoadHead)
    h.run(1.0, scores=[10.0, 13.0, 12.0, 11.0, 10.0])
    assert h.times(LoadHead)


def test_no_reload_while_batching_several_streams():
    cfg = GovernorConfig(min_reload_gap_s=0.0)
    h = _evicted_by_critical(cfg=cfg)
    h.run(300.0, pressure="normal", active_streams=3)
    assert not h.times(LoadHead)


def test_idle_head_evicted_after_idle_evict_s():
    h = Harness(cfg=GovernorConfig(head_trial_interval_s=0.0), state=State(depth=1, head_target=True))
    h.run(5.0, scores=[20.0, 10.0, 9.0, 8.0, 7.0])  # speculation does not pay: depth 0
    assert h.state.depth == 0
    t0 = next(t for t, a in h.log if a == SetDepth(0))
    h.run(CFG.idle_evict_s - 10.0)
    assert not h.times(EvictHead)
    h.run(15.0)
    (t_ev,) = h.times(EvictHead)
    assert CFG.idle_evict_s - 0.5 <= t_ev - t0 <= CFG.idle_evict_s + 0.5
    # With trials off, it does not come back while the model says it would not pay.
    h.run(1200.0)
    assert not h.times(LoadHead)


def test_load_that_never_lands_times_out():
    cfg = GovernorConfig(load_timeout_s=30.0)
    h = Harness(cfg=cfg, state=State(depth=0, head_target=False), head_resident=False, apply_head=False)
    h.run(cfg.restore_window_s + 1)
    assert len(h.times(LoadHead)) == 1
    failed = []
    for _ in range(int((cfg.load_timeout_s + 1) / cfg.tick_s)):
        failed += [r for r in h.tick()[1] if r["decision"] == "load_failed"]
    assert len(failed) == 1 and h.state.head_target is False and h.state.depth == 0
    # A failed load counts as an eviction for the anti-thrash gap.
    h.run(cfg.min_reload_gap_s - 5)
    assert len(h.times(LoadHead)) == 1
    h.run(10.0)
    assert len(h.times(LoadHead)) == 2


def test_head_gone_means_depth_zero_and_no_model_head_means_no_load():
    h = Harness(state=State(depth=2, head_target=True))
    acts, _ = h.tick(head_resident=False)  # the daemon lost it (or never had it)
    assert acts[0] == SetDepth(0) and h.state.depth == 0
    h2 = Harness(state=State(depth=0, head_target=False), head_resident=False, head_available=False)
    h2.run(1000.0)
    assert not h2.times(LoadHead)


def test_unrequested_resident_head_is_adopted_after_the_evict_window():
    cfg = GovernorConfig(load_timeout_s=30.0)
    h = Harness(cfg=cfg, state=State(depth=0, head_target=False, last_evict_at=0.0), head_resident=True)
    h.run(29.0)
    assert h.state.head_target is False and h.state.depth == 0  # the evict may still land
    adopted = []
    for _ in range(12):
        adopted += [r for r in h.tick()[1] if r["decision"] == "head_adopted"]
    assert len(adopted) == 1 and h.state.head_target is True
    h.run(5.0)
    assert h.state.depth >= 1  # and used
    # Under critical pressure the adopted head goes straight back out.
    acts, _ = h.tick(pressure="critical")
    assert EvictHead() in acts


# ---------------------------------------------------------------- depth


def test_one_step_at_a_time_with_dwell():
    h = Harness(state=State(depth=0, head_target=True))
    h.run(10.0, scores=[10.0, 11.5, 13.0, 15.0, 30.0])
    sets = [(t, a.depth) for t, a in h.log if isinstance(a, SetDepth)]
    assert [d for _, d in sets] == [1, 2, 3, 4]
    assert all(b[0] - a[0] >= CFG.depth_dwell_s - 1e-9 for a, b in zip(sets, sets[1:]))


def test_hysteresis_needs_ten_percent():
    h = Harness(state=State(depth=0, head_target=True))
    h.run(120.0, scores=[10.0, 10.9, 10.5, 10.0, 9.0])
    assert h.state.depth == 0 and not h.times(SetDepth)
    h.run(2.0, scores=[10.0, 11.1, 10.5, 10.0, 9.0])
    assert h.state.depth == 1


def test_depth_goes_to_zero_when_cycles_cost_more_than_their_tokens():
    h = Harness(state=State(depth=3, head_target=True))
    h.run(10.0, scores=[10.0, 8.0, 7.0, 6.0, 5.0])
    assert [a.depth for _, a in h.log if isinstance(a, SetDepth)] == [2, 1, 0]


def test_several_streams_batch_at_depth_zero_then_climb_back():
    h = Harness(state=State(depth=2, head_target=True), scores=[10.0, 12.0, 13.5, 12.0, 11.0])
    acts, _ = h.tick(active_streams=3)
    assert acts == [SetDepth(0)]
    h.run(10.0)
    assert h.state.depth == 0
    h.run(5.0, active_streams=1)
    assert h.state.depth == 2


def test_stale_neighbour_is_probed_then_left():
    cfg = GovernorConfig(probe_interval_s=30.0, probe_s=2.0)
    h = Harness(cfg=cfg, state=State(depth=1, head_target=True))
    h.run(29.0, scores=GOOD, stale=[False, False, True, False, False])
    assert not h.times(SetDepth)
    h.run(2.0)
    assert h.moves() == [2] and h.state.probe_depth == 2  # probing depth 2
    h.run(3.0, scores=GOOD, stale=False)  # measured: not better
    assert h.state.depth == 1 and [d for _, d, _ in h.decisions].count("probe_end") == 1
    assert h.state.probe_depth is None and h.state.probe_count == 1


def test_stale_better_estimate_is_probed_not_trusted():
    h = Harness(state=State(depth=1, head_target=True))
    acts, reasons = h.tick(scores=[10.0, 13.0, 16.0, 11.0, 10.0], stale=[False, False, True, True, True])
    assert acts == [SetDepth(2)] and reasons[0]["decision"] == "probe"
    # The probe measures depth 2 as worse: back to 1 after probe_s.
    h.run(CFG.probe_s + 0.5, scores=[10.0, 13.0, 12.0, 11.0, 10.0], stale=False)
    assert h.state.depth == 1 and h.state.probe_depth is None


def test_decide_is_deterministic():
    def run():
        h = Harness(state=State(depth=1, head_target=True))
        for i in range(400):
            h.tick(pressure=["normal", "warn", "normal", "critical"][(i // 37) % 4],
                   scores=[10.0, 13.0 - (i % 50) / 10, 12.0, 11.0, 10.0], stale=i % 3 == 0)  # fmt: skip
        return h.log, h.state

    assert run() == run()


# ---------------------------------------------------------------- overrides


def test_pin_depth_wins_until_released():
    h = Harness(state=State(depth=1, head_target=True))
    h.state = apply_override(h.state, "pin_depth", 3)
    acts, reasons = h.tick(scores=[20.0, 10.0, 9.0, 8.0, 7.0])
    # The pin holds at every batch height too (SetHeightDepth per bucket 2, 3-4, 5-8, 9+).
    assert acts == [SetDepth(3)] + [SetHeightDepth(b, 3) for b in range(1, 5)] and "pinned" in reasons[0]["sentence"]
    h.run(60.0, active_streams=3)
    assert h.state.depth == 3
    h.state = apply_override(h.state, "auto")
    h.run(5.0, active_streams=1)
    assert h.state.depth == 0  # back to the cost model (and batching rules)


def test_pin_depth_loads_head_when_out():
    h = Harness(state=State(depth=0, head_target=False), head_resident=False)
    h.state = apply_override(h.state, "pin_depth", 2)
    acts, _ = h.tick(pressure="warn")
    assert acts == [LoadHead()]
    acts, _ = h.tick()
    assert acts == [SetDepth(2)] + [SetHeightDepth(b, 2) for b in range(1, 5)]


def test_force_evict_wins_until_released():
    h = Harness()
    h.state = apply_override(h.state, "evict_head")
    acts, _ = h.tick()
    assert acts == [SetDepth(0), EvictHead()]
    h.run(3600.0)  # perfect conditions: still out
    assert not h.times(LoadHead) and h.state.depth == 0
    h.state = apply_override(h.state, "auto")
    h.run(CFG.restore_window_s + 1)
    assert h.times(LoadHead)


def test_force_load_wins_over_warn_until_released():
    h = Harness(state=State(depth=0, head_target=False), head_resident=False)
    h.state = apply_override(h.state, "load_head")
    acts, _ = h.tick(pressure="warn")
    assert acts == [LoadHead()]
    h.run(120.0)  # sustained warn would evict under auto
    assert not h.times(EvictHead)
    h.state = apply_override(h.state, "auto")
    acts, _ = h.tick()
    assert EvictHead() in acts


def test_critical_can_be_configured_to_beat_overrides():
    cfg = GovernorConfig(critical_beats_override=True)
    h = Harness(cfg=cfg, state=apply_override(State(depth=2, head_target=True), "pin_depth", 2))
    h.run(1.0)
    acts, _ = h.tick(pressure="critical")
    assert EvictHead() in acts
    h2 = Harness(state=apply_override(State(depth=2, head_target=True), "pin_depth", 2))
    acts, _ = h2.tick(pressure="critical")
    assert EvictHead() not in acts and ShedAdmissions(True, CFG.shed_retry_after_s) in acts


def test_apply_override_rejects_nonsense():
    with pytest.raises(ValueError):
        apply_override(State(), "pin_depth", None)
    with pytest.raises(ValueError):
        apply_override(State(), "explode")


def test_config_from_the_daemon_table_is_validated():
    import msgspec

    from governor.config import load_config

    cfg = load_config({"warn_evict_s": 10, "linux": {"memavail_warn_bytes": 123}})
    assert cfg.warn_evict_s == 10 and cfg.linux.memavail_warn_bytes == 123
    assert load_config(None) == GovernorConfig()
    for bad in ({"tick_s": 0}, {"initial_depth": 9}, {"probe_s": 60}, {"no_such": 1}, {"cost_alpha": 2}):
        with pytest.raises(msgspec.ValidationError):
            load_config(bad)


# ---------------------------------------------------------------- decode clock


def test_probe_interval_counts_decode_time_not_idle_time():
    """Bursts with long idle gaps between them (a council's turn-taking): the wall clock
    passes probe_interval_s many times over, but a probe comes due only after
    probe_interval_s seconds of decoding, and then lasts probe_s seconds of decoding."""
    cfg = GovernorConfig(probe_interval_s=30.0, probe_s=2.0)
    stale2 = [False, False, True, False, False]
    h = Harness(cfg=cfg, state=State(depth=1, head_target=True), scores=GOOD)
    for _ in range(5):  # 5 bursts of 5 s decoding, each followed by 60 s idle
        h.run(5.0, scores=GOOD, stale=stale2, decoding=True)
        h.run(60.0, decoding=False)
    assert h.t > 300 and h.decode_s == pytest.approx(25.0)
    assert not h.times(SetDepth) and h.state.probe_count == 0
    h.run(4.5, decoding=True)  # 29.5 s of decoding: not yet
    assert not h.times(SetDepth)
    h.run(1.0)
    assert h.moves() == [2]  # probing depth 2
    probe_start = h.times(SetDepth)[0]
    h.run(1.0)  # the burst ends 1 s into the probe: an idle minute does not end it
    h.run(60.0, decoding=False)
    assert h.state.probe_depth == 2
    h.run(1.5, scores=GOOD, stale=False, decoding=True)  # 2 s of decoding, both depths sampled: judged
    assert h.state.probe_depth is None and h.state.depth == 1
    assert [d for _, d, _ in h.decisions].count("probe_end") == 1
    (end,) = [t for t, d, _ in h.decisions if d == "probe_end"]
    assert end - probe_start > 60.0


def test_wall_clock_interval_would_have_probed_every_burst():
    """The same bursts, decoding the whole time (decode clock = wall clock): the probe is due
    after 30 s, as before the decode clock. Guards against a decode clock that never runs."""
    cfg = GovernorConfig(probe_interval_s=30.0, probe_s=2.0)
    h = Harness(cfg=cfg, state=State(depth=1, head_target=True))
    h.run(31.0, scores=GOOD, stale=[False, False, True, False, False])
    assert h.moves() == [2] and h.state.probe_depth == 2


# ---------------------------------------------------------------- start depth


def _profile_obs(profile, cfg=CFG, **head):
    from governor.cost_model import CostModel

    fields = dict(head_available=True, head_resident=True, head_bytes=850 * MiB)
    fields.update(head)
    return Observation(**fields, estimates=CostModel(cfg, profile).estimates(0.0))


# This CPU (run 6): depth 1 costs ~1.97 serial steps for ~1.79 tokens.
SLOW_SPEC = {"cost_s": {"0": 0.010, "1": 0.0197, "2": 0.028, "3": 0.036, "4": 0.044},
             "acceptance": [0.79, 0.6, 0.5, 0.4]}
FAST_SPEC = {"cost_s": {"0": 0.010, "1": 0.0115, "2": 0.013, "3": 0.015, "4": 0.020},
             "acceptance": [0.9, 0.85, 0.8, 0.7]}


def test_start_depth_is_zero_when_the_profile_says_speculation_does_not_pay():
    k, why = start_depth(_profile_obs(SLOW_SPEC), CFG, configured=1)
    assert k == 0
    assert why["decision"] == "start_depth" and why["depth_from"] == 1 and why["depth_to"] == 0
    assert why["sentence"].startswith("tuned profile: no depth beats serial by 10%")
    assert "vs serial 100.0" in why["sentence"] and why["sources"][:2] == ["profile", "profile"]
    assert why["scores"][1] < why["scores"][0]


def test_start_depth_is_the_profiles_best_by_the_policys_score():
    obs = _profile_obs(FAST_SPEC)
    scores = [e.score for e in obs.estimates]
    best = max(range(1, 5), key=lambda k: scores[k])
    assert best == 3  # E(3)/cost(3): 3.28 tokens / 15 ms beats depth 2 (2.67 / 13 ms)
    k, why = start_depth(obs, CFG, configured=1)
    assert k == 3 and why["sentence"].startswith("tuned profile: depth 3 scores")
    # max_depth caps it: with max_depth 2 the best allowed is 2.
    cfg2 = GovernorConfig(max_depth=2, initial_depth=1)
    assert start_depth(_profile_obs(FAST_SPEC, cfg2), cfg2, configured=1)[0] == 2
    # A margin the best depth does not clear means serial.
    cfg_wide = GovernorConfig(depth_margin=2.0)
    assert start_depth(_profile_obs(FAST_SPEC, cfg_wide), cfg_wide, configured=1)[0] == 0


def test_start_depth_needs_a_resident_head_and_measured_depths():
    assert start_depth(_profile_obs(FAST_SPEC, head_resident=False), CFG, configured=2)[0] == 0
    assert start_depth(_profile_obs(FAST_SPEC, head_available=False), CFG, configured=2)[0] == 0
    # No profile: the configured depth, said to be a prior.
    k, why = start_depth(_profile_obs(None), CFG, configured=2)
    assert k == 2 and "no tuned costs" in why["sentence"]
    # A profile without depth 0 or without any measured speculative depth: configured.
    assert start_depth(_profile_obs({"cost_s": {"1": 0.01}}), CFG, configured=1)[0] == 1
    assert start_depth(_profile_obs({"cost_s": {"0": 0.01}}), CFG, configured=1)[0] == 1
    # A depth the profile did not measure is priced by the optimistic prior: never chosen.
    only_slow_1 = {"cost_s": {"0": 0.010, "1": 0.0197}, "acceptance": [0.79, 0.95, 0.95, 0.95]}
    obs = _profile_obs(only_slow_1)
    assert obs.estimates[3].source == "prior" and obs.estimates[3].score > obs.estimates[0].score * 1.1
    assert start_depth(obs, CFG, configured=1)[0] == 0


def test_a_profile_start_is_held_until_this_daemon_measures():
    """After a start at 0 from the profile, the first ticks have only profile (stale)
    estimates: no move, and no probe before probe_interval_s of decoding."""
    obs = _profile_obs(SLOW_SPEC)
    k, _ = start_depth(obs, CFG, configured=1)
    s = State(depth=k)
    for i in range(40):
        s, acts, reasons = decide(s, obs, i * 0.25, CFG)
        assert acts == [] and s.depth == 0


# ---------------------------------------------------------------- prompt caches before the head


def _shed(h: Harness, acts) -> None:
    """Apply LimitPromptCache as the daemon does (drop the oldest until under the cap)."""
    from governor.types import LimitPromptCache

    for a in acts:
        if isinstance(a, LimitPromptCache) and a.max_bytes is not None:
            h.obs["prompt_cache_bytes"] = min(h.obs["prompt_cache_bytes"], a.max_bytes)


def test_critical_sheds_prompt_caches_first_then_the_head():
    from governor.types import LimitPromptCache

    h = Harness(state=State(depth=1, head_target=True), prompt_cache_bytes=300 * MiB)
    acts, reasons = h.tick(pressure="critical", available_bytes=100 * MiB)
    assert LimitPromptCache(0) in acts and EvictHead() not in acts
    shed = next(r for r in reasons if r["decision"] == "shed_prompt_caches")
    assert shed["prompt_cache_bytes"] == 300 * MiB and shed["available_bytes"] == 100 * MiB
    assert any(r["decision"] == "evict_head_deferred" for r in reasons)
    _shed(h, acts)
    # Still critical with the caches gone: now the head.
    acts, _ = h.tick()
    assert EvictHead() in acts and not any(isinstance(a, LimitPromptCache) for a in acts)


def test_caches_shed_enough_keeps_the_head_and_the_cap_lifts_slowly():
    from governor.types import LimitPromptCache

    h = Harness(state=State(depth=1, head_target=True), prompt_cache_bytes=512 * MiB)
    acts, _ = h.tick(pressure="warn")
    assert acts == [LimitPromptCache(256 * MiB)]  # warn: the oldest half goes
    _shed(h, acts)
    acts = h.run(CFG.warn_clear_s + 1.0, pressure="normal")  # shedding was enough
    assert EvictHead() not in acts and h.obs["head_resident"]
    assert LimitPromptCache(None) not in acts  # not yet: restore slowly
    more = h.run(CFG.restore_window_s + 1.0)
    assert more.count(LimitPromptCache(None)) == 1 and h.state.prompt_cache_limit is None
    assert EvictHead() not in more


def test_no_prompt_caches_changes_nothing():
    from governor.types import LimitPromptCache

    h = Harness(state=State(depth=1, head_target=True))
    acts = h.run(10.0, pressure="warn") + h.run(5.0, pressure="critical")
    assert not any(isinstance(a, LimitPromptCache) for a in acts)
