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
- Gated attention (Qwen3NextAttention): q (with its gate), k and v as ``qkv_proj_merged``
  with ``_qkv_splits``; the class is swapped to ``MergedAttention``, whose forward is mlx-lm's
  with the projections from ``forward.attention_projections`` (as the invariant attention's
  and the mixed step's are). At the 27B shape k and v are 1,024 columns each, at the
  latency floor of a matmul call (~13 us on the H200 for ~1 us of bytes): 32 of a step's calls.

Numbers: each output is still one dot product over the same input row; whether its bits
equal the separate matmul's depends on the kernel (the invariant kernel's order is fixed by K
alone; MLX's may pick another tiling for another N). Either way every forward of the model
uses the merged form, and the start-up probes test the model so merged (their verdicts are
keyed by ``LoadedModel.linears``).
This module imports nothing of the engine but the kernels' forward and the GatedDeltaNet block.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_next
from mlx_lm.models.activations import swiglu

from .forward import attention_projections, with_residual
from .gdn_layer import layers as gdn_layers

GDN_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
MLP_PROJECTIONS = ("gate_proj", "up_proj")
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj")
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
        return self.down_proj(self._gated(x))

    def plus(self, x: mx.array, residual: mx.array) -> mx.array:
        """``residual + self(x)``, the add in the down projection's writes where it takes one."""
        return with_residual(self.down_proj, self._gated(x), residual)

    def _gated(self, x: mx.array) -> mx.array:
        gate, up = mx.split(self.gate_up_proj(x), self._gate_up_splits, axis=-1)
        return swiglu(gate, up)


class MergedAttention(qwen3_next.Qwen3NextAttention):
    """mlx-lm's gated attention (Qwen3NextAttention.__call__, op for op) with q, k and v from
    ``attention_projections`` (one matmul where merged) and the attention proper in ``attend``:
    MLX's fused kernel here, the invariant kernel in invariant.InvariantAttention. With
    ``residual``: ``residual`` + its output, the add in o_proj's writes where it takes one."""

    takes_residual = True

    def __call__(self, x: mx.array, mask=None, cache=None, residual: mx.array | None = None) -> mx.array:
        queries, keys, values, gate = self.project(x)
        output = self.attend_cached(queries, keys, values, cache, mask)
        return self.finish(output, gate, residual)

    # The forward in three parts, so that a compiled step can trace the first and the last (pure
    # functions of their inputs) around the middle, which writes the cache at a moving offset.
    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """queries, keys, values [B, H, L, D] before RoPE, and the output gate [B, L, H * D]."""
        B, L, D = x.shape
        q, keys, values = attention_projections(self, x)
        queries, gate = mx.split(q.reshape(B, L, self.num_attention_heads, -1), 2, axis=-1)
        gate = gate.reshape(B, L, -1)
        queries = self.q_norm(queries).transpose(0, 2, 1, 3)
        keys = self.k_norm(keys.reshape(B, L, self.num_key_value_heads, -1)).transpose(0, 2, 1, 3)
        values = values.reshape(B, L, self.num_key_value_heads, -1).transpose(0, 2, 1, 3)
        return queries, keys, values, gate

    def attend_cached(self, queries: mx.array, keys: mx.array, values: mx.array, cache, mask) -> mx.array:
        """RoPE at the cache's offset, the cache's update, the attention: [B, H, L, D]."""
        if cache is not None:
            queries = self.rope(queries, offset=cache.offset)
            keys = self.rope(keys, offset=cache.offset)
            keys, values = cache.update_and_fetch(keys, values)
        else:
            queries = self.rope(queries)
            keys = self.rope(keys)
        return self.attend(queries, keys, values, cache, mask)

    def finish(self, output: mx.array, gate: mx.array, residual: mx.array | None = None) -> mx.array:
        """The gated output projection (plus ``residual`` where given)."""
        B, _, L, _ = output.shape
        output = output.transpose(0, 2, 1, 3).reshape(B, L, -1) * mx.sigmoid(gate)
        return with_residual(self.o_proj, output, residual)

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, cache, mask) -> mx.array:
        """The attention proper for queries [B, H, L, D] (after rope and the cache update)."""
        return qwen3_next.scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale,
                                                       mask=mask)


def _attentions(text_module) -> list[nn.Module]:
    """Every gated attention layer (mlx-lm's class or a subclass: merged, invariant)."""
    return [m for _, m in text_module.named_modules() if isinstance(m, qwen3_next.Qwen3NextAttention)]


def _mlps(text_module) -> list[nn.Module]:
    return [m for _, m in text_module.named_modules() if type(m) in (qwen3_next.Qwen3NextMLP, MergedMLP)]


def install(text_module, *, attention: bool = True) -> int:
    """Merge every GatedDeltaNet layer's input projections (qwen3_5 layout), every MLP's gate
    and up and (``attention``) every gated attention's q, k and v, in place; returns how many
    groups. Groups that ``refusal`` turns down keep their separate matmuls. Before any kernel
    swap and before the compiled step is traced."""
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
    for attn in _attentions(text_module) if attention else []:
        if "qkv_proj_merged" in attn or not all(p in attn for p in ATTENTION_PROJECTIONS):
            continue
        group = [attn[p] for p in ATTENTION_PROJECTIONS]
        if refusal(group) is None:
            merged, ends = merge(group)
            attn.qkv_proj_merged, attn._qkv_splits = merged, tuple(ends)
            if type(attn) is qwen3_next.Qwen3NextAttention:
                attn.__class__ = MergedAttention
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
    for attn in _attentions(text_module):
        if "qkv_proj_merged" in attn:
            del attn["qkv_proj_merged"]
        if type(attn) is MergedAttention:
            attn.__class__ = qwen3_next.Qwen3NextAttention


def installed(text_module) -> int:
    """How many merged groups the model holds."""
    return (sum("in_proj_merged" in a for a in gdn_layers(text_module))
            + sum(type(m) is MergedMLP for m in _mlps(text_module))
            + sum("qkv_proj_merged" in a for a in _attentions(text_module)))
