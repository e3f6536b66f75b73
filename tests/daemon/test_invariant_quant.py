"""The fixed-order quantized matmul's host side (engine/kernels/invariant_quant.py), on the CPU: the
reference arithmetic against MLX's quantized matmul and dequantize, its batch invariance,
the class swap that routes quantized linears and a quantized tied head through it, the
layouts it refuses, and the start-up probes through it on a small quantized qwen3_5.

The CUDA and Metal kernels themselves cannot run here (no custom-kernel backend on the
CPU: the classes compute with the reference); bench/quant_kernel_check.py checks them on a
GPU against the same arithmetic."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from daemon.engine.kernels import invariant, invariant_quant
from daemon.engine.model.loading import load_model
from daemon.engine_thread.kernel_choice import choose_kernels


def _quantized(N: int, K: int, gs: int, bits: int, dtype=mx.float32, seed: int = 0):
    mx.random.seed(seed)
    w = mx.random.normal((N, K)).astype(dtype)
    return mx.quantize(w, group_size=gs, bits=bits)


@pytest.mark.quick
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("gs", [32, 64, 128])
def test_the_packing_is_what_the_kernel_reads(bits, gs):
    """Element i of a uint32 word is bits [i * bits, (i + 1) * bits); w = q * scale + bias
    of its group. Unpacked by hand here and compared with mx.dequantize."""
    q, s, b = _quantized(6, 256, gs, bits)
    words = q.astype(mx.uint32)
    epw = 32 // bits
    shifts = mx.arange(epw, dtype=mx.uint32) * bits
    codes = ((words[:, :, None] >> shifts) & ((1 << bits) - 1)).reshape(6, 256).astype(mx.float32)
    by_hand = codes * mx.repeat(s, gs, axis=1) + mx.repeat(b, gs, axis=1)
    assert mx.allclose(by_hand, mx.dequantize(q, s, b, group_size=gs, bits=bits), atol=1e-6).item()


@pytest.mark.quick
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("gs", [32, 64, 128])
def test_reference_matches_mlx_quantized_matmul(bits, gs):
    """float32: the reference equals MLX's quantized matmul to float32 rounding; bf16: it
    equals the float32 product of the dequantized weight within one bf16 rounding of the
    output (the kernel accumulates in float32, whatever the activation dtype)."""
    q, s, b = _quantized(96, 384, gs, bits)
    x = mx.random.normal((5, 384))
    got = invariant_quant.reference_quantized_matmul(x, q, s, b, gs, bits)
    want = mx.quantized_matmul(x, q, s, b, transpose=True, group_size=gs, bits=bits)
    assert got.dtype == mx.float32 and got.shape == (5, 96)
    assert mx.abs(got - want).max().item() <= 1e-4 * mx.abs(want).max().item()

    qb, sb, bb = _quantized(96, 384, gs, bits, dtype=mx.bfloat16)
    xb = x.astype(mx.bfloat16)
    got = invariant_quant.reference_quantized_matmul(xb, qb, sb, bb, gs, bits)
    assert got.dtype == mx.bfloat16
    exact = xb.astype(mx.float32) @ mx.dequantize(qb, sb.astype(mx.float32), bb.astype(mx.float32),
                                                  group_size=gs, bits=bits).T
    err = mx.abs(got.astype(mx.float32) - exact)
    assert (err <= mx.abs(exact) * 2**-8 + 1e-6).all().item()


@pytest.mark.quick
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_reference_is_batch_invariant(dtype):
    """Row r's bits do not depend on how many rows share the product (M = 1..32), nor on
    the leading shape ([B, T, K] as the model calls it)."""
    q, s, b = _quantized(200, 512, 64, 4, dtype=dtype)
    x = mx.random.normal((32, 512)).astype(dtype)
    full = invariant_quant.reference_quantized_matmul(x, q, s, b, 64, 4)
    for m in (1, 2, 3, 4, 8, 16, 32):
        part = invariant_quant.reference_quantized_matmul(x[:m], q, s, b, 64, 4)
        assert mx.array_equal(part, full[:m]).item(), m
    as_bt = invariant_quant.reference_quantized_matmul(x.reshape(4, 8, 512), q, s, b, 64, 4)
    assert mx.array_equal(as_bt.reshape(32, 200), full).item()
    # chunked over columns (a small chunk budget) gives the same bits
    chunked = invariant_quant.reference_quantized_matmul(x, q, s, b, 64, 4, chunk_bytes=4096)
    assert mx.array_equal(chunked, full).item()


@pytest.mark.quick
def test_the_cpu_routes_the_matmul_through_the_reference():
    assert invariant.backend() is None
    q, s, b = _quantized(64, 128, 32, 8)
    x = mx.random.normal((3, 128))
    assert mx.array_equal(invariant.invariant_quantized_matmul(x, q, s, b, 32, 8),
                          invariant_quant.reference_quantized_matmul(x, q, s, b, 32, 8)).item()


def _layer(bits=4, gs=64, mode="affine", N=48, K=256, bias=False):
    mx.random.seed(1)
    lin = nn.Linear(K, N, bias=bias)
    if bias:
        lin.bias = mx.random.normal((N,))
    return nn.QuantizedLinear.from_linear(lin, group_size=gs, bits=bits, mode=mode)


@pytest.mark.quick
@pytest.mark.parametrize("kw,needle", [
    (dict(mode="mxfp4", gs=32), "affine"),
    (dict(bits=3), "3-bit"),
    (dict(bits=6), "6-bit"),
])
def test_layouts_the_kernel_cannot_take_are_refused_with_a_reason(kw, needle):
    layer = _layer(**kw)
    why = invariant_quant.refusal(layer)
    assert why is not None and needle in why, why
    model = nn.Sequential(layer, _layer())  # one refused, one taken
    x = mx.random.normal((2, 256))
    before = model.layers[0](x)
    assert invariant.install(model) == 1
    assert invariant.REFUSED == {"layers.0": why}
    assert type(model.layers[0]) is nn.QuantizedLinear  # left MLX's
    assert type(model.layers[1]) is invariant.InvariantQuantizedLinear
    assert mx.array_equal(model.layers[0](x), before).item()
    invariant.uninstall(model)
    assert type(model.layers[1]) is nn.QuantizedLinear


@pytest.mark.quick
def test_a_layout_whose_shapes_disagree_is_refused():
    layer = _layer(gs=64)
    layer.scales = layer.scales[:, :-1]
    layer.biases = layer.biases[:, :-1]
    assert "do not fit" in invariant_quant.refusal(layer)
    layer = _layer()
    del layer["biases"]
    layer.biases = None
    assert "no biases" in invariant_quant.refusal(layer)


@pytest.mark.quick
def test_install_swaps_quantized_linears_and_the_tied_head_and_uninstall_restores_them():
    """A quantized linear with a bias and a quantized embedding used as a tied head: during
    install they compute the reference (which differs from MLX's CPU quantized matmul in
    bf16: that one does not accumulate in float32), after uninstall MLX's again, bit for bit."""
    mx.random.seed(2)
    emb = nn.QuantizedEmbedding.from_embedding(nn.Embedding(320, 256), group_size=64, bits=4)
    emb.update({k: v.astype(mx.bfloat16) for k, v in emb.parameters().items() if k in ("scales", "biases")})
    lin = _layer(bits=8, gs=32, N=256, K=256, bias=True)
    lin.update({k: v.astype(mx.bfloat16) for k, v in lin.parameters().items() if k in ("scales", "biases", "bias")})
    model = nn.Sequential(emb, lin)
    x = mx.random.normal((2, 3, 256)).astype(mx.bfloat16)
    before = (lin(x), emb.as_linear(x), emb(mx.array([[1, 7]])))
    assert invariant.install(model) == 2 and invariant.installed(model) and not invariant.REFUSED
    assert isinstance(emb, invariant.InvariantQuantizedEmbedding)
    assert isinstance(lin, invariant.InvariantQuantizedLinear)
    during = (lin(x), emb.as_linear(x), emb(mx.array([[1, 7]])))
    ref = invariant_quant.reference_quantized_matmul
    assert mx.array_equal(during[0], ref(x, lin.weight, lin.scales, lin.biases, 32, 8) + lin.bias).item()
    assert mx.array_equal(during[1], ref(x, emb.weight, emb.scales, emb.biases, 64, 4)).item()
    assert mx.array_equal(during[2], before[2]).item()  # the lookup is MLX's
    assert not mx.array_equal(during[1], before[1]).item()  # the head really went another way
    assert mx.abs(during[1].astype(mx.float32) - before[1].astype(mx.float32)).max().item() < 2.0
    invariant.uninstall(model)
    assert not invariant.installed(model)
    assert type(emb) is nn.QuantizedEmbedding and type(lin) is nn.QuantizedLinear
    after = (lin(x), emb.as_linear(x), emb(mx.array([[1, 7]])))
    assert all(mx.array_equal(a, b).item() for a, b in zip(after, before))


@pytest.mark.quick
def test_forwards_over_max_rows_take_mlx_path():
    lin = _layer(bits=4, gs=64, N=64, K=256)
    x = mx.random.normal((invariant.MAX_ROWS + 1, 256)).astype(mx.bfloat16)
    mlx_y = lin(x)
    invariant.install(lin)
    try:
        assert mx.array_equal(lin(x), mlx_y).item()  # a prompt chunk: MLX's
        assert mx.array_equal(lin(x[:2]), invariant_quant.reference_quantized_matmul(
            x[:2], lin.weight, lin.scales, lin.biases, 64, 4)).item()
    finally:
        invariant.uninstall(lin)


@pytest.fixture(scope="module")
def quantized_lm(tmp_path_factory):
    """The small random qwen3_5 (tied head), its base quantized 4-bit, group 32."""
    from daemon.engine.model.random_model import build_random_model

    path = build_random_model(tmp_path_factory.mktemp("random-q") / "model", seed=3)
    lm = load_model(path, compile_decode=False)
    nn.quantize(lm.text_module, group_size=32, bits=4)
    mx.eval(lm.text_module.parameters())
    return lm


@pytest.fixture
def fresh_probes(quantized_lm, monkeypatch, tmp_path):
    monkeypatch.setenv("COUNCILD_CACHE_DIR", str(tmp_path / "cache"))
    yield quantized_lm
    invariant.PERTURB_BATCHED = False
    invariant.uninstall(quantized_lm.text_module)
    quantized_lm.kernels = "mlx"
    for key in ("_verify_matches_serial", "_batch_matches_serial", "_ragged_verify_matches_serial"):
        quantized_lm.__dict__.pop(key, None)


def test_a_quantized_model_passes_the_probes_through_the_invariant_classes(fresh_probes):
    lm = fresh_probes
    kinds = {type(m) for _, m in lm.text_module.named_modules()}
    assert nn.QuantizedLinear in kinds and nn.QuantizedEmbedding in kinds
    tok = mx.array([[5, 6, 7]], dtype=mx.uint32)
    before = lm.logits(lm.hidden(tok, lm.make_cache()))
    choice = choose_kernels(lm, "invariant", rollback="capture", rows=4, ragged=True, compile_decode=False)
    assert choice.kernels == "invariant", choice.reason
    assert all(choice.probes["invariant"].values()) and set(choice.probes["invariant"]) == {
        "verify", "batch", "ragged_verify"}
    kinds = {type(m) for _, m in lm.text_module.named_modules()}
    assert nn.QuantizedLinear not in kinds and nn.QuantizedEmbedding not in kinds
    assert {invariant.InvariantQuantizedLinear, invariant.InvariantQuantizedEmbedding} <= kinds
    assert invariant.REFUSED == {}
    during = lm.logits(lm.hidden(tok, lm.make_cache()))
    assert mx.abs(during.astype(mx.float32) - before.astype(mx.float32)).max().item() < 0.25
    invariant.uninstall(lm.text_module)
    assert mx.array_equal(lm.logits(lm.hidden(tok, lm.make_cache())), before).item()


def test_a_perturbed_quantized_path_is_refused(fresh_probes):
    """The test hook perturbs multi-row products of the invariant classes, the quantized ones
    included: the probes fail and the model goes back to MLX's kernels."""
    lm = fresh_probes
    invariant.PERTURB_BATCHED = True
    choice = choose_kernels(lm, "invariant", rollback="capture", rows=4, ragged=False, compile_decode=False)
    assert choice.kernels == "mlx" and "refused" in choice.reason
    assert choice.probes["invariant"] == {"verify": False, "batch": False}
    assert not invariant.installed(lm.text_module)


def test_only_the_quantized_classes_carry_a_perturbation_into_a_fully_quantized_forward(fresh_probes):
    """With every linear and the head quantized, the perturbation can reach the logits only
    through the quantized classes (and the attention, which it does not touch): a batched
    forward's logits then differ from the unperturbed ones, so the routing is real."""
    lm = fresh_probes
    invariant.install(lm.text_module)
    assert not any(type(m) in (nn.Linear, nn.Embedding) for _, m in lm.text_module.named_modules())
    toks = mx.array([[5, 6, 7], [8, 9, 10]], dtype=mx.uint32)
    plain = lm.logits(lm.hidden(toks, lm.make_cache()))
    invariant.PERTURB_BATCHED = True
    perturbed = lm.logits(lm.hidden(toks, lm.make_cache()))
    assert not mx.array_equal(plain, perturbed).item()


def test_a_kernel_that_raises_is_refused_not_fatal(fresh_probes, monkeypatch):
    """An unproven kernel that fails to compile or run on this device (here: the quantized
    path raising) makes the daemon keep MLX's kernels with the error as the reason."""
    lm = fresh_probes

    def broken(*a, **kw):
        raise RuntimeError("nvrtc: error: simulated compile failure")

    monkeypatch.setattr(invariant_quant, "quantized_matmul", broken)
    choice = choose_kernels(lm, "invariant", rollback="capture", rows=4, ragged=False, compile_decode=False)
    assert choice.kernels == "mlx" and "simulated compile failure" in choice.reason and "refused" in choice.reason
    assert not invariant.installed(lm.text_module) and lm.kernels == "mlx"
