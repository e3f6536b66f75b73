"""Property test: random observation sequences through decide(); the invariants hold."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from governor.config import GovernorConfig
from governor.fakes import make_estimates
from governor.policy import apply_override, decide
from governor.types import EvictHead, LoadHead, Observation, SetDepth, ShedAdmissions, State
import pytest

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)

MiB, GiB = 1 << 20, 1 << 30
CFG = GovernorConfig(min_reload_gap_s=20.0, restore_window_s=10.0, warn_evict_s=5.0, idle_evict_s=30.0)
HEAD = 850 * MiB

score = st.one_of(st.none(), st.floats(min_value=0.5, max_value=100.0))
step = st.fixed_dictionaries(
    {
        "pressure": st.sampled_from(["normal", "normal", "normal", "warn", "critical"]),
        "dt": st.sampled_from([0.25, 0.25, 1.0, 5.0, 30.0, 120.0]),
        "avail": st.sampled_from([None, 100 * MiB, 1 * GiB, 16 * GiB, 16 * GiB]),
        "streams": st.sampled_from([0, 1, 1, 1, 1, 1, 2, 4]),
        "head_available": st.sampled_from([True, True, True, False]),
        "scores": st.lists(score, min_size=CFG.max_depth + 1, max_size=CFG.max_depth + 1),
        "stale": st.lists(st.sampled_from([False, False, False, True]), min_size=CFG.max_depth + 1,
                          max_size=CFG.max_depth + 1),
        # Costs drift rather than jump every tick: most ticks keep the previous estimates.
        "new_scores": st.sampled_from([False, False, False, True]),
        # Whether the daemon applies a head action before the next tick (loads take time).
        "applied": st.booleans(),
        "override": st.sampled_from([None] * 12 + ["auto", "evict_head", "load_head", "pin0", "pin2", "pin4"]),
    }
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(step, min_size=10, max_size=120), start_depth=st.integers(0, CFG.max_depth),
       resident=st.booleans())  # fmt: skip
def test_policy_invariants(steps, start_depth, resident):
    state = State(depth=start_depth if resident else 0)
    head_resident, pending = resident, None
    now = 0.0
    ests = make_estimates(steps[0]["scores"], stale=steps[0]["stale"])
    for s in steps:
        if s["new_scores"]:
            ests = make_estimates(s["scores"], stale=s["stale"])
        if s["override"]:
            o = s["override"]
            state = apply_override(state, "pin_depth", int(o[3:])) if o.startswith("pin") else apply_override(state, o)
        if pending is not None and s["applied"]:
            head_resident, pending = pending, None
        obs = Observation(
            pressure=s["pressure"], available_bytes=s["avail"], head_available=s["head_available"],
            head_resident=head_resident and s["head_available"], head_loading=pending is True, head_bytes=HEAD,
            active_streams=s["streams"], cpu_load=0.2, estimates=ests,
        )  # fmt: skip
        before = state
        state, actions, reasons = decide(state, obs, now, CFG)
        auto = state.override == "auto"

        assert reasons and all(r["decision"] and r["sentence"] for r in reasons)
        assert 0 <= state.depth <= CFG.max_depth
        # One depth step per tick, except the safety drop to 0, an operator pin, and a probe
        # (it measures the depth that looks best directly, then stays or goes back).
        if abs(state.depth - before.depth) > 1:
            probe = {r["decision"] for r in reasons} & {"probe", "probe_step", "probe_end"}
            assert state.depth == 0 or state.override == "pin_depth" or probe
            if probe and state.probe_depth is not None:
                assert state.depth in (state.probe_depth, state.probe_return)
        sets = [a for a in actions if isinstance(a, SetDepth)]
        assert len(sets) <= 1 + any(isinstance(a, EvictHead) for a in actions)
        if sets:
            assert sets[-1].depth == state.depth
        else:
            assert state.depth == before.depth
        loads = [a for a in actions if isinstance(a, LoadHead)]
        evicts = [a for a in actions if isinstance(a, EvictHead)]
        assert not (loads and evicts)
        if loads:
            assert obs.head_available
            if auto:
                assert obs.pressure == "normal"
                assert obs.available_bytes is not None and obs.available_bytes >= HEAD + CFG.head_margin_bytes
                assert obs.active_streams < CFG.batch_streams
        if state.depth > 0:
            assert obs.head_resident  # never speculate without the head
        if auto and obs.pressure == "critical":
            assert state.depth == 0 and not state.head_target and state.shedding
        if auto and obs.active_streams >= CFG.batch_streams:
            assert state.depth == 0
        if obs.pressure == "critical":
            assert state.shedding
        assert sum(isinstance(a, ShedAdmissions) for a in actions) <= 1

        if loads:
            pending = True
        if evicts:
            pending = False
        now += s["dt"]
