"""The online cost model: E(k), conditional acceptance, trust, priors, staleness."""

from __future__ import annotations

import pytest

from governor.config import GovernorConfig
from governor.cost_model import CostModel
from governor.types import CycleTelemetry as C

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)

CFG = GovernorConfig()


def test_expected_tokens_formula_from_profile():
    # The seed's depth-4 acceptance chain.
    a = [0.831, 0.786, 0.771, 0.758]
    m = CostModel(CFG, profile={"acceptance": a})
    want, run = 1.0, 1.0
    for k in range(1, 5):
        run *= a[k - 1]
        want += run
        assert m.expected_tokens(k) == pytest.approx(want)
    assert m.expected_tokens(0) == 1.0


def test_conditional_acceptance_per_position():
    m = CostModel(CFG)
    # 100 cycles at depth 2: position 1 accepted 80 times; of those, position 2 accepted 40.
    for i in range(100):
        acc = 0 if i < 20 else (1 if i < 60 else 2)
        m.record(C(depth=2, drafted=2, accepted=acc, emitted=1 + acc, cycle_s=0.1), now=float(i))
    # EWMA with alpha 0.05 over a deterministic but ordered stream: check direction and the
    # counts, then an unordered stream for the values.
    snap = m.snapshot(100.0)
    assert snap["acceptance_samples"][:2] == [100, 80]
    m2 = CostModel(GovernorConfig(accept_alpha=0.001))
    for i in range(1000):
        acc = [0, 1, 1, 1, 2][i % 5]  # a1 = 4/5; a2 = 1/4 given position 1
        m2.record(C(depth=2, drafted=2, accepted=acc, cycle_s=0.1), now=float(i))
    assert m2.acceptance(1) == pytest.approx(0.8, abs=0.01)
    assert m2.acceptance(2) == pytest.approx(0.25, abs=0.02)
    assert m2.expected_tokens(2) == pytest.approx(1 + 0.8 + 0.8 * 0.25, abs=0.02)


def test_accepted_by_position_uses_leading_run():
    m = CostModel(GovernorConfig(accept_alpha=0.5, trust_samples=1))
    t = C(depth=3, drafted=3, accepted_by_position=(True, False, True), cycle_s=0.1)
    assert t.accepted_prefix() == 1
    m.record(t, now=0.0)
    snap = m.snapshot(0.0)
    assert snap["acceptance_samples"] == [1, 1, 0, 0]  # position 3 was never really tried
    assert m.acceptance(1) == 1.0 and m.acceptance(2) == 0.0


def test_cost_ewma_trust_and_blend_with_prior():
    cfg = GovernorConfig(trust_samples=8)
    m = CostModel(cfg)
    for i in range(50):
        m.record(C(depth=0, cycle_s=0.05), now=i * 0.05)
    e0 = m.estimate(0, now=2.5)
    assert e0.source == "measured" and e0.cost_s == pytest.approx(0.05) and e0.score == pytest.approx(20.0)
    # Depth 1 unmeasured: prior is 1.5 serial steps (prior_cost_per_depth 0.5).
    e1 = m.estimate(1, now=2.5)
    assert e1.source == "prior" and e1.cost_s == pytest.approx(0.075) and e1.stale
    # Two samples at 0.055: shrunk towards the prior, not trusted yet.
    for i in range(2):
        m.record(C(depth=1, drafted=1, accepted=1, emitted=2, cycle_s=0.055), now=2.6 + i * 0.05)
    e1 = m.estimate(1, now=2.7)
    assert e1.source == "blend"
    assert e1.cost_s == pytest.approx((2 * 0.055 + 6 * 0.075) / 8)
    for i in range(10):
        m.record(C(depth=1, drafted=1, accepted=1, emitted=2, cycle_s=0.055), now=2.8 + i * 0.05)
    e1 = m.estimate(1, now=3.5)
    assert e1.source == "measured" and e1.cost_s == pytest.approx(0.055) and not e1.stale


def test_profile_ratios_scale_with_live_serial_cost():
    prof = {"cost_s": {"0": 0.05, "1": 0.06, "2": 0.08}, "acceptance": [0.9, 0.8]}
    m = CostModel(CFG, profile=prof)
    assert m.estimate(1, now=0.0).cost_s == pytest.approx(0.06) and m.estimate(1, now=0.0).source == "profile"
    # The council doubled the serial step's cost: the profile's depth-2 prior doubles too.
    for i in range(20):
        m.record(C(depth=0, cycle_s=0.10), now=float(i))
    e2 = m.estimate(2, now=20.0)
    assert e2.cost_s == pytest.approx(0.16) and e2.source == "prior"


def test_profile_ranking_survives_the_first_few_live_cycles():
    """A few fast cycles at depth 0 must not make the depths priced from it look better
    than depth 0 itself: the anchor is shrunk to the profile exactly as depth 0's own
    estimate is, so until depth 0 is trusted the profile's ratio of scores holds."""
    prof = {"cost_s": {"0": 0.0086, "1": 0.0165}, "acceptance": [0.776]}
    m = CostModel(CFG, profile=prof)
    ratio = m.score(1, 0.0) / m.score(0, 0.0)
    assert ratio < 1.0
    for i in range(1, CFG.trust_samples + 4):
        m.record(C(depth=0, cycle_s=0.0066), now=0.01 * i)
        e0, e1 = m.estimate(0, 0.01 * i), m.estimate(1, 0.01 * i)
        assert e1.score / e0.score == pytest.approx(ratio), i
        assert e1.score < e0.score * (1 + CFG.depth_margin)
    assert m.estimate(0, 1.0).source == "measured" and m.estimate(0, 1.0).cost_s == pytest.approx(0.0066)


def test_score_is_tokens_per_second():
    m = CostModel(CFG, profile={"acceptance": [0.5]})
    for i in range(20):
        m.record(C(depth=0, cycle_s=0.1), now=float(i))
        m.record(C(depth=1, drafted=1, accepted=i % 2, emitted=1 + i % 2, cycle_s=0.2), now=float(i))
    e0, e1 = m.estimate(0, 20.0), m.estimate(1, 20.0)
    assert e0.score == pytest.approx(10.0)
    # 1.5 tokens per 0.2 s cycle: 7.5 tok/s, worse than serial.
    assert e1.score == pytest.approx(m.expected_tokens(1) / 0.2)
    assert e1.score < e0.score
    assert m.score(1, 20.0) == e1.score


def test_staleness_by_age_and_by_load():
    cfg = GovernorConfig(stale_after_s=30.0, stale_load_delta=0.25)
    m = CostModel(cfg)
    for i in range(10):
        m.record(C(depth=0, cycle_s=0.05), now=float(i), load=0.2)
    assert not m.stale(0, now=10.0, load=0.2)
    assert m.stale(0, now=10.0, load=0.8)  # the council moved: this cost is history
    assert m.stale(1, now=10.0)  # never measured
    # Age is decode time: an idle gap (the wall clock moves, nothing decodes) ages nothing...
    assert not m.stale(0, now=45.0, load=0.2)
    assert not m.stale(0, now=10_000.0, load=0.2)
    # ...while 30 s of decoding at another depth does: depth 0's cost is then too old.
    for i in range(299):
        m.record(C(depth=1, drafted=1, accepted=1, emitted=2, cycle_s=0.1), now=50.0 + 0.1 * i, load=0.2)
    assert m.decode_s == pytest.approx(0.5 + 29.9)
    assert not m.stale(0, now=80.0, load=0.2)  # 29.9 decode seconds: not yet
    m.record(C(depth=1, drafted=1, accepted=1, emitted=2, cycle_s=0.2), now=80.0, load=0.2)
    assert m.stale(0, now=80.0, load=0.2) and not m.stale(1, now=80.0, load=0.2)
    # Batched cycles are decode time too (the engine was busy), though they teach no cost.
    m.record(C(depth=0, cycle_s=31.0, emitted=2, batch=2), now=81.0, load=0.2)
    assert m.stale(1, now=81.0, load=0.2)


def test_stale_history_restarts_the_average():
    cfg = GovernorConfig(stale_after_s=30.0, cost_alpha=0.1)
    m = CostModel(cfg)
    for i in range(100):
        m.record(C(depth=0, cycle_s=0.05), now=i * 0.1, load=0.1)
    # Load jumps: the first new sample is not averaged with 100 old ones.
    m.record(C(depth=0, cycle_s=0.20), now=10.0, load=1.0)
    assert m.estimate(0, now=10.0, load=1.0).cost_s == pytest.approx(0.20)
    # Age restarts it too, but age is decode time: after an hour idle at the same load the
    # history still describes this machine, and the new sample joins it...
    for i in range(20):
        m.record(C(depth=0, cycle_s=0.20), now=10.1 + 0.1 * i, load=1.0)
    m.record(C(depth=0, cycle_s=0.80), now=3600.0, load=1.0)
    e0 = m.estimate(0, now=3600.0, load=1.0)
    assert e0.samples == 22 and e0.cost_s == pytest.approx(0.20) and not e0.stale
    # ...whereas after 30 s of decoding at depth 1 it is history, and a new sample starts afresh.
    for i in range(310):
        m.record(C(depth=1, drafted=1, accepted=1, emitted=2, cycle_s=0.1), now=3600.1 + 0.1 * i, load=1.0)
    assert m.stale(0, now=3700.0, load=1.0)
    m.record(C(depth=0, cycle_s=0.80), now=3700.0, load=1.0)
    e0 = m.estimate(0, now=3700.0, load=1.0)
    assert e0.samples == 1 and e0.source == "blend" and not e0.stale  # one sample, shrunk to its prior


def test_forget_after_reverts_to_prior():
    cfg = GovernorConfig(forget_after_s=100.0)
    m = CostModel(cfg)
    for i in range(20):
        m.record(C(depth=1, drafted=1, accepted=1, emitted=2, cycle_s=0.5), now=float(i))
    for i in range(20):
        m.record(C(depth=0, cycle_s=0.1), now=200.0 + i)
    e1 = m.estimate(1, now=220.0)
    assert e1.source == "prior" and e1.cost_s == pytest.approx(0.15)


def test_batched_cycles_do_not_teach_cost():
    m = CostModel(CFG)
    m.record(C(depth=0, cycle_s=1.0, emitted=4, batch=4), now=0.0)
    assert m.estimate(0, now=0.0).samples == 0 and m.batched_cycles == 1


def test_nothing_known_means_no_score():
    e = CostModel(CFG).estimate(2, now=0.0)
    assert e.score is None and e.cost_s is None and e.source == "none"


def test_telemetry_from_an_engine_step():
    from types import SimpleNamespace

    step = SimpleNamespace(tokens=[5, 6, 7], depth=3, drafted=3, accepted=2, accepted_mask=[True, True, False],
                           guarded=0, cycle_s=0.07)  # fmt: skip
    t = C.from_step(step)
    assert (t.depth, t.drafted, t.accepted, t.emitted, t.cycle_s, t.batch) == (3, 3, 2, 3, 0.07, 1)
    serial = C.from_step(SimpleNamespace(tokens=[1], cycle_s=0.02))
    assert serial.depth == 0 and serial.emitted == 1


def test_cost_ignores_preempted_cycles():
    """Heavy-tailed cycle times (a preempted cycle takes 10-20x the median) must not move a
    depth's cost: one outlier in the window leaves the estimate at the typical cycle."""
    from governor import CostModel, CycleTelemetry, GovernorConfig

    model = CostModel(GovernorConfig())
    for i in range(20):
        model.record(CycleTelemetry(depth=0, cycle_s=0.020), now=float(i))
    model.record(CycleTelemetry(depth=0, cycle_s=0.400), now=20.0)  # one preempted cycle
    assert model._cost[0].value == 0.020
    # A real shift (every cycle slower) does move it, within half a window.
    for i in range(21, 40):
        model.record(CycleTelemetry(depth=0, cycle_s=0.030), now=float(i))
    assert model._cost[0].value == 0.030


def test_restore_window_shorter_than_warn_clear_is_refused():
    import pytest

    from governor import GovernorConfig

    with pytest.raises(ValueError, match="restore_window_s"):
        GovernorConfig(restore_window_s=5.0, warn_clear_s=10.0)


def test_lookup_cycles_are_kept_apart_from_the_head_depths():
    m = CostModel(CFG)
    for i in range(10):
        m.record(C(depth=1, drafted=1, accepted=1, emitted=2, cycle_s=0.02), now=float(i))
    before = m.snapshot(10.0)
    assert m.lookup_estimate() is None
    # A lookup block of 8 drafted, 6 accepted: as wide as depth 8, but no depth's sample.
    for i in range(4):
        m.record(C(depth=8, drafted=8, accepted=6, emitted=7, cycle_s=0.05, source="lookup"), now=10.0 + i)
    after = m.snapshot(14.0)
    assert after["depths"] == before["depths"] and after["acceptance"] == before["acceptance"]
    est = m.lookup_estimate()
    assert (est.cycles, est.drafted, est.accepted) == (4, 32, 24)
    assert est.acceptance == pytest.approx(0.75) and est.tokens_per_cycle == pytest.approx(7.0)
    assert est.cost_s == pytest.approx(0.05) and est.score == pytest.approx(140.0)
    assert after["lookup"]["cycles"] == 4
    assert m.decode_s == pytest.approx(10 * 0.02 + 4 * 0.05)  # the decode clock counts them


def test_cycle_telemetry_from_step_carries_the_draft_source():
    class Step:
        depth, drafted, accepted, tokens, cycle_s, draft_source = 5, 5, 2, [1, 2, 3], 0.01, "lookup"

    t = C.from_step(Step())
    assert t.source == "lookup" and t.accepted_prefix() == 2


def test_batched_lookup_cycles_teach_no_height_its_cost_or_acceptance():
    """A batch's lookup cycle (rows verifying prompt-lookup blocks, batch_spec.py) is as wide as
    its longest block and runs no head: booked at that depth it would price the height's
    depths and the head's acceptance with it. It is counted apart; the decode clock runs."""
    m = CostModel(CFG)
    for i in range(12):
        m.record(C(depth=2, drafted=8, accepted=6, accepted_by_position=(True, True) * 3 + (False, False),
                   emitted=10, cycle_s=0.004, batch=4), now=float(i))
    before = m.snapshot(12.0)
    for i in range(6):
        m.record(C(depth=8, drafted=16, accepted=15, emitted=19, cycle_s=0.006, batch=4, source="lookup"),
                 now=12.0 + i)
    after = m.snapshot(18.0)
    for key in ("heights", "depths", "acceptance", "acceptance_samples"):
        assert after[key] == before[key], key
    assert (m.lookup_cycles, m.lookup_drafted, m.lookup_accepted) == (6, 96, 90)
    assert m.batched_cycles == 18 and m.decode_s == pytest.approx(12 * 0.004 + 6 * 0.006)
