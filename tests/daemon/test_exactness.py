"""The start-up probe: does a verify reproduce serial steps bit for bit on this backend?"""

from __future__ import annotations

import mlx.core as mx
import pytest

from daemon.engine.decoders import rollback as rollback_mod
from daemon.engine.decoders.exactness import verify_matches_serial
from daemon.engine.model.loading import load_model


@pytest.mark.parametrize("compile_decode", [True, False])
def test_cpu_verify_matches_serial_for_both_strategies(random_model_path, compile_decode):
    lm = load_model(random_model_path, compile_decode=compile_decode)
    assert verify_matches_serial(lm, "capture")
    assert verify_matches_serial(lm, "snapshot")


@pytest.mark.quick
def test_a_verify_that_rounds_differently_is_caught(random_model_path, monkeypatch):
    """A verify whose logits differ by one bf16 ulp somewhere, as CUDA's M>=2 kernels do."""
    lm = load_model(random_model_path, compile_decode=False)
    real = rollback_mod.CaptureRollback.forward

    def nudged(self, tokens):
        h = real(self, tokens)
        return h + (mx.arange(h.shape[1]) == 1).reshape(1, -1, 1).astype(h.dtype) * 2.0**-7

    monkeypatch.setattr(rollback_mod.CaptureRollback, "forward", nudged)
    assert not verify_matches_serial(lm, "capture")
    assert verify_matches_serial(lm, "snapshot")  # the other strategy is probed on its own


def test_a_commit_that_leaves_another_state_is_caught(random_model_path, monkeypatch):
    """Same logits, but a partial accept that keeps the wrong per-token state."""
    lm = load_model(random_model_path, compile_decode=False)
    real = rollback_mod.CaptureRollback.commit

    def off_by_one(self, keep):
        real(self, min(keep + 1, self.T) if keep < self.T else keep)

    monkeypatch.setattr(rollback_mod.CaptureRollback, "commit", off_by_one)
    assert not verify_matches_serial(lm, "capture")


def test_the_probe_runs_once_per_strategy(random_model_path, monkeypatch):
    lm = load_model(random_model_path, compile_decode=False)
    assert verify_matches_serial(lm, "capture")
    monkeypatch.setattr(rollback_mod.CaptureRollback, "forward", lambda *a: (_ for _ in ()).throw(AssertionError))
    assert verify_matches_serial(lm, "capture")  # cached: no second probe


def test_exact_guard_is_off_only_where_the_probe_proves_bit_identity(random_model_path, monkeypatch):
    from daemon.engine.decoders.exactness import exact_guard

    lm = load_model(random_model_path, compile_decode=False)
    assert exact_guard(lm, "capture", 0.03) is None  # CPU: verify == serial steps, no guard needed
    lm2 = load_model(random_model_path, compile_decode=False)
    real = rollback_mod.CaptureRollback.forward

    def nudged(self, tokens):
        h = real(self, tokens)
        return h + (mx.arange(h.shape[1]) == 1).reshape(1, -1, 1).astype(h.dtype) * 2.0**-7

    monkeypatch.setattr(rollback_mod.CaptureRollback, "forward", nudged)
    assert exact_guard(lm2, "capture", 0.03) == 0.03  # rounds unlike serial: the guard stays
