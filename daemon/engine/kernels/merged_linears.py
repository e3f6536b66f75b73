"""Linear layers that read the same input, as one matmul: fewer kernels in a host-bound step.

Why: on CUDA a 27B-shaped decode step is bound by the host's cost per kernel (~4.5 us each to
encode, more for a custom kernel; bench/results/h200_2026-12-03d), not by reading the weights.
Each GatedDeltaNet layer projects its input four times (in_proj_qkv, in_proj_z, in_proj_b,
in_proj_a) and each MLP twice (gate_proj, up_proj): ~500 quantized matmuls a 27B step, of
which 208 go away when each group is one matmul over the concatenated output rows.

How: ``merge`` concatenates the group's weights (and scales, biases, bias) along the output
axis into one layer of the same class, then points every original layer's arrays at its
rows of the merged ones: slices of a row-contiguous array, which MLX keeps as views of the
same buffer. So the model holds each weight once; the original modules stay where mlx-lm and
the rest of the daemon look for them (the MTP head's quantization reads the base MLP's
layers by path), and a forward that calls them gets the same weights.

- GatedDeltaNet (qwen3_5 layout): ``attn.in_proj_merged`` with ``attn._in_proj_splits``
  (an underscore: a tuple of ints, not a parameter);
  ``forward.gdn_projections`` uses it, so it takes effect where the daemon's GatedDeltaNet
  forward runs (gdn_layer.py's block, the capture, the mixed step, chunked prefill): install
  only with gdn_layer installed, or mlx-lm's own block (separate projections) and the
  daemon's walks would round differently.
- MLP (Qwen3NextMLP, qwen3_5's dense MLP and qwen3_next's shared expert): the class is
  swapped to ``MergedMLP``, whose forward is mlx-lm's with gate and up as one matmul.

Numbers: each output is still one dot product over the same input row; whether its bits
equal the separate matmul's depends on the kernel (the invariant kernel's order is fixed by K
alone; MLX's may pick another tiling for another N). Either way every forward of the model
uses the merged form, and the start-up probes test the model so merged (their verdicts are
keyed by ``LoadedModel.linears``).
This module imports nothing of the engine but the kernels' forward.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_next
from mlx_lm.models.activations import swiglu

from .gdn_layer import layers as gdn_layers

GDN_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
MLP_PROJECTIONS = ("gate_proj", "up_proj")
_ARRAYS = ("weight", "scales", "biases", "bias")


def refusal(layers: list[nn.Module]) -> str | None:
    """Why these layers cannot be one matmul (None: they can): one plain class (not yet swapped
    to another kernel's), one input width, one quantization, biases alike."""
    cls = type(layers[0])
    if cls not in (nn.Linear, nn.QuantizedLinear):
        return f"{cls.__name__} is not a plain Linear or QuantizedLinear"
    keys = [sorted(k for k in _ARRAYS if k in m) for m in layers]
    for m, k in zip(layers, keys):
        if type(m) is not cls:
            return "the layers are of different classes"
        if k != keys[0]:
            return "the layers carry different arrays (bias, scales)"
        if cls is nn.QuantizedLinear and (m.group_size, m.bits, getattr(m, "mode", "affine")) != (
                layers[0].group_size, layers[0].bits, getattr(layers[0], "mode", "affine")):
            return "the layers are quantized differently"
        if m["weight"].shape[1:] != layers[0]["weight"].shape[1:]:
            return "the layers read inputs of different widths"
    return None


def merge(layers: list[nn.Module]) -> tuple[nn.Module, list[int]]:
    """One layer computing ``layers``' outputs side by side, and the split points of its
    output; each of ``layers`` is left holding views of the merged arrays. The caller checked
    ``refusal``."""
    merged = copy.copy(layers[0])
    for key in _ARRAYS:
        if key not in layers[0]:
            continue
        whole = mx.concatenate([m[key] for m in layers], axis=0)
        mx.eval(whole)
        merged[key] = whole
        start = 0
        for m in layers:
            n = m[key].shape[0]
            m[key] = whole[start:start + n]
            start += n
        mx.eval([m[key] for m in layers])
    ends, total = [], 0
    for m in layers[:-1]:
        total += m["weight"].shape[0]
        ends.append(total)
    return merged, ends


class MergedMLP(qwen3_next.Qwen3NextMLP):
    """mlx-lm's Qwen3NextMLP with gate_proj and up_proj as one matmul (``gate_up_proj``)."""

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = mx.split(self.gate_up_proj(x), self._gate_up_splits, axis=-1)
        return self.down_proj(swiglu(gate, up))


def _mlps(text_module) -> list[nn.Module]:
    return [m for _, m in text_module.named_modules() if type(m) in (qwen3_next.Qwen3NextMLP, MergedMLP)]


def install(text_module) -> int:
    """Merge every GatedDeltaNet layer's input projections (qwen3_5 layout) and every MLP's
    gate and up, in place; returns how many groups. Groups that ``refusal`` turns down keep
    their separate matmuls. Before any kernel swap and before the compiled step is traced."""
    n = 0
    for attn in gdn_layers(text_module):
        if "in_proj_merged" in attn or not all(p in attn for p in GDN_PROJECTIONS):
            continue  # qwen3_next's layout is two projections already
        group = [attn[p] for p in GDN_PROJECTIONS]
        if refusal(group) is None:
            merged, ends = merge(group)
            attn.in_proj_merged, attn._in_proj_splits = merged, tuple(ends)
            n += 1
    for mlp in _mlps(text_module):
        if type(mlp) is MergedMLP:
            continue
        group = [mlp[p] for p in MLP_PROJECTIONS]
        if refusal(group) is None:
            merged, ends = merge(group)
            mlp.gate_up_proj, mlp._gate_up_splits = merged, tuple(ends)
            mlp.__class__ = MergedMLP
            n += 1
    return n


def uninstall(text_module) -> None:
    """Drop the merged layers (the originals keep their views: same weights, same memory)."""
    for attn in gdn_layers(text_module):
        if "in_proj_merged" in attn:
            del attn["in_proj_merged"]
    for mlp in _mlps(text_module):
        if type(mlp) is MergedMLP:
            del mlp["gate_up_proj"]
            mlp.__class__ = qwen3_next.Qwen3NextMLP


def installed(text_module) -> int:
    """How many merged groups the model holds."""
    return (sum("in_proj_merged" in a for a in gdn_layers(text_module))
            + sum(type(m) is MergedMLP for m in _mlps(text_module)))
