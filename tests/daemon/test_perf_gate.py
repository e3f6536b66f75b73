"""The perf gate's verdict rule on synthetic measurements, its report shape, and one tiny
real run through spec_bench's measurement functions."""

from __future__ import annotations

import json

import pytest

from daemon.measure.perf_gate import format_markdown, main, measure, noise_from, summarize, verdict

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)

SERIAL = [50.0, 52.0, 49.0, 51.0, 50.0]
SERIAL_B = [51.0, 51.0, 50.0, 50.0, 50.5]  # largest gap 1/49 = 2.04%


def test_noise_is_the_largest_serial_vs_serial_gap_with_a_floor():
    assert noise_from(SERIAL, SERIAL_B, floor=0.0) == pytest.approx(1 / 49)
    assert noise_from(SERIAL, SERIAL, floor=0.02) == 0.02
    with pytest.raises(ValueError):
        noise_from(SERIAL, SERIAL_B[:3])


def test_slower_beyond_noise_fails():
    arm = [s * 0.9 for s in SERIAL]
    v = verdict(SERIAL, SERIAL_B, arm, depth=2, noise_floor=0.0)
    assert not v["pass"] and v["speedup"] == pytest.approx(0.9) and "slower" in v["label"]


def test_slower_within_noise_passes_and_faster_passes():
    within = verdict(SERIAL, SERIAL_B, [s * 0.99 for s in SERIAL], depth=1, noise_floor=0.0)
    assert within["pass"] and within["label"].startswith("within")
    faster = verdict(SERIAL, SERIAL_B, [s * 1.2 for s in SERIAL], depth=1)
    assert faster["pass"] and faster["label"].startswith("faster")


def test_noisy_serial_widens_the_band():
    noisy_b = [s * f for s, f in zip(SERIAL, (1.0, 1.12, 0.95, 1.0, 1.0))]
    v = verdict(SERIAL, noisy_b, [s * 0.92 for s in SERIAL], depth=1, noise_floor=0.0)
    assert v["noise"] == pytest.approx(0.12) and v["pass"]  # 8% slower is inside 12% of noise
    assert not verdict(SERIAL, SERIAL_B, [s * 0.92 for s in SERIAL], depth=1)["pass"]


def test_median_of_per_round_ratios_resists_one_outlier_round():
    arm = [s * 1.1 for s in SERIAL]
    arm[2] = SERIAL[2] * 0.3  # one round hit by another process
    assert verdict(SERIAL, SERIAL_B, arm, depth=1)["speedup"] == pytest.approx(1.1)


def test_depth_zero_has_nothing_to_gate():
    v = verdict(SERIAL, SERIAL_B, SERIAL, depth=0)
    assert v["pass"] and v["noise"] is None


def _raw(tps, depth):
    return [{"tok_s": t, "seconds": 1.0, "tokens": 10, "cycles": 10 // (depth + 1) or 1, "guarded": 0,
             "accepted_by_position": [3] * depth, "cond_denominator": [5] * depth} for t in tps]


def test_report_shape_and_markdown():
    raw = {"serial": _raw(SERIAL, 0), "serial_b": _raw(SERIAL_B, 0), "d1": _raw([s * 1.1 for s in SERIAL], 1)}
    arms = summarize(raw, [1])
    assert set(arms) == {"serial", "serial_b", "d1"}
    assert arms["d1"]["speedup"]["median"] == pytest.approx(1.1)
    assert arms["d1"]["conditional_acceptance"] == [0.6]
    v = verdict(arms["serial"]["raw_tok_s"], arms["serial_b"]["raw_tok_s"], arms["d1"]["raw_tok_s"], 1)
    res = {"model": "m", "machine": {"device": "cpu"}, "rounds": 5, "prompts": 1, "tokens_per_prompt": 10,
           "mode": "exact", "rollback": "capture", "noise_floor": 0.02, "arms": arms, "verdict": v,
           "verify_cost": {"plain": {1: 1.3}}}
    json.dumps(res)
    md = format_markdown(res)
    assert "| d1 |" in md and "1.30x" in md and "PASS" in md


def test_tiny_real_measurement(random_model_path):
    from daemon.engine.model.loading import load_model
    from daemon.engine.model.mtp_head import load_mtp_head

    lm = load_model(random_model_path)
    head = load_mtp_head(lm)
    raw = measure(lm, head, [lm.tokenizer.encode("def f(x):")], [1], rounds=5, tokens=3, exact=True,
                  rollback="capture", log=lambda m: None)
    assert {k: len(v) for k, v in raw.items()} == {"serial": 5, "serial_b": 5, "d1": 5}
    arms = summarize(raw, [1])
    assert all(a["tok_s"]["median"] > 0 for a in arms.values())


def test_cli_rejects_fewer_than_five_rounds():
    with pytest.raises(SystemExit) as e:
        main(["--rounds", "3"])
    assert e.value.code == 2
