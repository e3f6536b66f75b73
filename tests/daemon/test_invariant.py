"""The invariant kernels' host side (engine/kernels/invariant.py), on the CPU: the mask each query
sees, the reference arithmetic, the class swap, and the probes' answers through it.

The CUDA and Metal kernels themselves cannot run here (no custom-kernel backend on the CPU:
the classes compute with the reference ops); they are proven on the H200 by
bench/probes/invariance_probe.py, whose results are committed."""

from __future__ import annotations

import mlx.core as mx
import pytest

from daemon.engine.kernels import invariant
from daemon.engine.decoders.batch import batch_matches_serial
from daemon.engine.decoders.exactness import verify_matches_serial
from daemon.engine.model.loading import load_model
from daemon.paths import BUNDLED_MODEL


@pytest.mark.quick
def test_visible_keys_follow_mlx_masks():
    assert invariant.visible_keys(None, 2, 1, 5).tolist() == [[[True] * 5]] * 2
    causal = invariant.visible_keys("causal", 1, 3, 5).tolist()[0]
    # the queries sit on the last three keys, as in MLX's fused attention
    assert causal == [[True, True, True, False, False], [True, True, True, True, False], [True] * 5]
    m = mx.array([[[[False, True, True]]], [[[True, True, False]]]])  # [B=2, 1, T=1, L=3]
    assert invariant.visible_keys(m, 2, 1, 3).tolist() == [[[False, True, True]], [[True, True, False]]]


@pytest.mark.quick
@pytest.mark.parametrize("mask", ["sliding", mx.zeros((1, 2, 1, 3)), mx.ones((1, 1, 1, 3), dtype=mx.bool_).astype(mx.float16)])
def test_masks_the_kernel_cannot_honour_are_refused(mask):
    with pytest.raises(ValueError):
        invariant.visible_keys(mask, 1, 1, 3)


@pytest.mark.quick
def test_reference_attention_is_attention():
    """The reference (the kernel's arithmetic in float32 ops) agrees with MLX's fused
    attention within bf16 rounding, causal and with a padded row."""
    mx.random.seed(0)
    q = mx.random.normal((2, 4, 3, 64)).astype(mx.bfloat16)
    k = mx.random.normal((2, 2, 9, 64)).astype(mx.bfloat16)
    v = mx.random.normal((2, 2, 9, 64)).astype(mx.bfloat16)
    for mask in ("causal", mx.array([[True] * 9, [False] * 4 + [True] * 5])[:, None, None, :]):
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask).astype(mx.float32)
        got = invariant.reference_sdpa(q, k, v, 0.125, mask).astype(mx.float32)
        assert mx.abs(want - got).max().item() < 2e-2


@pytest.fixture
def lm():
    m = load_model(BUNDLED_MODEL, compile_decode=False)
    yield m
    invariant.PERTURB_BATCHED = False


def test_install_swaps_the_forward_and_uninstall_restores_it(lm):
    tok = mx.array([[5, 6, 7]], dtype=mx.uint32)
    before = lm.logits(lm.hidden(tok, lm.make_cache()))
    n = invariant.install(lm.text_module)
    # 2 attention layers, every plain linear of the backbone, the tied embedding
    assert n > 2 and invariant.installed(lm.text_module)
    kinds = {type(m).__name__ for _, m in lm.text_module.named_modules()}
    assert {"InvariantAttention", "InvariantLinear", "InvariantEmbedding"} <= kinds
    assert "Linear" not in kinds
    during = lm.logits(lm.hidden(tok, lm.make_cache()))
    assert mx.abs(during.astype(mx.float32) - before.astype(mx.float32)).max().item() < 0.1
    invariant.uninstall(lm.text_module)
    assert not invariant.installed(lm.text_module)
    assert mx.array_equal(lm.logits(lm.hidden(tok, lm.make_cache())), before).item()


def test_the_probes_pass_through_the_invariant_classes_and_fail_when_perturbed(lm):
    """Through the swapped classes (reference ops here) a verify equals serial steps and a
    batch equals one-row forwards; the test hook's perturbation of multi-row products makes
    both probes fail, which is what makes the daemon refuse a path (kernel_choice.py)."""
    invariant.install(lm.text_module)
    assert verify_matches_serial(lm, "capture") is True
    assert batch_matches_serial(lm, 4) is True
    invariant.PERTURB_BATCHED = True
    for key in ("_verify_matches_serial", "_batch_matches_serial"):
        lm.__dict__.pop(key)
    assert verify_matches_serial(lm, "capture") is False
    assert batch_matches_serial(lm, 4) is False
