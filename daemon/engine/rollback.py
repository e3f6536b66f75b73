"""Sound rollback of a hybrid model's cache after a partially accepted verify.

Layers are of two kinds:
- gated full attention: ``KVCache``, trimmable (``trim(n)`` just lowers ``offset``; later
  writes overwrite the stale slots);
- GatedDeltaNet: ``ArraysCache`` holding [conv_state, recurrent_state]. Not trimmable: a
  recurrent state cannot be un-applied.

Two strategies, same interface (``forward`` the verify tokens, then ``commit(keep)`` to
leave exactly the first ``keep`` of them in the cache):

- ``SnapshotRollback`` ("snapshot"): before the verify, keep references to every
  ArraysCache's arrays (MLX arrays are immutable and the GDN layer rebinds its slots, so a
  reference *is* a snapshot, at no cost) and each KVCache's offset. On a partial accept,
  rebind the references, trim the KVs, and re-forward the accepted prefix.
- ``CaptureRollback`` ("capture"): run the verify through a capturing variant of the
  GatedDeltaNet forward that keeps the conv input (whose sliding window gives the conv state
  after every position) and the recurrent state after every token. Commit the state at
  the last kept index; no re-forward.

The model's position is read from an attention layer's ``KVCache.offset``
(``attention_offset``), never from a linear layer's cache slot.

dtype discipline: the recurrent state is float32; what the capturing GDN block returns to
the residual stream is in the activation dtype (the per-token readout is cast back, as in
mlx-lm's ops path), so verify never promotes the residual stream to float32.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache

from .model import LoadedModel

STRATEGIES = ("capture", "snapshot")


def attention_offset(cache: list) -> int:
    """The model's position: the offset of the first attention layer's KVCache."""
    for c in cache:
        if isinstance(c, KVCache) or (hasattr(c, "offset") and not isinstance(c, ArraysCache)):
            return c.offset
    raise ValueError("no attention layer in this cache: the position is unknown")


def _layers(backbone: nn.Module) -> list:
    return getattr(backbone, "pipeline_layers", backbone.layers)


@dataclass
class Snapshot:
    arrays: list[tuple[ArraysCache, list]] = field(default_factory=list)
    offsets: list[tuple[Any, int]] = field(default_factory=list)

    @classmethod
    def take(cls, cache: list) -> "Snapshot":
        s = cls()
        for c in cache:
            if isinstance(c, ArraysCache):
                s.arrays.append((c, list(c.cache)))
            elif hasattr(c, "offset"):
                s.offsets.append((c, c.offset))
            else:  # pragma: no cover - unknown cache kinds are refused up front
                raise TypeError(f"cannot snapshot a {type(c).__name__}")
        return s

    def restore(self) -> None:
        for c, arrays in self.arrays:
            c.cache = list(arrays)
        for c, off in self.offsets:
            c.trim(c.offset - off)


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


def check_cache(cache: list) -> None:
    for c in cache:
        if not isinstance(c, (ArraysCache, KVCache)):
            raise TypeError(f"speculation needs ArraysCache/KVCache layers, got {type(c).__name__}")
        if isinstance(c, ArraysCache) and (c.lengths is not None or c.left_padding is not None):
            raise ValueError("speculation runs one unpadded sequence per cache")


# -- the capturing GatedDeltaNet forward ------------------------------------------------------


@dataclass
class _Capture:
    cache: ArraysCache
    conv_input: mx.array  # [B, K-1+T, C]: conv state before the verify, then T new rows
    states: list  # recurrent state after each of the T tokens (float32)
    n_keep: int


def gdn_capture_forward(attn: nn.Module, inputs: mx.array, conv_state: mx.array, state: mx.array):
    """mlx-lm's GatedDeltaNet.__call__ (qwen3_5 and qwen3_next projections), op for op,
    plus the per-token states, as a pure function (so it can be compiled). Matches mlx-lm's
    ops path (CPU, CUDA) bit for bit. Returns (output, conv_input, per-token states)."""
    from mlx_lm.models.gated_delta import _gated_delta_step_ops, compute_g, normalize_qk

    B, S, _ = inputs.shape
    if hasattr(attn, "in_proj_qkvz"):  # qwen3_next
        q, k, v, z, b, a = attn.fix_query_key_value_ordering(attn.in_proj_qkvz(inputs), attn.in_proj_ba(inputs))
        qkv = mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1)
    else:  # qwen3_5
        qkv = attn.in_proj_qkv(inputs)
        z = attn.in_proj_z(inputs).reshape(B, S, attn.num_v_heads, attn.head_v_dim)
        b = attn.in_proj_b(inputs)
        a = attn.in_proj_a(inputs)

    conv_input = mx.concatenate([conv_state, qkv], axis=1)
    conv_out = nn.silu(attn.conv1d(conv_input))
    q, k, v = [
        t.reshape(B, S, h, d)
        for t, h, d in zip(
            mx.split(conv_out, [attn.key_dim, 2 * attn.key_dim], -1),
            [attn.num_k_heads, attn.num_k_heads, attn.num_v_heads],
            [attn.head_k_dim, attn.head_k_dim, attn.head_v_dim],
        )
    ]
    q, k = normalize_qk(q, k, inv_scale=attn.head_k_dim**-0.5, eps=1e-6)

    # gated_delta_update -> gated_delta_ops, keeping every intermediate state.
    beta = mx.sigmoid(b)
    g = compute_g(attn.A_log, a, attn.dt_bias)
    if (rf := attn.num_v_heads // attn.num_k_heads) > 1:
        q = mx.repeat(q, rf, -2)
        k = mx.repeat(k, rf, -2)
    ys, states = [], []
    for t in range(S):
        y, state = _gated_delta_step_ops(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state, None)
        ys.append(y)
        states.append(state)
    out = mx.stack(ys, axis=1)  # y is cast to q's dtype inside the step: no float32 leak
    out = attn.norm(out, z)
    return attn.out_proj(out.reshape(B, S, -1)), conv_input, states


def initial_states(attn: nn.Module, cache: ArraysCache, B: int, dtype) -> tuple[mx.array, mx.array]:
    """The layer's (conv state, recurrent state), zeros where the cache has none yet."""
    conv_state, state = cache[0], cache[1]
    if conv_state is None:
        conv_state = mx.zeros((B, attn.conv_kernel_size - 1, attn.conv_dim), dtype=dtype)
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


def _gdn_capture(attn: nn.Module, inputs: mx.array, mask: Any, cache: ArraysCache, rec: list) -> mx.array:
    if mask is not None:
        raise ValueError("capture runs unpadded sequences only")
    conv_state, state = initial_states(attn, cache, inputs.shape[0], inputs.dtype)
    out, conv_input, states = gdn_capture_forward(attn, inputs, conv_state, state)
    record_capture(attn, cache, conv_input, states, rec)
    return out


def capture_hidden(lm: LoadedModel, tokens: mx.array, cache: list, rec: list) -> mx.array:
    """``lm.hidden`` with capture: qwen3_5/qwen3_next backbone forward, op for op."""
    from mlx_lm.models.base import create_attention_mask, create_ssm_mask

    compiled = lm.compiled_decode
    if compiled is not None and compiled.applies(tokens, cache):
        return compiled.capture_hidden(tokens, cache, rec)
    bb = lm.backbone
    h = bb.embed_tokens(tokens)
    layers = _layers(bb)
    fa_mask = create_attention_mask(h, cache[bb.fa_idx]) if bb.fa_idx is not None else None
    ssm_mask = create_ssm_mask(h, cache[bb.ssm_idx]) if bb.ssm_idx is not None else None
    for layer, c in zip(layers, cache):
        if layer.is_linear:
            r = _gdn_capture(layer.linear_attn, layer.input_layernorm(h), ssm_mask, c, rec)
            h = h + r
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        else:
            h = layer(h, mask=fa_mask, cache=c)
    return bb.norm(h)


# -- strategies ----------------------------------------------------------------------------------


class SnapshotRollback:
    """(a) snapshot before verify; on partial accept restore and re-forward the prefix."""

    name = "snapshot"

    def __init__(self, lm: LoadedModel, cache: list):
        self.lm, self.cache = lm, cache
        self.tokens: mx.array | None = None
        self.snap: Snapshot | None = None
        self.refed = 0  # tokens re-forwarded so far (telemetry)

    def forward(self, tokens: mx.array) -> mx.array:
        """tokens [1, T] -> final-normed hidden [1, T, H]; the cache advances by T."""
        self.snap = Snapshot.take(self.cache)
        self.tokens = tokens
        return self.lm.hidden(tokens, self.cache)

    def commit(self, keep: int) -> None:
        """Leave exactly the first ``keep`` verify tokens in the cache."""
        tokens, snap = self.tokens, self.snap
        self.tokens = self.snap = None  # hold no stale state past the commit
        if keep == tokens.shape[1]:
            return
        snap.restore()
        if keep > 0:
            self.lm.hidden(tokens[:, :keep], self.cache)
            self.refed += keep


class CaptureRollback:
    """(b) per-token state capture during verify; commit the state at the last kept index."""

    name = "capture"

    def __init__(self, lm: LoadedModel, cache: list):
        self.lm, self.cache = lm, cache
        self.rec: list[_Capture] = []
        self.T = 0
        self.snap: Snapshot | None = None

    def forward(self, tokens: mx.array) -> mx.array:
        self.snap = Snapshot.take(self.cache)
        self.rec = []
        self.T = tokens.shape[1]
        return capture_hidden(self.lm, tokens, self.cache, self.rec)

    def commit(self, keep: int) -> None:
        rec, snap = self.rec, self.snap
        self.rec, self.snap = [], None  # hold no per-token states past the commit
        if keep == self.T:
            return
        if keep == 0:
            snap.restore()
            return
        for c, off in snap.offsets:
            c.trim(c.offset - (off + keep))
        for cap in rec:
            cap.cache[0] = mx.contiguous(cap.conv_input[:, keep : keep + cap.n_keep, :])
            cap.cache[1] = cap.states[keep - 1]


def make_rollback(strategy: str, lm: LoadedModel, cache: list):
    if strategy == "capture":
        return CaptureRollback(lm, cache)
    if strategy == "snapshot":
        return SnapshotRollback(lm, cache)
    raise ValueError(f"unknown rollback strategy {strategy!r} (one of {', '.join(STRATEGIES)})")
