"""The replay evaluation (bench/governor_eval.py) drives the real Governor: on a machine
where speculation pays alone (a verify-cheap profile), auto speculates with one stream and
batches at depth 0 under council load, and a fixed depth k > 0 time-slices the council."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import governor_eval as ev  # noqa: E402

from governor.config import GovernorConfig  # noqa: E402

CHEAP_VERIFY = ev.Profile("cheap verify", 0.02, [1.0, 1.2, 1.4, 1.6, 1.8], {1: 1.0, 2: 1.1, 4: 1.4, 8: 2.0}, "gpu", "test")
ACCEPT = {"code": [4, 3, 1, 4, 2, 0, 4, 3] * 10, "prose": [0, 1, 0, 0, 2, 0, 1, 0] * 10}


def _run(arm: str):
    regimes = [ev.Regime("quiet", [ev.Phase("quiet", 30.0)]),
               ev.Regime("council 4", [ev.Phase("council 4", 30.0, streams=4)])]  # fmt: skip
    return ev.simulate(CHEAP_VERIFY, arm, regimes, ACCEPT, noise=[1.0], cfg=GovernorConfig(), seed=0)


def test_auto_speculates_alone_and_batches_under_council_load():
    auto, d0, d2 = _run("auto"), _run("d0"), _run("d2")
    assert any(isinstance(k, int) and k > 0 for k in auto.cycles_by_depth)  # speculated alone
    assert auto.cycles_by_depth.get("batch", 0) > 0  # and batched the council
    rate = lambda r, ph: r.tokens[ph] / r.busy_s[ph]  # noqa: E731
    # Alone, speculation pays on this profile: auto beats serial; under load, batching beats
    # a fixed depth that time-slices the streams, and auto batches.
    assert rate(auto, "quiet") > 1.2 * rate(d0, "quiet")
    assert rate(d0, "council 4") > 1.5 * rate(d2, "council 4")
    assert rate(auto, "council 4") >= 0.97 * rate(d0, "council 4")
    assert "batch" not in d2.cycles_by_depth


def test_acceptance_is_replayed_in_order_and_capped_at_the_depth():
    a = ev.Acceptance([4, 0, 2])
    assert [a.next(2) for _ in range(4)] == [2, 0, 2, 2]
    assert ev.conditional_acceptance([4, 0, 2, 1]) == [0.75, 0.6667, 0.5, 1.0]
