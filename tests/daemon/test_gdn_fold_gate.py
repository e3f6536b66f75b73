"""The fidelity gate with the GatedDeltaNet conv folded into the recurrence kernel, on this CPU.

The folded kernel runs only on CUDA (bench/gdn_check.py checks it there against its float32
reference, and the H200 passed the batched exact gate with it: bench/results/h200_2026-12-04c).
Here load_model takes its CUDA branch with each kernel replaced by its reference
(``gated_delta_conv_reference``, ``gated_delta_reference``), which round unlike mlx-lm's ops:
a decode, verify, batch or riding piece that skipped the folded routing would break the gate's
token-for-token comparison with serial decode."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("mlx.core")

from daemon.engine.kernels import gdn_fused, gdn_layer  # noqa: E402
from daemon.head_acceptance import load_prompts  # noqa: E402
from daemon.measure import fidelity  # noqa: E402
from daemon.paths import BUNDLED_MODEL  # noqa: E402


@pytest.fixture
def folded_on_cpu(monkeypatch):
    monkeypatch.setattr(gdn_fused, "backend_refusal", lambda: None)
    monkeypatch.setattr(gdn_fused, "gated_delta_conv_fused", gdn_fused.gated_delta_conv_reference)
    monkeypatch.setattr(gdn_fused, "gated_delta_fused", gdn_fused.gated_delta_reference)
    check = gdn_layer.conv_self_check
    monkeypatch.setattr(gdn_layer, "conv_self_check", lambda tm: check(tm, gdn_fused.gated_delta_conv_reference))


def test_the_batched_exact_gate_passes_with_the_conv_folded(folded_on_cpu, capsys):
    rc = fidelity.main(["--model", str(BUNDLED_MODEL), "--batched", "4", "--batched-only", "--modes", "exact",
                        "--tokens", "24"])
    seen = capsys.readouterr()
    out = seen.out + seen.err  # the model's description goes to stderr, the table to stdout
    assert "GatedDeltaNet recurrence: fused; projections: merged" in out, out[:2000]
    assert rc == 0 and "PASS" in out, out[-3000:]


def test_the_speculating_exact_gate_passes_with_the_conv_folded(folded_on_cpu, capsys, tmp_path):
    prompts = tmp_path / "prompts.json"  # four of the suite's (the reference recurrence is slow here)
    prompts.write_text(json.dumps(load_prompts()[:4]))
    rc = fidelity.main(["--model", str(BUNDLED_MODEL), "--depths", "3", "--modes", "exact", "--tokens", "24",
                        "--drafting", "mtp", "--draws", "0", "--no-deviation", "--prompts", str(prompts),
                        "--batched", ""])  # the batched arms are the test above's
    seen = capsys.readouterr()
    out = seen.out + seen.err
    assert "GatedDeltaNet recurrence: fused;" in out, out[:2000]
    assert rc == 0 and "PASS" in out, out[-3000:]
