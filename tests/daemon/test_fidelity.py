"""The fidelity gate: exact is token-identical to serial; sampling keeps the base distribution."""

from __future__ import annotations

import json
import re

import pytest

from daemon.measure.fidelity import (ArmResult, FidelityReport, _serial_tokens, chi2_sf, distribution_test, load_prompts,
                                     main, run_fidelity_gate)
from daemon.measure.fidelity_batch import run_batched_arms
from daemon.engine.model.loading import load_model
from daemon.engine.model.mtp_head import load_mtp_head
from daemon.engine.types import SamplingParams
from daemon.paths import BUNDLED_MODEL

from model_helpers import make_copy_head


@pytest.fixture(scope="module")
def lm(random_model_path):
    return load_model(random_model_path)


@pytest.fixture(scope="module")
def copy_head(lm, tmp_path_factory):
    return make_copy_head(lm, tmp_path_factory.mktemp("copyhead-fid"))


@pytest.mark.quick
def test_chi2_tail_approximation():
    # Critical values from the chi-square table.
    assert chi2_sf(24.322, 7) == pytest.approx(0.001, rel=0.1)
    assert chi2_sf(11.070, 5) == pytest.approx(0.05, rel=0.05)
    assert chi2_sf(30.144, 19) == pytest.approx(0.05, rel=0.05)


@pytest.mark.quick
def test_an_arm_counts_identical_prompts_and_keeps_its_first_flip():
    """ArmResult.compare, which the solo and the batched arms both count with: tokens are
    compared up to and including the first that differs, and the arm's first flip is kept
    with where it happened and serial's context before it."""
    arm = ArmResult(mode="exact", depth=2)
    arm.compare([1, 2, 3, 4], [1, 2, 3, 4], 4, prompt=0)
    assert (arm.prompts, arm.identical, arm.flips, arm.tokens_compared) == (1, 1, 0, 4)
    assert arm.first_divergence is None
    arm.compare([5, 6, 7, 8], [5, 6, 9, 8], 4, prompt=1, row=3)
    assert (arm.prompts, arm.identical, arm.flips, arm.tokens_compared) == (2, 1, 1, 7)
    assert arm.first_divergence == {"prompt": 1, "row": 3, "token": 2, "serial": 7, "speculative": 9,
                                    "context": [5, 6]}
    arm.compare([1, 1], [2, 2], 2, prompt=2)  # a later flip is counted, the first one kept
    assert arm.flips == 2 and arm.tokens_compared == 8 and arm.first_divergence["prompt"] == 1


def test_gate_passes_on_the_random_model(lm):
    head = load_mtp_head(lm)
    report = run_fidelity_gate(lm, head, load_prompts()[:4], depths=(1, 2, 3, 4), max_tokens=24)
    assert report.passed, [a.first_divergence for a in report.arms]
    assert {(a.mode, a.depth) for a in report.arms} == {(m, d) for m in ("exact", "fast") for d in (1, 2, 3, 4)}
    assert all(a.identical == a.prompts == 4 for a in report.arms if a.mode == "exact")


def test_gate_passes_with_an_accepting_head(lm, copy_head):
    report = run_fidelity_gate(lm, copy_head, load_prompts()[:4], depths=(1, 2, 3, 4), max_tokens=32, modes=("exact",))
    assert report.passed
    assert sum(a.accepted for a in report.arms) > 0


def test_gate_fails_and_names_the_divergence(lm, copy_head):
    # Fault injection: noisy verify logits and no guard must be caught.
    report = run_fidelity_gate(
        lm, copy_head, load_prompts()[:4], depths=(2,), max_tokens=32, modes=("exact",), guard_margin=0.0, logit_jitter=0.5
    )
    assert not report.passed
    d = report.arms[0].first_divergence
    assert d is not None and d["serial"] != d["speculative"]


def test_cli_writes_json_and_exit_codes(random_model_path, tmp_path, capsys):
    out = tmp_path / "fid.json"
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompts": load_prompts()[:2]}))
    common = ["--model", str(random_model_path), "--prompts", str(prompts), "--draws", "0", "--drafting", "mtp"]
    rc = main(common + ["--depths", "1,3", "--tokens", "8", "--json", str(out), "--batched", ""])
    assert rc == 0
    data = json.loads(out.read_text())
    # exact and fast at depths 1 and 3, then exact again with the logit processors on, then
    # exact requests resumed off the chunk grid (the prefix-cache arms, at depth 3)
    assert data["passed"] is True and len(data["arms"]) == 10
    assert [(a["mode"], a["processors"]) for a in data["arms"][4:6]] == [("exact", True), ("exact", True)]
    prefix = data["arms"][6:]
    assert [a["drafting"] for a in prefix] == ["mtp, resumed at a prompt end", "mtp, resumed at a continuation",
                                               "mtp, prefilled in paced pieces", "mtp, prefilled together"]
    assert all(a["identical"] == a["prompts"] and a["depth"] == 3 for a in prefix)
    assert [a["prompts"] for a in prefix] == [2, 2, 2, 4] and [len(a["resumed_at"]) for a in prefix] == [2, 2, 2, 4]
    assert any(n > 0 for n in prefix[3]["resumed_at"])  # one of each pair resumed from a snapshot
    assert [d["depth"] for d in data["deviation"]] == [1, 3]  # verify-vs-serial logit deviation
    captured = capsys.readouterr()
    assert "| exact | off | - | 3 |" in captured.out  # drafting, mode, processors, constraint, depth
    # Progress: one stderr line per prompt decoded (serial references, then each arm), the
    # deviation phase, a running count and an estimate of what is left, then a summary.
    lines = [ln for ln in captured.err.splitlines() if ln.startswith("[fidelity")]
    steps = [re.fullmatch(r"\[fidelity (\d+)/(\d+)\] (.+) \((.+) elapsed, (.+)\)", ln) for ln in lines[:-1]]
    assert all(steps), lines
    # 2 serial references + 4 arms x 2 prompts; the same with the processors (2 exact arms); deviation
    assert [int(m[1]) for m in steps] == list(range(1, 2 + 8 + 2 + 4 + 1 + 1))
    assert all(int(m[1]) <= int(m[2]) for m in steps) and int(steps[-1][2]) == 17
    assert steps[0][5] == "estimate after the first step" and all(m[5].endswith(" left") for m in steps[1:])
    whats = [m[3] for m in steps]
    assert "arm mtp exact depth 3, prompt 2/2" in whats and "arm mtp exact depth 1 +processors, prompt 1/2" in whats
    assert whats[-1].startswith("verify-vs-serial logit deviation")
    assert re.fullmatch(r"\[fidelity done\] 17 steps in .+: 22 speculative decodes, 0 flips, PASS", lines[-1]), lines[-1]
    assert "[fidelity" not in captured.out  # the report on stdout stays clean
    # The exit code of a failing gate: the solo exact arm alone fails with jittered logits.
    rc = main(common + ["--depths", "2", "--tokens", "24", "--modes", "exact", "--guard", "0", "--logit-jitter", "0.5",
                        "--no-deviation", "--no-processors", "--batched", "", "--prefix-chunk", "0"])
    assert rc == 1


def test_cli_batched_arms(random_model_path, tmp_path):
    """The batched arms: rows speculating together in the continuous batch, 2 and 3 high,
    mixed depths and processors, joining and leaving, each identical to serial alone."""
    out = tmp_path / "batched.json"
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"prompts": load_prompts()[:3]}))
    rc = main(["--model", str(random_model_path), "--prompts", str(prompts), "--batched-only", "--batched", "2,3",
               "--depths", "1,3", "--tokens", "10", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    arms = data["arms"]
    assert [(a["mode"], a["batch_rows"], a["drafting"]) for a in arms] == [
        (mode, B, f"batch x{B}" + riding + ", lookup")  # every other row drafts lookup blocks too
        for mode in ("exact", "fast") for B in (2, 3) for riding in ("", ", pieces riding")]
    plain = [a for a in arms if "riding" not in a["drafting"]]
    assert all(a["identical"] == a["prompts"] == 2 * a["batch_rows"] for a in plain) and data["passed"]
    # The riding twins: the same rows, plus the riders decoded from the caches their pieces built.
    riding = [a for a in arms if "riding" in a["drafting"]]
    assert all(a["identical"] == a["prompts"] > 2 * a["batch_rows"] for a in riding), riding
    assert all(a["depth"] == 3 and a["processors"] for a in arms)


def test_batched_arms_fail_on_a_divergence(lm, copy_head):
    """The batched comparison can fail: against a reference that is not serial's tokens,
    every row diverges, the exact arm records where, and the report fails."""
    def shifted(lm_, prompt, n, params):
        return [t + 1 for t in _serial_tokens(lm_, prompt, n, params)]

    report = FidelityReport(model="random", rollback="capture", guard_margin=None, max_tokens=6)
    report.arms += run_batched_arms(lm, copy_head, load_prompts()[:2], ArmResult, shifted, None, heights=(2,),
                                    max_tokens=6, modes=("exact",), depth=2, riding=True)
    arm, riding = report.arms
    assert arm.identical == 0 and arm.flips == arm.prompts == 4 and arm.first_divergence["token"] == 0
    assert riding.identical == 0 and riding.flips == riding.prompts > 4  # the riders are compared too
    assert not report.passed


@pytest.mark.parametrize("depth", [1, 2])
def test_sampling_keeps_the_base_distribution(lm, copy_head, depth):
    ctx = lm.tokenizer.encode("a b c d")
    res = distribution_test(lm, copy_head, ctx, SamplingParams(temperature=1.0, top_k=8), depth, draws=250, alpha=1e-3, seed=1)
    assert res.passed, res
    assert 0.05 < res.accepted_fraction < 0.95  # both the accept and the residual branch ran


def test_sampling_keeps_the_second_token_distribution(lm, copy_head):
    # Depth 1: the second output token is the bonus token (draft accepted) or comes from a
    # second cycle after a rollback; its marginal must be sum_y p(y) p(. | y). (Sampling the
    # bonus from the wrong row fails this with p ~ 1e-122.)
    ctx = lm.tokenizer.encode("a b c d")
    res = distribution_test(lm, copy_head, ctx, SamplingParams(temperature=1.0, top_k=6), 1, draws=250, alpha=1e-3,
                            seed=2, position=1)
    assert res.passed, res


@pytest.mark.skipif(not (BUNDLED_MODEL / "config.json").exists(), reason="bundled model not trained yet")
def test_gate_passes_on_the_bundled_model():
    blm = load_model(BUNDLED_MODEL)
    head = load_mtp_head(blm)
    report = run_fidelity_gate(blm, head, load_prompts()[:3], depths=(1, 2, 3, 4), max_tokens=24, modes=("exact",))
    assert report.passed, [a.first_divergence for a in report.arms]


def test_gate_covers_lookup_and_per_request_depth(lm, copy_head):
    from daemon.measure.fidelity import load_quoting_prompts

    report = run_fidelity_gate(lm, copy_head, load_prompts()[:2], depths=(3,), max_tokens=24,
                               drafting=("lookup", "adaptive"), quoting=load_quoting_prompts()[:2])
    assert report.passed, [a.first_divergence for a in report.arms]
    assert {(a.drafting, a.mode) for a in report.arms} == {(v, m) for v in ("lookup", "adaptive") for m in ("exact", "fast")}
    assert all(a.prompts == 4 and a.identical == 4 for a in report.arms if a.mode == "exact")
    # lookup blocks were verified, and some of them accepted (the random model loops)
    assert sum(a.lookup_cycles for a in report.arms) > 0 and sum(a.lookup_accepted for a in report.arms) > 0


@pytest.mark.parametrize("pos", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_lookup_blocks_sample_the_base_distribution(lm, copy_head, pos):
    """Prompt-lookup drafts are point-mass proposals: accept with p(x), else sample p without x.
    Both output positions must follow the base model's distribution (the second, which also
    covers the block's later positions and the bonus token, runs with the slow tests).
    Replacing the point mass by q = p fails this with p ~ 2e-6 (checked by hand)."""
    from daemon.measure.fidelity import lookup_context

    params = SamplingParams(temperature=1.0, top_k=6)
    ctx = lookup_context(lm, lm.tokenizer.encode("a b c d e f"), params)
    from daemon.measure.fidelity import DRAFTING
    from daemon.engine.decoders.sampling import Sampler
    from daemon.engine.decoders.speculative import speculative_decode

    first = next(speculative_decode(lm, copy_head, ctx, Sampler(params), 1, **DRAFTING["lookup"]))
    assert first.draft_source == "lookup" and first.drafted >= 2  # the test exercises lookup blocks
    res = distribution_test(lm, copy_head, ctx, params, 1, draws=200, alpha=1e-3, seed=3 + pos, position=pos,
                            drafting="lookup")
    assert res.passed, res
    if pos == 0:
        assert 0.05 < res.accepted_fraction < 0.95  # both branches of the point-mass rule ran


@pytest.mark.slow
def test_per_request_depth_samples_the_base_distribution(lm, copy_head):
    """Head cycles that stop below the ceiling on the head's own confidence keep p."""
    params = SamplingParams(temperature=1.0, top_k=6)
    ctx = lm.tokenizer.encode("a b c d")
    for pos in (0, 1):
        res = distribution_test(lm, copy_head, ctx, params, 3, draws=250, alpha=1e-3, seed=7 + pos, position=pos,
                                drafting="adaptive")
        assert res.passed, res


@pytest.mark.skipif(not (BUNDLED_MODEL / "config.json").exists(), reason="bundled model not trained yet")
def test_constrained_arms_pass_and_can_fail():
    """Constrained exact speculation against constrained serial decode; with noisy verify
    logits (no guard) the constrained arm fails: the gate can catch a divergence there too."""
    blm = load_model(BUNDLED_MODEL)
    head = load_mtp_head(blm)
    for kind in ("json_schema", "regex"):
        report = run_fidelity_gate(blm, head, load_prompts()[:2], depths=(1, 2), max_tokens=24, modes=("exact",),
                                   drafting=("mtp", "lookup"), constraint=kind, guard_margin=None)
        assert report.passed and all(a.constraint == kind for a in report.arms), [a.first_divergence for a in report.arms]
        assert sum(a.drafted for a in report.arms) > 0
    noisy = run_fidelity_gate(blm, head, load_prompts()[:2], depths=(2,), max_tokens=24, modes=("exact",),
                              constraint="json_object", guard_margin=None, logit_jitter=3.0)
    assert not noisy.passed and noisy.arms[0].first_divergence is not None


@pytest.mark.skipif(not (BUNDLED_MODEL / "config.json").exists(), reason="bundled model not trained yet")
def test_prefix_arms_resume_off_the_grid_with_serials_tokens():
    """Exact requests resumed from a prompt's exact end and from a continuation (off the
    chunk grid: this CPU's splits agree) decode serial's tokens, with the trained head's
    drafts accepted; where splits are not exact no arm runs."""
    from daemon.measure.fidelity_prefix import run_prefix_arms

    blm = load_model(BUNDLED_MODEL)
    head = load_mtp_head(blm)
    prompts = load_prompts()[:3]
    arms, exact_here = run_prefix_arms(blm, head, prompts, ArmResult, _serial_tokens, chunk=16, max_tokens=16, depth=3)
    assert exact_here and [a.drafting for a in arms] == ["mtp, resumed at a prompt end", "mtp, resumed at a continuation",
                                                         "mtp, prefilled in paced pieces", "mtp, prefilled together"]
    report = FidelityReport(model="bundled", rollback="capture", guard_margin=None, max_tokens=16, arms=arms)
    assert report.passed and [a.identical for a in arms] == [a.prompts for a in arms] == [3, 3, 3, 6], \
        [a.first_divergence for a in arms]
    encoded = [blm.encode_prompt(p, None, None) for p in prompts]
    assert arms[0].resumed_at == [len(p) - 1 for p in encoded]  # each prompt's exact end
    assert all(n > len(p) for n, p in zip(arms[1].resumed_at, encoded))  # past the prompt: the continuation
    assert any(n % 16 for a in arms for n in a.resumed_at) and sum(a.accepted for a in arms) > 0
    assert run_prefix_arms(blm, head, prompts, ArmResult, _serial_tokens, splits_exact=False) == ([], False)


def test_prefix_arms_fail_on_a_divergence(lm, copy_head):
    """Against a reference that is not serial's tokens the resumed requests diverge and the
    arm records where."""
    from daemon.measure.fidelity_prefix import run_prefix_arms

    def shifted(lm_, prompt, n, params=SamplingParams(), **kw):
        return [t + 1 for t in _serial_tokens(lm_, prompt, n, params, **kw)]

    arms, _ = run_prefix_arms(lm, copy_head, load_prompts()[:2], ArmResult, shifted, chunk=8, max_tokens=6)
    assert all(a.identical == 0 and a.flips == a.prompts and a.first_divergence["token"] == 0 for a in arms)
    assert [a.prompts for a in arms] == [2, 2, 2, 4]
