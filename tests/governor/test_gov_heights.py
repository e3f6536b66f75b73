"""Depth per batch height: cost(B, k) learned from batched cycles, a depth chosen per bucket of
heights by E(k) / cost per row, with the solo depth's hysteresis; on a fake clock.

The two machines below are the issue's measurements (forward cost in 27 ms steps by batch
height and verify positions T = k + 1): the H200 (27B shape, 4-bit), where extra positions
are nearly free inside a batch of 4-8, and this CPU, where the forward is compute-bound.
Depth 4 (T = 5) was not measured: it is priced like T = 4 plus the T = 3 -> 4 step."""

from __future__ import annotations

from collections import Counter

import pytest

from governor.config import GovernorConfig
from governor.cost_model import CostModel
from governor.fakes import FakeClock, FakeLoad, FakeMemoryProbe, RecordingLogger, SimEngine, make_estimates, seed_like_cost
from governor.heights import bucket_label, bucket_of, depth_at
from governor.policy import decide
from governor.runtime import Governor
from governor.types import CycleTelemetry, HeightState, Observation, SetHeightDepth, State

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)

GiB, MiB = 1 << 30, 1 << 20
STEP_S = 0.027


def _extend(row: list[float]) -> list[float]:
    return row + [row[-1] + max(row[-1] - row[-2], 0.05)]


H200 = {1: _extend([1.00, 1.96, 2.62, 3.26]), 2: _extend([1.58, 2.40, 2.89, 3.28]),
        4: _extend([2.75, 3.28, 3.44, 3.33]), 8: _extend([4.34, 4.66, 5.02, 5.19])}  # fmt: skip
CPU = {4: _extend([1.52, 3.35, 4.66, 4.11]), 2: _extend([1.2, 2.3, 3.1, 3.0]), 3: _extend([1.4, 2.9, 4.0, 3.7])}


def table_cost(table):
    return lambda n, k: STEP_S * table[n][k]


def make(cfg=None, table=H200, streams=4, acceptance=0.85):
    clock, logger = FakeClock(0.0), RecordingLogger()
    load = FakeLoad(active=1)  # the daemon's view: one stream shares a forward (governance.update_load)
    gov = Governor(cfg or GovernorConfig(), clock=clock, memory_probes=[FakeMemoryProbe()], load=load,
                   head_resident=True, head_bytes=850 * MiB, logger=logger)  # fmt: skip
    state = {"streams": streams}
    eng = SimEngine(gov, seed_like_cost(serial_s=STEP_S, load_penalty=0.0), acceptance=acceptance,
                    load_fn=lambda: 0.0, streams_fn=lambda: state["streams"], batch_cost_fn=table_cost(table))  # fmt: skip
    return gov, clock, eng, logger, state


def decisions(logger, name):
    return [e[2] for e in logger.events if e[1] == "governor.decision" and e[2]["decision"] == name]


# ---------------------------------------------------------------- buckets


def test_buckets_are_1_2_3to4_5to8_9up():
    assert [bucket_of(n) for n in (1, 2, 3, 4, 5, 8, 9, 64)] == [0, 1, 2, 2, 3, 3, 4, 4]
    assert [bucket_label(b) for b in range(5)] == ["1", "2", "3-4", "5-8", "9+"]
    # Not chosen: the nearest chosen bucket's depth (ties to the lower), else the solo depth.
    heights = (None, 3, None, 1)
    assert [depth_at(heights, 2, n) for n in (1, 2, 3, 4, 6, 12)] == [2, 3, 3, 3, 3, 1]
    assert [depth_at((None, None, None, 0), 2, n) for n in (1, 2, 4, 8, 9)] == [2, 0, 0, 0, 0]
    assert [depth_at((None,) * 4, 2, n) for n in (1, 2, 4, 9)] == [2] * 4 and depth_at((), 1, 5) == 1


# ---------------------------------------------------------------- the cost model


def test_cost_per_row_is_learned_per_bucket_apart_from_solo():
    m = CostModel(GovernorConfig())
    for i in range(20):
        m.record(CycleTelemetry(depth=1, cycle_s=0.040, drafted=4, accepted=2, emitted=6, batch=4), float(i))
        m.record(CycleTelemetry(depth=1, cycle_s=0.036, drafted=3, accepted=1, emitted=4, batch=3), float(i))
        m.record(CycleTelemetry(depth=0, cycle_s=0.030, emitted=2, batch=2), float(i))
    b34, b2 = bucket_of(4), bucket_of(2)
    e = m.batch_estimate(b34, 1, 20.0)
    # 3 and 4 rows share a bucket; cost is per row: 0.040 / 4 and 0.036 / 3.
    assert e.source == "measured" and e.samples == 40 and e.cost_s == pytest.approx(0.011, abs=0.0011)
    assert m.batch_estimate(b2, 0, 20.0).cost_s == pytest.approx(0.015)
    assert m.batch_estimate(b2, 1, 20.0).samples == 0
    # The solo table learned nothing from batches; the decode clocks ran.
    assert all(est.samples == 0 for est in m.estimates(20.0))
    assert m.batch_decode_s()[b34 - 1] == pytest.approx(20 * 0.076)
    assert m.batch_decode_s()[b2 - 1] == pytest.approx(20 * 0.030)
    snap = m.snapshot(20.0)
    assert [h["heights"] for h in snap["heights"]] == ["2", "3-4", "5-8", "9+"]
    assert snap["heights"][1]["depths"][1]["samples"] == 40


def test_rows_accepted_prefixes_split_from_the_concatenated_mask():
    class Step:  # what the engine reports for a batched cycle (SHAPE.md), duck-typed
        depth, drafted, accepted, cycle_s, tokens = 2, 6, 3, 0.05, [1] * 9
        accepted_mask = [True, False, True, True, False, True]

    t = CycleTelemetry.from_step(Step(), batch=3)
    assert t.row_accepted == (1, 2, 0) and t.batch == 3
    m = CostModel(GovernorConfig(prior_acceptance=0.5))
    for i in range(200):
        m.record(t, float(i))
    # Position 1: accepted in rows 1 and 2 of 3; position 2: accepted once of the two tried.
    assert m.acceptance(1) == pytest.approx(2 / 3, abs=0.05)
    assert m.acceptance(2) == pytest.approx(0.5, abs=0.05)
    # Rows that drafted unequal counts cannot be split: no acceptance learned from them.

    class Ragged(Step):
        drafted, accepted_mask = 5, [True, False, True, True, False]

    assert CycleTelemetry.from_step(Ragged(), batch=3).row_accepted is None


def test_learned_line_prices_an_unmeasured_depth_in_a_bucket():
    m = CostModel(GovernorConfig())
    for i in range(10):
        m.record(CycleTelemetry(depth=0, cycle_s=0.04, emitted=4, batch=4), float(i))
        m.record(CycleTelemetry(depth=1, cycle_s=0.048, drafted=4, emitted=4, batch=4), float(i))
    e2 = m.batch_estimate(bucket_of(4), 2, 10.0)
    # Per row 0.010 at depth 0, 0.012 at depth 1: depth 2 priced on the bucket's own line,
    # not on the solo prior's 1 + 0.5 k (which would say 0.016).
    assert e2.source == "prior" and e2.cost_s == pytest.approx(0.014) and e2.stale


# ---------------------------------------------------------------- the policy


def _obs(batch_scores, stale=False, clock=(1.0, 0.0, 0.0, 0.0), **kw):
    ests = tuple(make_estimates(sc, stale=stale) if sc else () for sc in batch_scores)
    return Observation(head_resident=True, available_bytes=16 * GiB, active_streams=1,
                       estimates=make_estimates([10.0, 9.0, 8.0, 7.0, 6.0]), batch_estimates=ests,
                       batch_decode_s=clock, **kw)  # fmt: skip


def test_bucket_moves_one_step_only_for_a_ten_percent_better_score():
    cfg = GovernorConfig()
    s = State(depth=0, head_target=True, heights=(HeightState(depth=1),))
    # 9% better at depth 2: hold. 20% better: one step.
    s2, acts, _ = decide(s, _obs([[10.0, 10.0, 10.9, 10.0, 9.0]]), 5.0, cfg)
    assert not [a for a in acts if isinstance(a, SetHeightDepth)] and s2.heights[0].depth == 1
    s3, acts, reasons = decide(s, _obs([[10.0, 10.0, 11.0, 12.5, 12.0]]), 5.0, cfg)
    # The move starts as a paired probe of the next depth up (not of the best, 3, two away).
    assert acts == [SetHeightDepth(1, 2)] and s3.heights[0].probe_depth == 2 and s3.heights[0].probe_return == 1
    r = next(r for r in reasons if r["decision"] == "height_probe")
    assert r["heights"] == "2" and r["depth_from"] == 1 and r["depth_to"] == 2 and r["scores"][3] == 12.5
    # The probe alternates the two depths while it measures, then keeps 2 only if it scores
    # the margin better than 1 (here 20% better, with samples growing on both sides).
    s4, acts, reasons = decide(s3, _obs([[10.0, 10.0, 11.0, 12.5, 12.0]], clock=(1.5, 0, 0, 0)), 5.25, cfg)
    assert acts == [SetHeightDepth(1, 1)] and reasons[-1]["decision"] == "height_probe_step"
    grown = [[10.0, 10.0, 12.0, 12.5, 12.0]]
    ests = tuple(make_estimates(sc, samples=100) for sc in grown)
    obs = Observation(head_resident=True, available_bytes=16 * GiB, active_streams=1,
                      estimates=make_estimates([10.0, 9.0, 8.0, 7.0, 6.0]), batch_estimates=ests,
                      batch_decode_s=(1.0 + cfg.probe_s * cfg.probe_max_factor, 0, 0, 0))  # fmt: skip
    s5, acts, reasons = decide(s4, obs, 5.5, cfg)
    assert s5.heights[0].depth == 2 and s5.heights[0].probe_depth is None
    assert next(r for r in reasons if r["decision"] == "height_probe_end")["sentence"].endswith("stay")


def test_bucket_that_did_not_decode_does_not_decide():
    cfg = GovernorConfig()
    s = State(depth=0, head_target=True, heights=(HeightState(depth=1, seen_s=1.0),))
    s2, acts, _ = decide(s, _obs([[10.0, 10.0, 20.0, 10.0, 9.0]], clock=(1.0, 0, 0, 0)), 5.0, cfg)
    assert acts == [] and s2.heights[0].depth == 1


# ---------------------------------------------------------------- the runtime on two machines


def test_before_any_batch_every_height_follows_the_solo_depth():
    gov, clock, eng, logger, st = make()
    st["streams"] = 1
    eng.run(5.0, clock)
    assert all(gov.depth_for(n) == gov.depth for n in (2, 3, 4, 8, 16))
    assert all(row["chosen"] is None for row in gov.height_table()[1:])


def test_h200_like_batch_of_four_speculates():
    gov, clock, eng, logger, st = make(table=H200, streams=4)
    eng.run(90.0, clock)
    assert gov.depth_for(4) >= 2
    assert gov.depth_for(3) == gov.depth_for(4)  # one bucket
    # Every move of the bucket was logged as one decision with its inputs.
    moves = decisions(logger, "height_probe") + decisions(logger, "height_probe_end")
    assert moves and all(m["heights"] == "3-4" and "scores" in m and "samples" in m for m in moves)


def test_cpu_like_batch_of_four_stays_serial():
    gov, clock, eng, logger, st = make(table=CPU, streams=4)
    gov.state = gov.state.__class__(depth=1, head_target=True)  # the solo depth speculates
    eng.run(90.0, clock)
    assert gov.depth_for(4) == 0
    # It looked (depth 1 was probed against 0) and kept 0.
    probes = decisions(logger, "height_probe")
    assert probes and decisions(logger, "height_probe_end")
    # Most of the batch's decoding ran at depth 0.
    snap = gov.snapshot()["cost_model"]["heights"][bucket_of(4) - 1]["depths"]
    assert snap[0]["samples"] > 3 * sum(d["samples"] for d in snap[1:])


def test_height_alternating_2_3_2_3_does_not_flip_flop():
    cfg = GovernorConfig()
    gov, clock, eng, logger, st = make(cfg=cfg, table=H200)
    flip = {"n": 2}

    def streams() -> int:
        flip["n"] = 5 - flip["n"]  # 3, 2, 3, 2, ... every cycle
        return flip["n"]

    eng.streams_fn = streams
    table = dict(H200)
    table[3] = [(a + b) / 2 for a, b in zip(H200[2], H200[4])]
    eng.batch_cost_fn = table_cost(table)
    # Two minutes to settle: with the noise-aware margin (3% on this steady table) the
    # buckets climb on to depth 4 (4% and 11% better than 3 per row here) through the
    # stale-neighbour probes of the second minute; a fixed 10% margin stopped at 3.
    eng.run(120.0, clock)
    settled = (gov.depth_for(2), gov.depth_for(3))

    def moves() -> list[dict]:  # verdicts that changed a bucket's depth
        return [d for d in decisions(logger, "height_probe_end") + decisions(logger, "height_depth")
                if d["depth_to"] != d["depth_from"]]

    changes_before = len(moves())
    eng.run(60.0, clock)
    # Settled, the two buckets keep their depths: no move in the next minute (only probes,
    # which return unless they find the margin better), and each speculates here.
    assert (gov.depth_for(2), gov.depth_for(3)) == settled and min(settled) >= 1
    assert len(moves()) == changes_before
    # Few moves per bucket in all: no flip-flop while the height alternated every cycle.
    per_bucket = Counter(d["heights"] for d in moves())
    assert set(per_bucket) <= {"2", "3-4"} and all(n <= cfg.max_depth for n in per_bucket.values())


def test_pin_applies_to_every_height_and_holds_against_the_scores():
    gov, clock, eng, logger, st = make(table=CPU, streams=4)
    eng.run(20.0, clock)
    assert gov.depth_for(4) == 0
    eng.apply(gov.override("pin_depth", 2))
    eng.run(30.0, clock)
    assert [gov.depth_for(n) for n in (1, 2, 4, 8, 16)] == [2] * 5
    assert eng.heights == [2, 2, 2, 2]  # what the engine was told
    table = gov.snapshot()["depth_by_height"]
    assert [r["depth"] for r in table] == [2] * 5
    eng.apply(gov.override("auto"))
    eng.run(60.0, clock)
    assert gov.depth_for(4) < 2  # released: the cost model decides again


def test_a_profile_can_carry_cost_by_batch_height_as_a_prior():
    prof = {"cost_s": {"0": 0.03, "1": 0.05}, "batch_cost_s": {"4": {"0": 0.01, "1": 0.0105}}}
    m = CostModel(GovernorConfig(), prof)
    e = m.batch_estimate(bucket_of(3), 1, 0.0)
    assert e.source == "profile" and e.cost_s == pytest.approx(0.0105) and e.stale  # a prior: probe before trusting
    assert m.batch_estimate(bucket_of(8), 1, 0.0).score is None  # nothing known at 5-8
    for i in range(3):  # a few live samples at depth 0: depth 1 priced by the profile's ratio
        m.record(CycleTelemetry(depth=0, cycle_s=0.08, emitted=4, batch=4), float(i))
    assert m.batch_estimate(bucket_of(4), 1, 3.0).cost_s == pytest.approx(
        ((3 * 0.02 + 5 * 0.01) / 8) * 1.05)  # shrunk towards the profile's 0.01, times 1.05
    assert CostModel(GovernorConfig(), m.profile()).profile() == m.profile()


def test_a_probe_that_never_ran_its_depth_does_not_move_the_bucket():
    """An engine whose batches do not draft (the batch path before batched speculation)
    reports every batched cycle at depth 0 whatever the table says: the prior for depth 1
    looks 20% better, the probe gets no depth-1 cycle, and the bucket stays at 0."""
    gov, clock, eng, logger, st = make(table=H200, streams=4)
    gov.state = gov.state.__class__(depth=0, head_target=True)
    eng.depth = 0

    def serial_batch() -> CycleTelemetry:
        t = CycleTelemetry(depth=0, cycle_s=STEP_S * 2.75, emitted=4, batch=4)
        gov.record_cycle(t)
        return t

    eng.cycle = serial_batch
    eng.run(60.0, clock)
    # It looked, and after a probe that ran none of depth 1's cycles, looks again only on
    # the probe interval (30 s of the bucket's decoding), not tick after tick.
    assert 1 <= len(decisions(logger, "height_probe")) <= 2
    ends = decisions(logger, "height_probe_end")
    assert ends and all(e["depth_to"] == 0 for e in ends) and "not measured" in ends[0]["sentence"]
    assert gov.depth_for(4) == 0


def test_a_bucket_first_measured_is_named_until_its_first_decision_takes_it():
    """``first_measurements``: the daemon ticks at once for a bucket whose depth is not chosen
    but which has a booked cycle (governance.safe_point), so its batches stop running at the
    borrowed depth a whole tick sooner. A transition cycle (a shape's first use) books nothing;
    the tick's first decision chooses the bucket's depth, and it is not named again."""
    gov, clock, eng, logger, st = make(table=CPU, streams=4)
    b = bucket_of(4)
    assert gov.first_measurements() == frozenset()
    gov.record_cycle(CycleTelemetry(depth=1, cycle_s=0.1, drafted=4, accepted=2, emitted=6, batch=4, transition=True))
    assert gov.first_measurements() == frozenset()  # the first use of a shape is not a measurement
    gov.record_cycle(CycleTelemetry(depth=1, cycle_s=0.1, drafted=4, accepted=2, emitted=6, batch=4))
    assert gov.first_measurements() == {b}
    clock.advance(0.01)  # sooner than tick_s: the daemon's early tick
    gov.tick()
    assert [d["heights"] for d in decisions(logger, "height_adopt")] == [bucket_label(b)]
    assert gov.height_table()[b]["chosen"] is not None
    assert gov.first_measurements() == frozenset()
