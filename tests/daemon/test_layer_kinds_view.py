"""``LoadedModel.layer_kinds_view``: the exactness probes run one layer of each kind.

MLX picks a kernel by op, shapes and dtypes, so a layer that gives the same bits two ways
does so for every layer built the same. The view keeps the first layer of each kind; these
tests hold it to being the same forward over those layers, to sharing the model's modules,
and to counting a layer that runs other kernels as another kind (so a probe still sees it).
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest

from daemon.engine.caches.prefix_cache import splits_agree
from daemon.engine.model.model import layer_kind

pytestmark = pytest.mark.quick


def test_the_view_keeps_the_first_layer_of_each_kind_and_shares_their_modules(lm):
    layers = lm.backbone.layers
    view = lm.layer_kinds_view()
    kinds = [layer_kind(layer) for layer in layers]
    assert len(set(kinds)) == 2  # GatedDeltaNet + MLP, gated attention + MLP
    fa = lm.backbone.fa_idx
    assert view.view_layers == (0, fa)
    assert [id(x) for x in view.backbone.layers] == [id(layers[i]) for i in view.view_layers]
    assert view.backbone.embed_tokens is lm.backbone.embed_tokens and view.backbone.norm is lm.backbone.norm
    assert (view.backbone.ssm_idx, view.backbone.fa_idx) == (0, 1)
    assert len(lm.backbone.layers) == len(kinds)  # the model's own list is untouched
    assert view.compiled_decode is None and len(view.make_cache()) == 2
    assert view.layer_kinds_view() is view


def test_the_view_forwards_as_the_model_does_over_its_layers(lm):
    """The view's forward (one prompt chunk, then a step) is mlx-lm's layer loop over the kept
    layers: embedding, each layer with its mask and cache, final norm."""
    from mlx_lm.models.base import create_attention_mask, create_ssm_mask

    view = lm.layer_kinds_view()
    rng = random.Random(1)
    ids = mx.array([[rng.randrange(1, 500) for _ in range(12)]], dtype=mx.uint32)
    cache, ref_cache = view.make_cache(), view.make_cache()
    got = [view.prefill_hidden(ids[:, :11], cache), view.hidden(ids[:, 11:], cache)]
    bb, want = lm.backbone, []
    for part in (ids[:, :11], ids[:, 11:]):
        h = bb.embed_tokens(part)
        fa, ssm = create_attention_mask(h, ref_cache[1]), create_ssm_mask(h, ref_cache[0])
        for layer, c in zip(view.backbone.layers, ref_cache):
            h = layer(h, mask=ssm if layer.is_linear else fa, cache=c)
        want.append(bb.norm(h))
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, want))


def _rounds_by_rows(module, chunk: int):
    """Make ``module`` (in place, by class, as the invariant kernels and the fused GatedDeltaNet
    block are installed) round a forward off the ``chunk`` grid unlike one on it."""
    cls = type(module)

    class RoundsByRows(cls):
        def __call__(self, x, *args, **kwargs):
            y = super().__call__(x, *args, **kwargs)
            return y * (1 + 2.0**-6) if x.shape[1] not in (1, chunk) else y

    module.__class__ = RoundsByRows
    return cls


def test_a_layer_that_runs_other_kernels_is_its_own_kind_and_the_probe_sees_it(lm):
    """The last layer's input norm rounds by row count: a kind of its own, in the view, and
    the split probe says no, though the first layers of the other kinds are exact."""
    last = len(lm.backbone.layers) - 1
    norm = lm.backbone.layers[last].input_layernorm
    assert last not in lm.layer_kinds_view().view_layers and splits_agree(lm, 16)
    cls = _rounds_by_rows(norm, 16)
    try:
        assert last in lm.layer_kinds_view().view_layers
        assert not splits_agree(lm, 16)
    finally:
        norm.__class__ = cls
    assert last not in lm.layer_kinds_view().view_layers


def test_the_last_kept_layers_output_is_compared_though_no_cache_holds_it(lm):
    """A later layer's MLP rounds by row count: a kind of its own, the view's last layer. Its
    output reaches no cache in the view (in the model, the next layer's), so the probe
    compares every forward's hidden states, and says no."""
    view = lm.layer_kinds_view()
    deep = view.view_layers[-1] + 1
    assert deep < len(lm.backbone.layers)
    mlp = lm.backbone.layers[deep].mlp
    cls = _rounds_by_rows(mlp, 16)
    try:
        assert lm.layer_kinds_view().view_layers == view.view_layers + (deep,)
        assert not splits_agree(lm, 16)
    finally:
        mlp.__class__ = cls


def test_a_layer_with_other_shapes_or_dtypes_is_its_own_kind(lm):
    """Quantized to other bits or held in another dtype, a layer's matmuls run other kernels."""
    deep = len(lm.backbone.layers) - 1
    layer = lm.backbone.layers[deep]
    before = layer_kind(layer)
    w = layer.mlp.down_proj.weight
    layer.mlp.down_proj.weight = w.astype(mx.float32)
    try:
        assert layer_kind(layer) != before and deep in lm.layer_kinds_view().view_layers
    finally:
        layer.mlp.down_proj.weight = w
    assert layer_kind(layer) == before


def test_the_compiled_steps_check_runs_the_view_and_sees_a_layer_of_another_kind(lm, monkeypatch):
    """``checked_compiled_decode`` checks one layer of each kind (the view's layers, each
    compiled by the same builders as the model's). A later layer whose MLP rounds differently
    under ``mx.compile`` (a fused kernel unlike the eager one) is a kind of its own, so it is in
    the view and the check refuses the compiled step; the model's own step covers every layer."""
    from daemon.engine.model import compiled as compiled_mod

    checked: list = []
    real = compiled_mod.self_check
    monkeypatch.setattr(compiled_mod, "self_check", lambda m, c, *a: checked.append((m, c)) or real(m, c, *a))
    step, reason = compiled_mod.checked_compiled_decode(lm)
    assert reason is None and step.batched and len(step.layers) == len(lm.backbone.layers)
    (m, c), = checked
    assert m.view_layers == lm.layer_kinds_view().view_layers and len(c.layers) == len(m.view_layers)

    deep = lm.layer_kinds_view().view_layers[-1] + 1
    layer = lm.backbone.layers[deep]
    assert layer.is_linear  # the bundled pattern: a GatedDeltaNet layer after the first attention
    mlp = layer.mlp
    cls = type(mlp)
    other = type("OtherMLP", (cls,), {})  # a class of its own (the same math): a kind of its own
    real_step = compiled_mod._linear_layer_step

    def rounds_otherwise(lay):  # its compiled step, and only its, off eager's bits by an ulp or so
        step = real_step(lay)
        if type(lay.mlp) is not other:
            return step

        def off(x, conv, state):
            y, conv, state = step(x, conv, state)
            return y * (1 + 2.0**-6), conv, state

        return off

    monkeypatch.setattr(compiled_mod, "_linear_layer_step", rounds_otherwise)
    assert compiled_mod.checked_compiled_decode(lm)[1] is None  # no layer of that class yet
    mlp.__class__ = other
    try:
        assert deep in lm.layer_kinds_view().view_layers
        step, reason = compiled_mod.checked_compiled_decode(lm)
    finally:
        mlp.__class__ = cls
    assert step is None and "differs from eager" in reason
