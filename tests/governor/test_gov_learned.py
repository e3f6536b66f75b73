"""What a governor learned, kept for the next start: CostModel.measured, Governor.learned, and
a governor started from it (governor/learned.py); on a fake clock, the CPU-like council of
test_gov_heights (a batch of four is compute-bound: depth 0 wins there)."""

from __future__ import annotations

import pytest

from governor.config import GovernorConfig
from governor.cost_model import CostModel
from governor.fakes import FakeClock, FakeLoad, FakeMemoryProbe, RecordingLogger, SimEngine, seed_like_cost
from governor.heights import bucket_of
from governor.runtime import Governor
from governor.types import CycleTelemetry

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)

MiB = 1 << 20
STEP_S = 0.027
CPU = {4: [1.52, 3.35, 4.66, 4.11, 5.0], 2: [1.25, 2.6, 3.6, 3.9, 4.6], 1: [1.0, 1.9, 2.6, 3.2, 3.8]}


def make(profile=None, streams=4):
    clock, logger = FakeClock(0.0), RecordingLogger()
    gov = Governor(GovernorConfig(), clock=clock, memory_probes=[FakeMemoryProbe()], load=FakeLoad(active=1),
                   head_resident=True, head_bytes=850 * MiB, logger=logger, profile=profile, initial_depth=2)
    eng = SimEngine(gov, seed_like_cost(serial_s=STEP_S, load_penalty=0.0), acceptance=0.6, load_fn=lambda: 0.0,
                    streams_fn=lambda: streams, batch_cost_fn=lambda n, k: STEP_S * CPU[n][k])
    return gov, clock, eng, logger


def decisions(logger, name):
    return [e[2] for e in logger.events if e[1] == "governor.decision" and e[2]["decision"] == name]


def batch_depths(gov):
    """Batched cycles at heights 3-4 by depth (the cost model's sample counts)."""
    snap = gov.snapshot()["cost_model"]["heights"][bucket_of(4) - 1]["depths"]
    return [d["samples"] for d in snap]


def test_measured_keeps_only_what_enough_cycles_stand_behind():
    m = CostModel(GovernorConfig())
    for i in range(10):
        m.record(CycleTelemetry(depth=0, cycle_s=0.02, emitted=1), float(i))
        m.record(CycleTelemetry(depth=0, cycle_s=0.03, emitted=4, batch=4), float(i))
    for i in range(3):  # fewer than trust_samples (8): not a measurement to keep
        m.record(CycleTelemetry(depth=1, cycle_s=0.05, drafted=1, accepted=1, emitted=2), float(i))
    got = m.measured()
    assert got["cost_s"] == {"0": pytest.approx(0.02)}
    assert got["batch_cost_s"] == {"4": {"0": pytest.approx(0.03 / 4)}}
    assert got["acceptance"] == []  # 3 samples of position 1
    # Seeded back, it is a prior ("profile"), never a measurement of the new model.
    again = CostModel(GovernorConfig(), got)
    assert again.estimate(0, 0.0).source == "profile" and again.estimate(0, 0.0).samples == 0
    assert again.batch_estimate(bucket_of(4), 0, 0.0).cost_s == pytest.approx(0.03 / 4)


def test_a_load_change_at_the_end_of_a_run_does_not_lose_what_was_learned():
    """A staleness reset (the CPU load moved more than stale_load_delta) starts a new window
    for the policy; the saved profile keeps the last trusted cost until the new window has
    trust_samples cycles, then takes the new one."""
    cfg = GovernorConfig()
    m = CostModel(cfg)
    for i in range(10):
        m.record(CycleTelemetry(depth=1, cycle_s=0.04, drafted=1, accepted=1, emitted=2), float(i), load=0.2)
        m.record(CycleTelemetry(depth=0, cycle_s=0.02, emitted=2, batch=2), float(i), load=0.2)
    loaded = 0.2 + 2 * cfg.stale_load_delta
    for i in range(3):  # the load moved: a new window, short of trust_samples
        m.record(CycleTelemetry(depth=1, cycle_s=0.09, drafted=1, accepted=1, emitted=2), 10.0 + i, load=loaded)
        m.record(CycleTelemetry(depth=0, cycle_s=0.05, emitted=2, batch=2), 10.0 + i, load=loaded)
    assert m.estimate(1, 13.0, loaded).samples == 3  # the policy sees the new window only
    got = m.measured()
    assert got["cost_s"] == {"1": pytest.approx(0.04)}
    assert got["batch_cost_s"] == {"2": {"0": pytest.approx(0.01)}}
    for i in range(cfg.trust_samples):  # the new window trusted: it wins
        m.record(CycleTelemetry(depth=1, cycle_s=0.09, drafted=1, accepted=1, emitted=2), 13.0 + i, load=loaded)
    assert m.measured()["cost_s"] == {"1": pytest.approx(0.09)}
    # A window that never reached trust_samples before its reset leaves nothing behind.
    fresh = CostModel(cfg)
    for i, load in enumerate([0.2, 0.2, 0.2, loaded, loaded]):
        fresh.record(CycleTelemetry(depth=0, cycle_s=0.02, emitted=1), float(i), load=load)
    assert fresh.measured()["cost_s"] == {}


def test_a_restart_starts_where_the_last_run_left_each_height_and_does_not_explore_again():
    first, clock, eng, _ = make()
    eng.run(90.0, clock)
    assert first.depth_for(4) == 0  # the CPU-like batch learned depth 0 (after probing depth 1)
    learned = first.learned()
    assert learned["depths"]["4"] == 0 and {"0", "1"} <= set(learned["batch_cost_s"]["4"])

    # Without it: the first seconds of a council batch at the configured depth (2, a prior).
    fresh, clock, eng, logger = make()
    eng.run(10.0, clock)
    assert sum(batch_depths(fresh)[1:]) > 0

    again, clock, eng, logger = make(profile=learned)
    (start,) = decisions(logger, "height_start")
    assert start["heights"] == "3-4" and start["depth_to"] == 0 and "learned profile" in start["sentence"]
    assert again.height_table()[bucket_of(4)]["chosen"] == 0
    eng.run(10.0, clock)  # less than probe_interval_s (30 s) of the bucket's decoding
    samples = batch_depths(again)
    assert samples[0] > 0 and sum(samples[1:]) == 0  # every batched cycle at depth 0
    assert not decisions(logger, "height_probe")  # depth 1 was measured last run: no probe at once
    eng.run(60.0, clock)  # later it is re-checked in its turn, as any stale neighbour is
    assert decisions(logger, "height_probe")


def test_an_operator_pin_is_not_learned_as_a_choice():
    gov, clock, eng, _ = make()
    eng.run(30.0, clock)
    eng.apply(gov.override("pin_depth", 3))
    eng.run(5.0, clock)
    assert gov.learned()["depths"] == {}
    assert gov.learned()["batch_cost_s"]  # the costs measured still are


# A profile as the H200's restart had it (bench/results/h200_2026-12-03c): heights 3-4 settled
# at depth 0, only depth 0 with trust_samples cycles kept there, no acceptance past the priors
# (the run decoded at depth 0). Costs per row of the CPU-like batch of four.
def per_row(k):
    return STEP_S * CPU[4][k] / 4


def h200_like(lost=None):
    profile = {"cost_s": {}, "acceptance": [], "batch_cost_s": {"4": {"0": per_row(0)}}, "depths": {"1": 0, "4": 0}}
    if lost is not None:
        profile["lost"] = lost
    return profile


def probed(logger, depth):
    return [d for d in decisions(logger, "height_probe") if d["heights"] == "3-4" and d["depth_to"] == depth]


def test_verdicts_are_learned_with_their_cost_cycles_and_age_and_kept_across_a_restart():
    first, clock, eng, logger = make()
    eng.run(90.0, clock)
    (end, *_) = [d for d in decisions(logger, "height_probe_end") if "not better" in d["sentence"]]
    lost = first.learned()["lost"]["4"]["1"]  # depth 1 lost to 0 at heights 3-4
    assert lost["to"] == 0 and lost["samples"] >= 8
    assert lost["cost_s"] == pytest.approx(per_row(1))
    clock_4 = first.cost.batch_decode_s()[bucket_of(4) - 1]
    assert 0 < lost["age_s"] < clock_4 - end["bucket_decode_s"] + 1e-6  # the latest verdict's, not the first's
    # The first decision at heights 3-4 left depth 2, where batches ran for their first
    # cycles (fewer than trust_samples: measured() keeps no cost for it): a verdict too.
    (adopt,) = decisions(logger, "height_adopt")
    assert adopt["depth_ran"] == 2 and adopt["depth_to"] == 0
    early = first.learned()["lost"]["4"]["2"]
    assert early["to"] == 0 and 0 < early["samples"] < 8 and "2" not in first.learned()["batch_cost_s"]["4"]
    assert early["cost_s"] == pytest.approx(per_row(2))  # its own cycles' cost, not one shrunk to a prior

    # Restarted, the verdict is kept (a save before depth 1 is probed again must not drop
    # it) and ages on the new run's clock of that bucket.
    again, clock, eng, logger = make(profile=first.learned())
    assert again.learned()["lost"]["4"]["1"] == lost
    eng.run(10.0, clock)
    ran = again.cost.batch_decode_s()[bucket_of(4) - 1]
    assert ran > 5.0
    assert again.learned()["lost"]["4"]["1"]["age_s"] == pytest.approx(lost["age_s"] + ran, abs=1e-3)


def test_a_restart_does_not_probe_a_depth_that_lost_with_fewer_cycles_than_trust_samples():
    lost = {"4": {"1": {"to": 0, "cost_s": per_row(1), "samples": 5, "age_s": 9.0},
                  "2": {"to": 0, "cost_s": per_row(2), "samples": 3, "age_s": 5.0}}}  # fmt: skip
    # Without the verdicts (a file from before they were kept: it still loads), depth 2 is
    # priced from the solo priors, looks best, and is probed in the first round.
    old, clock, eng, logger = make(profile=h200_like())
    eng.run(10.0, clock)
    assert probed(logger, 2)

    again, clock, eng, logger = make(profile=h200_like(lost))
    (start,) = decisions(logger, "height_start")
    assert start["lost"] == [1, 2] and "2 probe verdicts kept" in start["sentence"]
    est = again.cost.batch_estimate(bucket_of(4), 2, clock.t)
    assert est.profiled and est.cost_s == pytest.approx(per_row(2))  # its measured cost, as a prior
    eng.run(10.0, clock)
    assert not decisions(logger, "height_probe")  # neither depth 2 nor 1, nor 3 (priced on their line)
    assert batch_depths(again)[0] > 0 and sum(batch_depths(again)[1:]) == 0


def test_a_depth_that_lost_long_ago_is_probed_again_in_its_turn():
    profile = h200_like({"4": {"1": {"to": 0, "cost_s": per_row(1), "samples": 5, "age_s": 3600.0}}})
    gov, clock, eng, logger = make(profile=profile)
    eng.run(10.0, clock)
    assert not decisions(logger, "height_probe")  # depth 1 measured, if long ago: not "never measured"
    eng.run(40.0, clock)  # past probe_interval_s (30 s) of the bucket's decoding: stale, so probed
    (probe, *_) = probed(logger, 1)
    assert "stale" in probe["sentence"] and probe["bucket_decode_s"] >= GovernorConfig().probe_interval_s
    # Without the verdict the same profile has a first round that probes (depth 2, priced
    # from the solo priors with nothing at this height to draw a line through).
    del profile["lost"]
    gov, clock, eng, logger = make(profile=profile)
    eng.run(10.0, clock)
    assert decisions(logger, "height_probe")


def test_a_malformed_verdict_is_left_out_and_never_stops_the_start():
    lost = {"4": {"2": {"to": 0, "cost_s": "x", "samples": 3}, "1": {"to": 0}}, "nine": {}, "8": [1, 2]}
    gov, clock, eng, logger = make(profile=h200_like(lost))
    assert gov.learned()["lost"] == {}
    eng.run(2.0, clock)


def test_a_verdict_judged_again_in_its_turn_is_replaced_when_the_depth_wins():
    # A batch of four that is nearly flat in depth (a GPU-like verify): depth 1 wins there,
    # whatever the old verdict said (it lost to 0 long ago, on 3 cycles).
    flat = [1.52, 1.6, 1.7, 1.8, 1.9]
    clock, logger = FakeClock(0.0), RecordingLogger()
    profile = h200_like({"4": {"1": {"to": 0, "cost_s": per_row(1), "samples": 3, "age_s": 100.0}}})
    gov = Governor(GovernorConfig(), clock=clock, memory_probes=[FakeMemoryProbe()], load=FakeLoad(active=1),
                   head_resident=True, head_bytes=850 * MiB, logger=logger, profile=profile, initial_depth=2)
    eng = SimEngine(gov, seed_like_cost(serial_s=STEP_S, load_penalty=0.0), acceptance=0.6, load_fn=lambda: 0.0,
                    streams_fn=lambda: 4, batch_cost_fn=lambda n, k: STEP_S * flat[k])
    eng.run(10.0, clock)
    assert not decisions(logger, "height_probe")
    eng.run(40.0, clock)
    (won, *_) = decisions(logger, "height_probe_end")
    assert won["sentence"].startswith("batch heights 3-4: probed depth 1 scores") and won["depth_to"] == 1
    lost = gov.learned()["lost"]["4"]
    assert lost["0"]["to"] == 1 and lost["0"]["samples"] >= 8  # depth 0 lost to 1, measured
    assert lost.get("1", {}).get("to") != 0 and gov.depth_for(4) > 0  # the old verdict is gone


def test_a_learned_height_probes_a_depth_its_last_run_never_measured_in_its_turn_not_at_once():
    # The H200's restart (bench/results/h200_2026-12-03c, run 3): heights 2 had settled at
    # depth 0 in the last run, which never measured depth 1 there, so the restart's first
    # round probed it ("never measured"). The last run decoded at that height and did not go
    # there: a first round is no time to explore it; its turn comes with probe_interval_s.
    profile = {"cost_s": {}, "acceptance": [], "batch_cost_s": {"2": {"0": STEP_S * CPU[2][0] / 2}},
               "depths": {"1": 0, "2": 0}}
    fresh, clock, eng, logger = make(streams=2)  # without a profile the same council probes at once
    eng.run(10.0, clock)
    assert [d for d in decisions(logger, "height_probe") if "never measured" in d["sentence"]]

    gov, clock, eng, logger = make(profile=profile, streams=2)
    (start,) = decisions(logger, "height_start")
    assert start["heights"] == "2" and "in their turn" in start["sentence"]
    eng.run(10.0, clock)
    assert not decisions(logger, "height_probe")
    eng.run(40.0, clock)  # past probe_interval_s (30 s) of the bucket's decoding
    (probe, *_) = [d for d in decisions(logger, "height_probe") if d["heights"] == "2"]
    assert probe["depth_to"] == 1 and probe["bucket_decode_s"] >= GovernorConfig().probe_interval_s
