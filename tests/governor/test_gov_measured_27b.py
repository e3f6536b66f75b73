"""The governor on the costs measured for a 27B-shaped 4-bit model on the H200 with the
tensor-core quantized matmul (bench/results/qmm_h200_2026-12-03, call 3: the daemon's decoders
with oracle drafts), replayed on a fake clock: where speculation wins it must draft, where it
loses it must not.

Cycle costs in serial steps (one row, depth 0: 25.9 ms, 38.6 tok/s), from each arm's tokens/s
and tokens per row per cycle: one row at depth 1 1.85 tokens in 41.0 ms (1.58 steps), depth 2
2.34 in 51.0 ms (1.97); four rows at depth 0 24.1 ms a cycle (0.93 steps: the kernel is flat in
rows), depth 1 50.4 ms (1.95), depth 2 60.3 ms (2.33): a batch's drafting costs more than its
verify saves there. Depths 3-4 were not measured: priced as depth 2 plus the 1 -> 2 step.

And the same decoders with the fused GatedDeltaNet recurrence as well, compiled
(bench/results/h200_2026-12-04, call 6): one row at depth 0 16.7 ms (59.8 tok/s), depth 1 1.92
tokens in 30.1 ms (1.80 steps), depth 2 2.40 in 32.1 ms (1.92); four rows at depth 0 20.1 ms a
cycle (1.20 steps), depth 1 43.4 ms (2.60), depth 2 46.0 ms (2.75): depth 2 wins at one row
(1.37x measured), every depth loses at four.

And the daemon's default CUDA kernels of 2026-12-06 on an H100 (the conv folded in, merged
projections, the tensor-core matmul with its shared-memory feed, compiled;
bench/results/h100_2026-12-06c, call 2, arm p2): one row at depth 0 11.5 ms (87.2 tok/s),
depth 2 2.53 tokens in 22.7 ms (1.98 steps); four rows at depth 0 13.9 ms a cycle (1.21 steps),
depth 2 6.8 tokens in 33.0 ms (2.88 steps). Depth 1 was not measured there: priced halfway
between depths 0 and 2 (the measured depth 1 sat nearer depth 2 in both tables above). The
acceptance replayed is the measured one: 2.53 tokens a row a cycle at one row is the oracle
profile's ~0.83 a position; four rows landed 1.70 (1 + a + a^2: a ~ 0.47). At four rows depth 1
loses at any price above 1.78 steps, so the halfway guess does not decide the outcome."""

from __future__ import annotations

import pytest

from governor.config import GovernorConfig
from governor.fakes import FakeClock, FakeLoad, FakeMemoryProbe, RecordingLogger, SimEngine
from governor.runtime import Governor

pytestmark = pytest.mark.quick

MiB = 1 << 20


def _extend(row: list[float]) -> list[float]:
    step = row[-1] - row[-2]
    return row + [row[-1] + step, row[-1] + 2 * step]


QMM_27B = {1: _extend([1.00, 1.58, 1.97]), 4: _extend([0.93, 1.95, 2.33])}
GDN_QMM_27B = {1: _extend([1.00, 1.80, 1.92]), 4: _extend([1.20, 2.60, 2.75])}
H100_P2_27B = {1: _extend([1.00, 1.49, 1.98]), 4: _extend([1.21, 2.05, 2.88])}
# kernels: (one-row step seconds, cycle cost in steps by rows and depth, acceptance by rows)
MEASURED = {"qmm": (0.0259, QMM_27B, {1: 0.85, 4: 0.85}), "gdn+qmm": (0.0167, GDN_QMM_27B, {1: 0.85, 4: 0.85}),
            "h100 default": (0.0115, H100_P2_27B, {1: 0.83, 4: 0.47})}


def _run(streams: int, seconds: float = 90.0, kernels: str = "qmm") -> Governor:
    step_s, table, acceptance = MEASURED[kernels]
    clock = FakeClock(0.0)
    gov = Governor(GovernorConfig(), clock=clock, memory_probes=[FakeMemoryProbe()], load=FakeLoad(active=1),
                   head_resident=True, head_bytes=850 * MiB, logger=RecordingLogger())
    eng = SimEngine(gov, lambda k, load: step_s * table[1][k], acceptance=acceptance[streams], load_fn=lambda: 0.0,
                    streams_fn=lambda: streams, batch_cost_fn=lambda n, k: step_s * table[n][k])
    eng.run(seconds, clock)
    return gov


@pytest.mark.parametrize("kernels", sorted(MEASURED))
def test_one_stream_speculates_on_the_measured_27b_costs(kernels):
    gov = _run(streams=1, kernels=kernels)
    assert gov.depth_for(1) >= 1


@pytest.mark.parametrize("kernels", sorted(MEASURED))
def test_a_batch_of_four_stays_at_depth_0_on_the_measured_27b_costs(kernels):
    gov = _run(streams=4, kernels=kernels)
    assert gov.depth_for(4) == 0
