"""Smoke test of the spec bench: it runs every arm and reports what the brief asks for."""

from __future__ import annotations

from daemon.measure.spec_bench import format_bench, run_bench, verify_cost
from daemon.engine.model.loading import load_model
from daemon.engine.model.mtp_head import load_mtp_head


def test_bench_reports_arms_acceptance_and_rollback_winner(random_model_path):
    lm = load_model(random_model_path)
    head = load_mtp_head(lm)
    prompts = [lm.tokenizer.encode("def f(x):")]
    res = run_bench(lm, head, prompts, depths=(1, 2), rounds=2, tokens=6, log=lambda m: None)
    assert set(res["arms"]) == {"serial", "capture/d1", "snapshot/d1", "capture/d2", "snapshot/d2"}
    assert len(res["arms"]["capture/d2"]["acceptance_by_position"]) == 2
    assert res["rollback"]["winner"] in ("capture", "snapshot")
    res["verify_cost"] = verify_cost(lm, (1, 2), context=8, reps=2)
    assert set(res["verify_cost"]["plain"]) == {1, 2}
    md = format_bench(res, "smoke")
    assert "| serial |" in md and "winner" in md


def test_bench_guard_before_after_runs_both_variants_interleaved(random_model_path):
    lm = load_model(random_model_path)
    head = load_mtp_head(lm)
    prompts = [lm.tokenizer.encode("def f(x):")]
    res = run_bench(lm, head, prompts, depths=(1,), rounds=2, tokens=6, strategies=("capture",), log=lambda m: None,
                    guards={"guard": 2.0**-5, "probe": None})
    assert set(res["arms"]) == {"serial", "capture/d1/guard", "capture/d1/probe"}
    assert res["arms"]["capture/d1/probe"]["guarded_per_cycle"] == 0.0
    assert set(res["guard_ab"]["per_arm"]) == {"capture/d1"} and "rollback" not in res
    assert "Guard before/after" in format_bench(res, "smoke")
