"""The governor's start: a new batch height starts from what the cost model
knows, and a cycle at a depth the stream or batch did not run last is not booked as that
depth's cost. The figures are the H200's (bench/results/h200_2026-12-02b/gov_cost_probe.txt,
the bundled model with attention off cuDNN): a solo cycle 2.13 ms at depth 0 and 4.05 ms
at depth 1; a batch of 4 at depth 1 1.30 ms a row, its first cycle 16 ms a row (the head
catching up on the pairs queued at depth 0); acceptance ~0.6 on the council's prose."""

from __future__ import annotations

import random

import pytest

from governor.config import GovernorConfig
from governor.cost_model import CostModel
from governor.fakes import FakeClock, FakeLoad, FakeMemoryProbe, RecordingLogger
from governor.height_policy import first_depth
from governor.runtime import Governor
from governor.types import CycleTelemetry, DepthEstimate

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)

MiB = 1 << 20
SOLO_S = {0: 2.13e-3, 1: 4.05e-3}
ROW_S, FIRST_ROW_S = 1.30e-3, 16e-3


def _gov():
    clock, logger = FakeClock(0.0), RecordingLogger()
    gov = Governor(GovernorConfig(), clock=clock, memory_probes=[FakeMemoryProbe()], load=FakeLoad(active=1),
                   head_resident=True, head_bytes=850 * MiB, logger=logger)  # fmt: skip
    return gov, clock, logger


def _height_decisions(logger, label):
    return [e[2] for e in logger.events
            if e[1] == "governor.decision" and e[2].get("heights") == label]  # fmt: skip


def _recorded_trace(rng: random.Random, first_batched_transition: bool = True):
    """Solo cycles at depths 0 and 1, then 4 rows at depth 1, as the H200 ran them."""
    solo = [CycleTelemetry(depth=k, cycle_s=SOLO_S[k], drafted=k, accepted=int(k and rng.random() < 0.6),
                           emitted=1, transition=i == 0)  # fmt: skip
            for k in (0, 1) for i in range(40)]
    batched = []
    for i in range(60):
        first = i == 0
        rows = tuple(int(rng.random() < 0.6) for _ in range(4))
        batched.append(CycleTelemetry(depth=1, cycle_s=4 * (FIRST_ROW_S if first else ROW_S), drafted=4,
                                      accepted=sum(rows), emitted=4 + sum(rows), batch=4, row_accepted=rows,
                                      transition=first and first_batched_transition))  # fmt: skip
    return solo, batched


def _play(gov, clock, cycles, per_tick=4):
    for i, c in enumerate(cycles):
        gov.record_cycle(c)
        clock.advance(c.cycle_s)
        if i % per_tick == per_tick - 1:
            clock.advance(0.25)
            gov.tick()


def test_a_new_batch_height_starts_at_the_depth_the_cost_model_prices_best():
    gov, clock, logger = _gov()
    solo, batched = _recorded_trace(random.Random(1))
    _play(gov, clock, solo + batched)
    adopt = [d for d in _height_decisions(logger, "3-4") if d["decision"] == "height_adopt"]
    assert len(adopt) == 1
    # Batches ran at depth 1 (the solo depth); depth 0, priced from that measurement by the
    # solo cost ratio (~0.53), scores ~1.46 a ms against depth 1's ~1.23: start at 0.
    assert adopt[0]["depth_ran"] == 1 and adopt[0]["depth_to"] == 0, adopt[0]["sentence"]
    assert "start at depth 0" in adopt[0]["sentence"]


def test_the_first_depth_never_climbs_past_what_batches_ran_and_needs_the_margin_above_zero():
    cfg = GovernorConfig()

    def est(k, s):
        return DepthEstimate(depth=k, expected_tokens=1 + k, cost_s=None, score=s, samples=1, source="measured",
                             stale=False)  # fmt: skip

    ests = (est(0, 100.0), est(1, 109.0), est(2, 200.0))
    assert first_depth(ests, ran=1, cfg=cfg) == 0  # 9% better: inside the 10% margin
    assert first_depth(ests, ran=2, cfg=cfg) == 2
    assert first_depth((est(0, 100.0), est(1, 120.0), est(2, 200.0)), ran=1, cfg=cfg) == 1  # never 2: no batch ran there
    assert first_depth((est(0, None), est(1, 50.0)), ran=1, cfg=cfg) == 1  # nothing prices depth 0 yet


def test_transition_cycles_teach_acceptance_not_cost():
    cm = CostModel(GovernorConfig())
    cm.record(CycleTelemetry(depth=1, cycle_s=0.050, drafted=1, accepted=1, emitted=2, transition=True), now=0.0)
    assert cm.transition_cycles == 1
    assert cm.estimate(1, 0.0).samples == 0  # no cost booked
    assert cm._accept[1].n == 1  # its draft's outcome was learned
    for i in range(8):
        cm.record(CycleTelemetry(depth=1, cycle_s=SOLO_S[1], drafted=1, accepted=1, emitted=2), now=0.1 * i)
    assert cm.estimate(1, 1.0).cost_s == pytest.approx(SOLO_S[1], rel=0.05)
    # Batched: the same, in the height's bucket (3-4 is index 2, cost per row).
    cm.record(CycleTelemetry(depth=1, cycle_s=4 * FIRST_ROW_S, drafted=4, accepted=4, emitted=8, batch=4,
                             row_accepted=(1, 1, 1, 1), transition=True), now=1.0)  # fmt: skip
    assert cm.transition_cycles == 2 and cm.batch_estimate(2, 1, 1.0).samples == 0
    for i in range(8):
        cm.record(CycleTelemetry(depth=1, cycle_s=4 * ROW_S, drafted=4, accepted=4, emitted=8, batch=4,
                                 row_accepted=(1, 1, 1, 1)), now=1.1 + 0.1 * i)  # fmt: skip
    assert cm.batch_estimate(2, 1, 2.0).cost_s == pytest.approx(ROW_S, rel=0.05)
    assert cm.snapshot(2.0)["transition_cycles"] == 2


def test_the_engine_step_carries_the_transition_flag_to_the_governor():
    class Step:  # the engine's DecodeStep, duck-typed as CycleTelemetry.from_step reads it
        depth, drafted, accepted, tokens, cycle_s, accepted_mask, transition = 1, 1, 1, [5, 6], 0.01, [True], True

    assert CycleTelemetry.from_step(Step()).transition
    Step.transition = False
    assert not CycleTelemetry.from_step(Step()).transition
