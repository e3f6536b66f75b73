"""The decode step's residual adds written by the matmul before them (forward.decoder_layer,
``with_residual``; on CUDA quant_mma's residual variant), on this CPU: the walk computes mlx-lm's
decoder layers bit for bit, takes both adds of every layer through the layers' ``plus`` where
they have one and apart where they do not, and the compiled step built on it passes its
self-check against mlx-lm's eager forward (which adds apart). The compiled step traces a merged
attention around its eager middle (compiled._attention_parts), and a part that rounds
differently is refused."""

from __future__ import annotations

import pytest

mx = pytest.importorskip("mlx.core")
nn = pytest.importorskip("mlx.nn")

from mlx_lm.models.base import create_attention_mask, create_ssm_mask  # noqa: E402

from daemon.engine.kernels import forward, gdn_fused, gdn_layer, invariant, invariant_quant, merged_linears  # noqa: E402
from daemon.engine.kernels import quant_mma  # noqa: E402
from daemon.engine.model import compiled as compiled_mod  # noqa: E402
from daemon.engine.model.compiled import CompiledDecode, enable_compiled_decode, self_check  # noqa: E402
from daemon.engine.model.loading import load_model  # noqa: E402

pytestmark = pytest.mark.quick


def _routed_model(path):
    """The random checkpoint at 4 bits, on the daemon's CUDA layer set (the GatedDeltaNet kernel's
    CPU reference, merged projections, the quantized linears routed): every quantized linear has
    ``plus``."""
    lm = load_model(path, compile_decode=False)
    nn.quantize(lm.text_module, group_size=32, bits=4)
    gdn_layer.install(lm.text_module, gdn_fused.gated_delta_reference)
    merged_linears.install(lm.text_module)
    invariant.install(lm.text_module, quantized_only=True)
    return lm


def _walk(lm, layer_call, steps=(7, 11)) -> list:
    """A 5-token prompt then one-token steps through every layer by ``layer_call(layer, h, mask,
    cache)``, masks as mlx-lm's backbone makes them; every layer's output, in order."""
    bb = lm.backbone
    cache = lm.make_cache()
    out = []
    for tokens in ([[3, 17, 5, 90, 41]], *([[t]] for t in steps)):
        h = bb.embed_tokens(mx.array(tokens))
        fa_mask = create_attention_mask(h, cache[bb.fa_idx])
        ssm_mask = create_ssm_mask(h, cache[bb.ssm_idx])
        for layer, c in zip(bb.layers, cache):
            h = layer_call(layer, h, ssm_mask if layer.is_linear else fa_mask, c)
            out.append(h)
        mx.eval(out)
    return out


@pytest.fixture
def plus_calls(monkeypatch):
    """How many times a routed quantized linear added a residual in its call."""
    calls = []
    original = invariant.InvariantQuantizedLinear.plus

    def counted(self, x, residual):
        calls.append(self)
        return original(self, x, residual)

    monkeypatch.setattr(invariant.InvariantQuantizedLinear, "plus", counted)
    return calls


def test_the_walk_is_mlx_lms_layer_bit_for_bit_with_both_adds_in_the_matmuls(random_model_path, plus_calls):
    lm = _routed_model(random_model_path)
    theirs = _walk(lm, lambda layer, h, mask, c: layer(h, mask, c))
    assert plus_calls == []  # mlx-lm's layers add apart
    ours = _walk(lm, forward.decoder_layer)
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert mx.array_equal(a, b).item(), f"layer output {i} differs"
    layers = lm.backbone.layers
    # two adds a layer (after the mixer's out projection, after the MLP's down projection), three forwards
    assert len(plus_calls) == 2 * len(layers) * 3
    downs = {id(layer.mlp.down_proj) for layer in layers}
    outs = {id(layer.linear_attn.out_proj if layer.is_linear else layer.self_attn.o_proj) for layer in layers}
    assert {id(m) for m in plus_calls} == downs | outs


def test_switched_off_every_add_is_apart_with_the_same_bits(random_model_path, plus_calls, monkeypatch):
    lm = _routed_model(random_model_path)
    fused = _walk(lm, forward.decoder_layer)
    n = len(plus_calls)
    monkeypatch.setattr(forward, "FUSE_RESIDUAL", False)
    apart = _walk(lm, forward.decoder_layer)
    assert len(plus_calls) == n
    assert all(mx.array_equal(a, b).item() for a, b in zip(fused, apart))


def test_layers_without_plus_add_apart(random_model_path, plus_calls):
    """mlx-lm's own layers (nothing installed) have no ``plus``: the walk adds apart and still
    computes their layers' bits."""
    lm = load_model(random_model_path, compile_decode=False)
    ours = _walk(lm, forward.decoder_layer)
    theirs = _walk(lm, lambda layer, h, mask, c: layer(h, mask, c))
    assert plus_calls == []
    assert all(mx.array_equal(a, b).item() for a, b in zip(ours, theirs))


def test_the_compiled_step_on_the_walk_passes_its_check_against_mlx_lms_eager_layers(random_model_path, plus_calls):
    lm = _routed_model(random_model_path)
    assert enable_compiled_decode(lm) is None, lm.decode_path
    assert plus_calls, "the compiled step's traces took no add into a matmul"
    assert lm.compiled_decode.batched, lm.compiled_decode.batch_reason


def test_a_residual_the_kernel_cannot_take_is_added_apart():
    x = mx.ones((2, 3, 64), dtype=mx.bfloat16)
    assert quant_mma.residual_refusal(x, 32, mx.zeros((2, 3, 32), dtype=mx.bfloat16)) is None
    assert "float32 residual" in quant_mma.residual_refusal(x, 32, mx.zeros((2, 3, 32), dtype=mx.float32))
    assert "shape (1, 32)" in quant_mma.residual_refusal(x, 32, mx.zeros((1, 32), dtype=mx.bfloat16))
    w, scales, biases = mx.quantize(mx.random.normal((32, 64), key=mx.random.key(1)), group_size=32, bits=4)
    y = invariant_quant.quantized_matmul(x, w, scales, biases, 32, 4, None)
    for residual in (mx.full((2, 3, 32), 0.5, dtype=mx.bfloat16), mx.full((1, 32), 0.25, dtype=mx.bfloat16)):
        got = invariant_quant.quantized_matmul(x, w, scales, biases, 32, 4, None, residual=residual)
        assert got.shape == y.shape and mx.array_equal(got, residual + y).item()


def test_a_merged_attention_is_traced_around_its_middle_and_checked(random_model_path, monkeypatch):
    lm = _routed_model(random_model_path)
    assert enable_compiled_decode(lm) is None, lm.decode_path
    c = lm.compiled_decode
    assert [p is not None for p in c.attention_parts] == [not layer.is_linear for layer in c.layers]
    real = compiled_mod._attention_parts

    def off_by_a_little(layer):
        head, tail = real(layer)
        return head, mx.compile(lambda x, output, gate: tail(x, output, gate) * 1.01)

    monkeypatch.setattr(compiled_mod, "_attention_parts", off_by_a_little)
    reason = self_check(lm, CompiledDecode(lm.backbone))
    assert reason is not None and "differs from eager" in reason
