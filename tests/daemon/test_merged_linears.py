"""Projections that read one input merged into one matmul (daemon/engine/kernels/merged_linears.py),
on this CPU: the merged model computes what the separate one did, holds each weight once,
routes every GatedDeltaNet forward through the merged matmul, passes the exactness probes,
and comes apart again."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

mx = pytest.importorskip("mlx.core")
nn = pytest.importorskip("mlx.nn")

from mlx_lm.models import qwen3_next  # noqa: E402

from daemon.engine.decoders.batch import batch_matches_serial  # noqa: E402
from daemon.engine.decoders.exactness import ragged_verify_matches_serial, verify_matches_serial  # noqa: E402
from daemon.engine.kernels import gdn_fused, gdn_layer, invariant, merged_linears  # noqa: E402
from daemon.engine.model.compiled import enable_compiled_decode  # noqa: E402
from daemon.engine.model.loading import load_model  # noqa: E402
from daemon.engine.prefill.mixed_forward import mixed_hidden  # noqa: E402
from daemon.engine.prefill.prefill import prefill  # noqa: E402

pytestmark = pytest.mark.quick

PROMPT = [3, 17, 5, 90, 41, 8, 2, 66, 13]


def _hidden_and_steps(lm) -> list:
    """The prompt's last hidden state, then three decode steps' (the cache carried)."""
    cache = lm.make_cache()
    out = [prefill(lm, PROMPT, cache)]
    for t in (7, 11, 19):
        out.append(lm.hidden(mx.array([[t]]), cache))
    mx.eval(out)
    return out


def _install_growth(path, quantized: bool) -> tuple[int, int]:
    """MLX's active memory grown by ``merged_linears.install``, and the linear layers' weight
    bytes, measured in a process of its own: in a test process, what earlier tests left (a
    full run grew 27-30 KB past the bound twice, in two of four runs; alone it shrinks) would
    be measured with it."""
    code = f"""
import json, mlx.core as mx, mlx.nn as nn
from daemon.engine.model.loading import load_model
from daemon.engine.kernels import gdn_fused, gdn_layer, merged_linears
lm = load_model({str(path)!r}, compile_decode=False)
if {quantized}:
    nn.quantize(lm.text_module, group_size=32, bits=4)
gdn_layer.install(lm.text_module, gdn_fused.gated_delta_reference)
mx.eval(lm.text_module.parameters())
mx.synchronize()
memory = mx.get_active_memory()
merged_linears.install(lm.text_module)
mx.synchronize()
weights = sum(m["weight"].nbytes for _, m in lm.text_module.named_modules()
              if isinstance(m, (nn.Linear, nn.QuantizedLinear)))
print(json.dumps([mx.get_active_memory() - memory, weights]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    grown, weights = json.loads(out.stdout.strip().splitlines()[-1])
    return grown, weights


@pytest.mark.parametrize("quantized", [False, True], ids=["bf16", "4-bit"])
def test_a_merged_model_computes_what_the_separate_one_did_and_holds_each_weight_once(random_model_path, quantized):
    lm = load_model(random_model_path, compile_decode=False)
    if quantized:
        nn.quantize(lm.text_module, group_size=32, bits=4)
    gdn_layer.install(lm.text_module, gdn_fused.gated_delta_reference)
    before = _hidden_and_steps(lm)
    n = merged_linears.install(lm.text_module)
    n_mlp = sum(type(m) is merged_linears.MergedMLP for _, m in lm.text_module.named_modules())
    n_attn = sum(type(m) is merged_linears.MergedAttention for _, m in lm.text_module.named_modules())
    assert n == len(gdn_layer.layers(lm.text_module)) + n_mlp + n_attn and n_mlp == len(lm.backbone.layers)
    assert n_attn == len(lm.backbone.layers) - len(gdn_layer.layers(lm.text_module)) > 0
    assert merged_linears.installed(lm.text_module) == n
    # The originals now read rows of the merged arrays: no second copy of the weights.
    grown, weights = _install_growth(random_model_path, quantized)
    assert grown < 0.05 * weights, (grown, weights)
    after = _hidden_and_steps(lm)
    # One dot product per output over the same row, on MLX's CPU kernels: the same bits.
    assert all(mx.array_equal(x, y).item() for x, y in zip(before, after))
    merged_linears.uninstall(lm.text_module)
    assert merged_linears.installed(lm.text_module) == 0
    assert all(type(m) not in (merged_linears.MergedMLP, merged_linears.MergedAttention)
               for _, m in lm.text_module.named_modules())
    assert all(mx.array_equal(x, y).item() for x, y in zip(before, _hidden_and_steps(lm)))


def test_every_gated_delta_forward_goes_through_the_merged_matmul_and_the_probes_pass(random_model_path):
    lm = load_model(random_model_path, compile_decode=False)
    gdn_layer.install(lm.text_module, gdn_fused.gated_delta_reference)
    merged_linears.install(lm.text_module)
    calls = []

    def counting(layer, name):
        inner = type(layer).__call__

        class Counted(type(layer)):
            def __call__(self, x):
                calls.append((name, *x.shape[:2]))
                return inner(self, x)

        layer.__class__ = Counted

    gdn = gdn_layer.layers(lm.text_module)
    for attn in gdn:
        counting(attn.in_proj_merged, "merged")
        counting(attn.in_proj_qkv, "qkv")  # a path that still ran the separate projections shows here
    cache = lm.make_cache()
    prefill(lm, PROMPT, cache)
    calls.clear()
    mx.eval(lm.hidden(mx.array([[5]]), cache))
    assert calls == [("merged", 1, 1)] * len(gdn)  # the merged matmul, never in_proj_qkv
    # A trace holds the merged forward; exactness probes (capture and snapshot verify, batch,
    # ragged verify) pass on the merged model.
    assert enable_compiled_decode(lm) is None
    assert verify_matches_serial(lm, "capture") and verify_matches_serial(lm, "snapshot")
    assert batch_matches_serial(lm, 4) and ragged_verify_matches_serial(lm)


def test_every_attention_forward_goes_through_the_merged_matmul_invariant_or_not(random_model_path):
    """q, k and v as one matmul in every forward that projects attention: the model's own
    (mlx-lm's op order, MLX's attention), the invariant attention's, and the mixed step's
    (groups of rows through one forward); taking the invariant set off leaves the merged class."""
    lm = load_model(random_model_path, compile_decode=False)
    gdn_layer.install(lm.text_module, gdn_fused.gated_delta_reference)
    merged_linears.install(lm.text_module)
    calls = []
    attns = [m for _, m in lm.text_module.named_modules() if type(m) is merged_linears.MergedAttention]
    assert attns
    for attn in attns:
        for name in ("qkv_proj_merged", "q_proj"):
            layer, inner = attn[name], type(attn[name]).__call__

            class Counted(type(layer)):
                def __call__(self, x, _name=name, _inner=inner):
                    calls.append(_name)
                    return _inner(self, x)

            layer.__class__ = Counted

    def one_step_and_a_mixed_forward() -> list:
        cache, ride_cache = lm.make_cache(), lm.make_cache()
        prefill(lm, PROMPT, cache)
        calls.clear()
        mx.eval(lm.hidden(mx.array([[5]]), cache))
        step = list(calls)
        calls.clear()
        mx.eval(mixed_hidden(lm, [(mx.array([[7]]), cache), (mx.array([PROMPT[:4]]), ride_cache)]))
        return step + list(calls)

    assert one_step_and_a_mixed_forward() == ["qkv_proj_merged"] * (2 * len(attns))
    invariant.install(lm.text_module)
    assert all(type(a) is invariant.InvariantAttention for a in attns)
    assert one_step_and_a_mixed_forward() == ["qkv_proj_merged"] * (2 * len(attns))
    invariant.uninstall(lm.text_module)
    assert all(type(a) is merged_linears.MergedAttention for a in attns)
    merged_linears.uninstall(lm.text_module)
    assert all(type(a) is qwen3_next.Qwen3NextAttention for a in attns)


def test_layers_that_cannot_be_one_matmul_are_refused_and_left_alone():
    a, b = nn.Linear(8, 4, bias=False), nn.Linear(8, 6, bias=False)
    assert merged_linears.refusal([a, b]) is None
    assert "different widths" in merged_linears.refusal([a, nn.Linear(16, 4, bias=False)])
    assert "different arrays" in merged_linears.refusal([a, nn.Linear(8, 4, bias=True)])
    q4 = nn.QuantizedLinear.from_linear(nn.Linear(64, 8, bias=False), group_size=32, bits=4)
    q8 = nn.QuantizedLinear.from_linear(nn.Linear(64, 8, bias=False), group_size=32, bits=8)
    assert "different classes" in merged_linears.refusal([nn.Linear(64, 8, bias=False), q4])
    assert "quantized differently" in merged_linears.refusal([q4, q8])

    class Routed(nn.Linear):
        pass

    swapped = nn.Linear(8, 4, bias=False)
    swapped.__class__ = Routed
    assert "not a plain" in merged_linears.refusal([swapped, a])
    mlp = qwen3_next.Qwen3NextMLP(64, 16)
    mlp.up_proj = nn.QuantizedLinear.from_linear(nn.Linear(64, 16, bias=False), group_size=32, bits=4)
    mx.eval(mlp.parameters())
    assert merged_linears.install(mlp) == 0 and type(mlp) is qwen3_next.Qwen3NextMLP
    # What merges computes what it did: x through the merged pair, split.
    merged, ends = merged_linears.merge([a, b])
    x = mx.random.normal((3, 8))
    assert ends == [4]
    y = merged(x)
    assert mx.array_equal(y[:, :4], a(x)).item() and mx.array_equal(y[:, 4:], b(x)).item()


def test_load_model_says_why_the_projections_stay_separate_here(random_model_path):
    # On this CPU the GatedDeltaNet layers run mlx-lm's block, which reads the separate layers.
    lm = load_model(random_model_path, compile_decode=False)
    assert lm.linears == "separate: the GatedDeltaNet layers run mlx-lm's block"
    assert merged_linears.installed(lm.text_module) == 0
    off = load_model(random_model_path, compile_decode=False, merge_linears=False)
    assert off.linears == 'separate: configured (merge_linears = "off")'
