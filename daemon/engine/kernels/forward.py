"""The backbone forwards speculation runs besides mlx-lm's own (``LoadedModel.hidden``).

One module holds every hand-written walk over a qwen3_5 / qwen3_next backbone, so the
op-for-op copies of mlx-lm's code live in one place:
- ``gdn_capture_forward``: mlx-lm's GatedDeltaNet block, op for op, plus the recurrent state
  after every token and the conv input (whose sliding window gives the conv state after every
  position). A pure function, so ``compiled.py`` can trace it.
- ``gdn_capture``: that block as a layer's linear attention, recording into ``rec``
  (``capture.capture_hidden`` walks the backbone with it: it takes a loaded model, so it
  lives above model.py, which imports this module through chunked_prefill.py).
- ``compiled_forward``: the same walk through ``compiled.CompiledDecode``'s traced layers,
  plain or capturing.
- ``gdn_mix``: the conv and recurrence every GatedDeltaNet forward of the daemon but the
  capture's runs: one kernel with the conv folded in where gdn_layer.py installed it, else the
  conv in mlx-lm's ops and ``gdn_recurrence``: the fused kernel where installed (capture then
  takes every token's state from one fused call), else mlx-lm's ``gated_delta_update``.

dtype discipline: the recurrent state is float32; what the capturing block returns to the
residual stream is in the activation dtype (the per-token readout is cast back, as in
mlx-lm's ops path), so a verify never promotes the residual stream to float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.gated_delta import _gated_delta_step_ops, compute_g, gated_delta_update, normalize_qk

# The decode step's residual adds written by the matmuls before them, where those take a residual
# (the routed quantized linears on CUDA: quant_mma's residual variant): the bits of the add apart,
# one kernel and one node fewer each (128 a 27B step). The compiled step's self-check compares
# this walk with mlx-lm's eager layers, which add apart. False: every add apart (an A/B arm).
FUSE_RESIDUAL = True


def with_residual(module: nn.Module, x: mx.array, residual: mx.array | None) -> mx.array:
    """``residual + module(x)`` for a linear layer or an MLP: one kernel where the module adds the
    residual as its (last) matmul writes (its ``plus``), else the add apart; ``module(x)`` where
    ``residual`` is None."""
    if residual is None:
        return module(x)
    plus = getattr(module, "plus", None) if FUSE_RESIDUAL else None
    return residual + module(x) if plus is None else plus(x, residual)


def mixer_plus(mixer: nn.Module, x: mx.array, mask: Any, cache: Any, residual: mx.array) -> mx.array:
    """``residual + mixer(x, mask, cache)`` for a layer's attention or GatedDeltaNet block, the
    add in its out projection's writes where the block takes a residual (``takes_residual``)."""
    if FUSE_RESIDUAL and getattr(mixer, "takes_residual", False):
        return mixer(x, mask, cache, residual=residual)
    return residual + mixer(x, mask, cache)


def decoder_layer(layer: nn.Module, x: mx.array, mask: Any, cache: Any) -> mx.array:
    """mlx-lm's qwen3_5 / qwen3_next DecoderLayer.__call__, h = x + mixer(norm(x)), then
    h + mlp(norm2(h)), with each add where ``mixer_plus`` and ``with_residual`` put it."""
    mixer = layer.linear_attn if layer.is_linear else layer.self_attn
    h = mixer_plus(mixer, layer.input_layernorm(x), mask, cache, x)
    return with_residual(layer.mlp, layer.post_attention_layernorm(h), h)


def gdn_output(attn: nn.Module, out: mx.array, residual: mx.array | None) -> mx.array:
    """A GatedDeltaNet block's out projection of its gated norm's output [B, S, Hv * Dv], summed
    over the tensor-parallel group as mlx-lm's block does, plus ``residual`` where given (in the
    matmul's writes where ``with_residual`` can: never after a group's sum)."""
    if getattr(attn, "sharding_group", None) is None:
        return with_residual(attn.out_proj, out, residual)
    out = mx.distributed.all_sum(attn.out_proj(out), group=attn.sharding_group)
    return out if residual is None else residual + out


def backbone_layers(backbone: nn.Module) -> list:
    return getattr(backbone, "pipeline_layers", backbone.layers)


def cache_arrays(cache: list) -> list[mx.array]:
    """Every array a cache holds, cut to its filled part (KV offsets), evaluated now: KV
    buffers are written in place later."""
    out = []
    for c in cache:
        if isinstance(c, ArraysCache):
            out += [mx.array(x) for x in c.cache if x is not None]
        else:  # KV: only the filled slots (a trim leaves stale ones past the offset)
            out += [mx.array(x[..., : c.offset, :]) for x in (c.keys, c.values) if x is not None]
    mx.eval(out)
    return out


@dataclass
class _Capture:
    cache: ArraysCache
    conv_input: mx.array  # [B, K-1+T, C]: conv state before the verify, then T new rows
    states: list  # recurrent state after each of the T tokens (float32)
    n_keep: int


def gdn_projections(attn: nn.Module, inputs: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """The GatedDeltaNet block's input projections, op for op as mlx-lm computes them, for
    qwen3_5 and qwen3_next layouts, or as one matmul where merged_linears.py merged them:
    (qkv [B, S, C], z [B, S, Hv, Dv], b, a)."""
    B, S, _ = inputs.shape
    if hasattr(attn, "in_proj_qkvz"):  # qwen3_next
        q, k, v, z, b, a = attn.fix_query_key_value_ordering(attn.in_proj_qkvz(inputs), attn.in_proj_ba(inputs))
        qkv = mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1)
    elif "in_proj_merged" in attn:  # qwen3_5, the four as one matmul (merged_linears.py)
        qkv, z, b, a = mx.split(attn.in_proj_merged(inputs), attn._in_proj_splits, axis=-1)
        z = z.reshape(B, S, attn.num_v_heads, attn.head_v_dim)
    else:  # qwen3_5
        qkv = attn.in_proj_qkv(inputs)
        z = attn.in_proj_z(inputs).reshape(B, S, attn.num_v_heads, attn.head_v_dim)
        b = attn.in_proj_b(inputs)
        a = attn.in_proj_a(inputs)
    return qkv, z, b, a


def attention_projections(attn: nn.Module, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """The gated attention's input projections (q with its gate, k, v), as mlx-lm computes them,
    or as one matmul where merged_linears.py merged them (``qkv_proj_merged``)."""
    if "qkv_proj_merged" in attn:
        q, k, v = mx.split(attn.qkv_proj_merged(x), attn._qkv_splits, axis=-1)
        return q, k, v
    return attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)


def gdn_conv_input(attn: nn.Module, qkv: mx.array, mask: Any, cache: ArraysCache | None) -> mx.array:
    """[conv state, new rows] for the depthwise conv, the cache's conv state advanced past
    them (per row by its length where the cache has lengths): mlx-lm's block, op for op."""
    conv_state = cache[0] if cache is not None else None
    if conv_state is None:
        conv_state = zero_conv_state(attn, qkv.shape[0], qkv.dtype)
    if mask is not None:
        qkv = mx.where(mask[..., None], qkv, 0)
    conv_input = mx.concatenate([conv_state, qkv], axis=1)
    if cache is not None:
        cache[0] = _conv_state_after(attn, conv_input, cache, qkv.shape[1])
    return conv_input


def zero_conv_state(attn: nn.Module, B: int, dtype) -> mx.array:
    return mx.zeros((B, attn.conv_kernel_size - 1, attn.conv_dim), dtype=dtype)


def _conv_state_after(attn: nn.Module, conv_input: mx.array, cache: ArraysCache, S: int) -> mx.array:
    """The conv state past the S new rows of ``conv_input``, per row by its length where the
    cache has lengths."""
    n_keep = attn.conv_kernel_size - 1
    if cache.lengths is not None:
        ends = mx.clip(cache.lengths, 0, S)
        positions = (ends[:, None] + mx.arange(n_keep))[..., None]
        return mx.take_along_axis(conv_input, positions, axis=1)
    return mx.contiguous(conv_input[:, -n_keep:, :])


def gdn_heads(attn: nn.Module) -> tuple[int, int, int, int]:
    """(key heads, key head dim, value heads, value head dim) of a GatedDeltaNet layer."""
    return attn.num_k_heads, attn.head_k_dim, attn.num_v_heads, attn.head_v_dim


def gdn_mix(attn: nn.Module, qkv: mx.array, a: mx.array, b: mx.array, mask: Any, cache: ArraysCache | None) -> mx.array:
    """The block's conv and recurrence over the projection's qkv, the cache (conv state,
    recurrent state, offset) advanced past the S new rows; y [B, S, Hv, Dv]. One kernel where
    gdn_layer.py folded the conv in (``fused_conv_recurrence``), else the conv in mlx-lm's
    ops and ``gdn_recurrence``. Every GatedDeltaNet forward but the capture's comes here."""
    B, S, _ = qkv.shape
    folded = getattr(attn, "fused_conv_recurrence", None)
    if folded is None:
        conv_input = gdn_conv_input(attn, qkv, mask, cache)
        q, k, v = gdn_conv_qkv(attn, conv_input, B, S)
        out, state = gdn_recurrence(attn, q, k, v, a, b, cache[1] if cache is not None else None, mask)
    else:
        conv_state = cache[0] if cache is not None else None
        if conv_state is None:
            conv_state = zero_conv_state(attn, B, qkv.dtype)
        out, state, conv_after = folded(qkv, conv_state, attn.conv1d.weight, a, b, attn.A_log, attn.dt_bias,
                                        cache[1] if cache is not None else None, mask, heads=gdn_heads(attn))
        if cache is not None and cache.lengths is not None:  # per-row ends: taken outside the kernel
            rows = mx.where(mask[..., None], qkv, 0) if mask is not None else qkv
            conv_after = _conv_state_after(attn, mx.concatenate([conv_state, rows], axis=1), cache, S)
        if cache is not None:
            cache[0] = conv_after
    if cache is not None:
        cache[1] = state
        cache.advance(S)
    return out


def gdn_recurrence(attn: nn.Module, q, k, v, a, b, state, mask=None) -> tuple[mx.array, mx.array]:
    """The layer's gated delta recurrence: the fused kernel where gdn_layer.install put the
    layer on it (``fused_recurrence``), else mlx-lm's ``gated_delta_update``. Every
    GatedDeltaNet forward of the daemon goes through here, so a model never mixes the two."""
    fused = getattr(attn, "fused_recurrence", None)
    if fused is not None:
        return fused(q, k, v, a, b, attn.A_log, attn.dt_bias, state, mask)
    return gated_delta_update(q, k, v, a, b, attn.A_log, attn.dt_bias, state, mask, use_kernel=not attn.training)


def gdn_conv_qkv(attn: nn.Module, conv_input: mx.array, B: int, S: int) -> tuple[mx.array, mx.array, mx.array]:
    """SiLU(conv) over [conv state, new rows], split into q, k, v heads for the last S
    positions, q and k normalized: mlx-lm's order of ops."""
    conv_out = nn.silu(attn.conv1d(conv_input))
    q, k, v = [
        t.reshape(B, S, h, d)
        for t, h, d in zip(
            mx.split(conv_out, [attn.key_dim, 2 * attn.key_dim], -1),
            [attn.num_k_heads, attn.num_k_heads, attn.num_v_heads],
            [attn.head_k_dim, attn.head_k_dim, attn.head_v_dim],
        )
    ]
    return (*normalize_qk(q, k, inv_scale=attn.head_k_dim**-0.5, eps=1e-6), v)


def gdn_capture_forward(attn: nn.Module, inputs: mx.array, conv_state: mx.array, state: mx.array,
                        residual: mx.array | None = None):
    """mlx-lm's GatedDeltaNet.__call__ (qwen3_5 and qwen3_next projections), op for op,
    plus the per-token states, as a pure function (so it can be compiled). Matches mlx-lm's
    ops path (CPU, CUDA) bit for bit, or the folded kernel's decode step where gdn_layer.py
    installed it. Returns (output, conv_input, per-token states); with ``residual``, the output
    is ``residual`` + the block's (``gdn_output``)."""
    B, S, _ = inputs.shape
    qkv, z, b, a = gdn_projections(attn, inputs)
    conv_input = mx.concatenate([conv_state, qkv], axis=1)
    folded = getattr(attn, "fused_conv_recurrence", None)
    if folded is not None:
        out, _, every, _ = folded(qkv, conv_state, attn.conv1d.weight, a, b, attn.A_log, attn.dt_bias, state, None,
                                  heads=gdn_heads(attn), all_states=True)
        states = [every[:, t] for t in range(S)]
    else:
        q, k, v = gdn_conv_qkv(attn, conv_input, B, S)
        out, states = _recurrence_with_states(attn, q, k, v, a, b, state)
    return gdn_output(attn, attn.norm(out, z).reshape(B, S, -1), residual), conv_input, states


def _recurrence_with_states(attn: nn.Module, q, k, v, a, b, state) -> tuple[mx.array, list]:
    """(y [B, S, Hv, Dv], the state after each of the S tokens): one fused call where the
    layer is on the kernel (its per-token states are a decode step's bits), else
    gated_delta_update -> gated_delta_ops, keeping every intermediate state."""
    fused = getattr(attn, "fused_recurrence", None)
    if fused is not None:
        out, _, every = fused(q, k, v, a, b, attn.A_log, attn.dt_bias, state, None, all_states=True)
        return out, [every[:, t] for t in range(q.shape[1])]
    beta = mx.sigmoid(b)
    g = compute_g(attn.A_log, a, attn.dt_bias)
    if (rf := attn.num_v_heads // attn.num_k_heads) > 1:
        q = mx.repeat(q, rf, -2)
        k = mx.repeat(k, rf, -2)
    ys, states = [], []
    for t in range(q.shape[1]):
        y, state = _gated_delta_step_ops(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state, None)
        ys.append(y)
        states.append(state)
    return mx.stack(ys, axis=1), states  # y is cast to q's dtype inside the step: no float32 leak


def initial_states(attn: nn.Module, cache: ArraysCache, B: int, dtype) -> tuple[mx.array, mx.array]:
    """The layer's (conv state, recurrent state), zeros where the cache has none yet."""
    conv_state, state = cache[0], cache[1]
    if conv_state is None:
        conv_state = zero_conv_state(attn, B, dtype)
    if state is None:
        state = mx.zeros((B, attn.num_v_heads, attn.head_v_dim, attn.head_k_dim), dtype=mx.float32)
    return conv_state, state


def record_capture(attn: nn.Module, cache: ArraysCache, conv_input: mx.array, states: list, rec: list) -> None:
    """Advance the layer's cache past the whole verify and keep what commit() needs."""
    n_keep = attn.conv_kernel_size - 1
    cache[0] = mx.contiguous(conv_input[:, -n_keep:, :])
    cache[1] = states[-1]
    cache.advance(len(states))
    rec.append(_Capture(cache, conv_input, states, n_keep))


def gdn_capture(attn: nn.Module, inputs: mx.array, mask: Any, cache: ArraysCache, rec: list) -> mx.array:
    if mask is not None:
        raise ValueError("capture runs unpadded sequences only")
    conv_state, state = initial_states(attn, cache, inputs.shape[0], inputs.dtype)
    out, conv_input, states = gdn_capture_forward(attn, inputs, conv_state, state)
    record_capture(attn, cache, conv_input, states, rec)
    return out


def compiled_forward(compiled, tokens: mx.array, cache: list, rec: list | None) -> mx.array:
    """The same walk with ``compiled``'s traced layers (a ``compiled.CompiledDecode`` that
    ``applies`` to this forward): linear layers whole, attention traced but for its middle
    (``attention_parts``) or eager up to its traced tail. With ``rec``, the capturing variant, recorded as ``capture.capture_hidden`` records."""
    h = compiled.backbone.embed_tokens(tokens)
    fa_mask = create_attention_mask(h, cache[compiled.fa_idx]) if compiled.fa_idx is not None else None
    for i, (layer, c) in enumerate(zip(compiled.layers, cache)):
        if not layer.is_linear:
            parts = compiled.attention_parts[i]
            if parts is None:
                h = mixer_plus(layer.self_attn, layer.input_layernorm(h), fa_mask, c, h)
                h = compiled.steps[i](h)
            else:  # traced around the eager middle
                queries, keys, values, gate = parts[0](h)
                h = parts[1](h, layer.self_attn.attend_cached(queries, keys, values, c, fa_mask), gate)
        elif rec is None:
            h, c[0], c[1] = compiled.steps[i](h, c[0], c[1])
            c.advance(tokens.shape[1])
        else:
            h, conv_input, *states = compiled.capture_steps[i](h, c[0], c[1])
            record_capture(layer.linear_attn, c, conv_input, states, rec)
    return compiled.norm(h)
