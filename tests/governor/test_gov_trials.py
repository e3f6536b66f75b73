"""The policy's trials, on the pure policy and the fake engine: a head that left because
it did not pay comes back on (rate-limited) trial, probes are paired so a regime change
during one cannot decide it, and what ``pin_depth 0`` does to the head."""

from __future__ import annotations

from test_gov_policy import GOOD, Harness

from governor.config import GovernorConfig
from governor.fakes import FakeClock, FakeLoad, FakeMemoryProbe, RecordingLogger, SimEngine
from governor.policy import apply_override
from governor.runtime import Governor
from governor.types import EvictHead, LoadHead, SetDepth, State
import pytest

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)

MiB = 1 << 20
LOSES = [20.0, 10.0, 9.0, 8.0, 7.0]  # speculation does not pay: serial is twice as good


def _idle_evicted(cfg: GovernorConfig) -> Harness:
    h = Harness(cfg=cfg, state=State(depth=1, head_target=True))
    h.run(cfg.idle_evict_s + 10.0, scores=LOSES)
    assert len(h.times(EvictHead)) == 1 and not h.obs["head_resident"]
    return h


def _trials(h: Harness) -> list[float]:
    return [t for t, d, _ in h.decisions if d == "load_head"]


def test_an_idle_evicted_head_returns_on_trial_and_leaves_at_once_when_it_still_does_not_pay():
    cfg = GovernorConfig()
    h = _idle_evicted(cfg)
    t_out = h.times(EvictHead)[0]
    h.run(2000.0)
    loads, evicts = h.times(LoadHead), h.times(EvictHead)[1:]
    assert len(loads) == len(evicts) >= 3
    # The first trial after head_trial_interval_s of decoding (the harness decodes throughout).
    assert cfg.head_trial_interval_s <= loads[0] - t_out <= cfg.head_trial_interval_s + 1.0
    for ld, ev in zip(loads, evicts):
        # Out again as soon as the paired probe is judged, not after idle_evict_s.
        assert cfg.probe_s <= ev - ld <= cfg.probe_s * cfg.probe_max_factor + 1.0
    # Back-off: each failed trial doubles the wait (120, 240, 480 s of decoding ...).
    waits = [ld - ev for ev, ld in zip([t_out] + evicts, loads)]
    for a, b in zip(waits, waits[1:]):
        assert b >= 1.9 * a
    sentences = [d for _, d, _ in h.decisions if d == "evict_head"]
    assert len(sentences) == len(evicts) + 1
    assert h.state.trial_failures == len(loads) and h.state.depth == 0


def test_a_trial_keeps_the_head_when_speculation_pays_now():
    """The regime changed while the head was out (other text, other load): the trial's
    probe measures depth 1 better by the margin, and the head stays, at depth 1."""
    cfg = GovernorConfig()
    h = _idle_evicted(cfg)
    while not h.times(LoadHead):
        h.tick()
    assert h.state.head_trial
    h.run(1.0, scores=GOOD)  # what depth 1 measures now: 13 vs 10 at serial
    h.run(20.0)
    assert len(h.times(EvictHead)) == 1  # only the idle eviction
    assert h.obs["head_resident"] and h.state.depth == 1
    assert not h.state.head_trial and h.state.trial_failures == 0


def test_trial_conditions_pressure_streams_pin_and_the_off_switch():
    for cfg, changes in (
        (GovernorConfig(), {"pressure": "warn"}),  # no trial outside normal pressure
        (GovernorConfig(), {"active_streams": 3}),  # nor while several streams batch
        (GovernorConfig(), {"decoding": False, "active_streams": 0}),  # nor with nothing to measure
        (GovernorConfig(head_trial_interval_s=0.0), {}),  # off
    ):
        h = _idle_evicted(cfg)
        h.run(1500.0, **changes)
        assert not h.times(LoadHead), changes
    h = _idle_evicted(GovernorConfig())
    h.state = apply_override(h.state, "pin_depth", 0)
    h.run(1500.0)
    assert not h.times(LoadHead)
    h.state = apply_override(h.state, "auto")
    h.run(200.0)
    assert h.times(LoadHead)  # released: trials resume (the decode clock kept running)


def test_pin_zero_leaves_the_head_to_the_ordinary_rules_and_never_loads_it():
    cfg = GovernorConfig()
    h = Harness(cfg=cfg, state=apply_override(State(depth=1, head_target=True), "pin_depth", 0))
    h.run(10.0, scores=GOOD)  # depth 1 would pay; the pin says serial
    assert h.state.depth == 0 and not h.times(EvictHead) and h.obs["head_resident"]
    h.run(cfg.idle_evict_s)  # unused at depth 0 for idle_evict_s: the idle rule takes it
    assert len(h.times(EvictHead)) == 1
    h.run(1000.0)  # a predicted gain, calm pressure, headroom: still no reload while pinned
    assert not h.times(LoadHead) and h.state.depth == 0
    h.state = apply_override(h.state, "auto")
    h.run(5.0)
    assert h.times(LoadHead)  # released: the predicted gain brings it back
    # pin_depth k > 0 still loads the head at once (unchanged).
    h2 = Harness(cfg=cfg, state=State(depth=0, head_target=False), head_resident=False)
    h2.state = apply_override(h2.state, "pin_depth", 2)
    h2.tick()
    assert h2.times(LoadHead)


def test_a_probe_alternates_depths_until_both_have_a_window_of_new_cycles():
    cfg = GovernorConfig(probe_interval_s=30.0, probe_s=2.0)
    h = Harness(cfg=cfg, state=State(depth=1, head_target=True))
    h.cycles_per_tick = 4  # slow cycles: 2 s of probing gives each depth only 16 of 32
    h.run(31.0, scores=GOOD, stale=[False, False, True, False, False])
    start = next(t for t, d, _ in h.decisions if d == "probe")
    h.run(12.0)
    (end,) = [t for t, d, _ in h.decisions if d == "probe_end"]
    steps = [k for t, d, k in h.decisions if d == "probe_step"]
    assert set(steps) == {1, 2} and all(a != b for a, b in zip(steps, steps[1:]))  # ABAB
    # Extended past probe_s until both depths had cost_window new samples (16 ticks), capped.
    assert cfg.probe_s < end - start <= cfg.probe_s * cfg.probe_max_factor
    assert end - start >= 2 * cfg.cost_window / 4 * cfg.tick_s - cfg.tick_s


def _make(cfg, **kw):
    clock, load = FakeClock(0.0), FakeLoad()
    gov = Governor(cfg, clock=clock, memory_probes=[FakeMemoryProbe()], load=load, head_bytes=850 * MiB,
                   head_resident=True, logger=RecordingLogger(), **kw)  # fmt: skip
    return gov, clock


def test_a_regime_change_at_a_probes_start_does_not_decide_it():
    """Depth 1 beats depth 2 in every regime here (acceptance 0.85, a drafted position costs
    0.9 steps), but the machine gets three times faster the moment the probe of depth 2
    begins (a burst ends, another process stops: nothing the load signal shows). Unpaired,
    depth 2 measured fast was compared with depth 1 measured slow, and kept. Paired, both
    are measured after the change: back to depth 1."""
    cfg = GovernorConfig(probe_interval_s=30.0, probe_s=2.0)
    gov, clock = _make(cfg, initial_depth=1)
    switched = []

    def slowdown() -> float:
        if gov.state.probe_depth is not None or switched:
            switched.append(True)
            return 1.0
        return 3.0

    eng = SimEngine(gov, lambda k, slow: 0.01 * slow * (1.0 + 0.9 * k), acceptance=0.85, load_fn=slowdown)
    eng.run(45.0, clock)
    assert switched and gov.state.probe_count >= 1
    ends = [e[2] for e in gov.log.events if e[2].get("decision") == "probe_end"]
    assert ends and "probed depth 2" in ends[0]["sentence"] and "not better" in ends[0]["sentence"]
    assert gov.depth == 1
    moves = [a.depth for _, a in eng.history if isinstance(a, SetDepth)]
    assert moves[0] == 2 and 2 < len(moves)  # the probe alternated 2, 1, 2, ...


def test_a_clear_verdict_ends_the_probe_after_probe_s():
    """Depth 2 scores three times depth 1: no need to wait for a full window of each (half of
    that wait would be spent at the much worse depth)."""
    cfg = GovernorConfig(probe_interval_s=30.0, probe_s=2.0)
    h = Harness(cfg=cfg, state=State(depth=1, head_target=True))
    h.cycles_per_tick = 4
    h.run(31.0, scores=[10.0, 13.0, 40.0, 11.0, 10.0], stale=[False, False, True, False, False])
    start = next(t for t, d, _ in h.decisions if d == "probe")
    h.run(12.0, scores=[10.0, 13.0, 40.0, 11.0, 10.0], stale=False)
    end = next(t for t, d, _ in h.decisions if d == "probe_end")
    assert cfg.probe_s <= end - start <= cfg.probe_s + 3 * cfg.tick_s
    assert h.state.depth == 2
