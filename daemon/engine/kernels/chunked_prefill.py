"""Prompt prefill with the GatedDeltaNet recurrence in chunked (WY / UT-transform) form.

Why: off Metal, mlx-lm runs the gated delta rule one token at a time (``gated_delta_ops``:
~10 kernels per token per layer), so a 2,048-token prompt is 20,000 small ops per layer.
The chunked form of flash-linear-attention's ``chunk_gated_delta_rule`` does the same
algebra as a few batched matmuls per chunk of ``CHUNK`` tokens; only the hand-off of the
state from one chunk to the next stays sequential (T / CHUNK steps of three matmuls).

The recurrence (mlx-lm's convention: state S is [Dv, Dk], g the decay, beta the write gate):

    S_t = g_t S_{t-1} + beta_t (v_t - g_t S_{t-1} k_t) k_t^T,     y_t = S_t q_t

Inside a chunk starting from state S0, with G_t = g_1 ... g_t (cumulative decay) and
u_t = beta_t (v_t - g_t S_{t-1} k_t) (the "delta" actually written at step t):

    u_t = beta_t v_t - beta_t G_t S0 k_t - sum_{j<t} beta_t (G_t / G_j) (k_t . k_j) u_j
    => (I + A) U = diag(beta) V - diag(beta G) K S0^T,  A_tj = beta_t (G_t/G_j) k_t.k_j (j<t)
    => U = Tinv diag(beta) V - Tinv diag(beta G) K S0^T = U' - W S0^T,  Tinv = (I + A)^-1
    Y = diag(G) Q S0^T + (Q K^T * D) U,      D_tj = G_t / G_j for j <= t, else 0
    S_end = G_C S0 + U^T diag(G_C / G) K

Numerics: everything runs in float32 (the recurrent state's dtype; mlx-lm's ops path also
promotes to float32), decay ratios are formed as exp of differences of cumulative log
decays (never G_t / G_j, which underflows), and Tinv is built by exact block doubling
(inv [[A, 0], [B, D]] = [[A^-1, 0], [-D^-1 B A^-1, D^-1]]), not by a power series, which
cancels catastrophically when keys are alike. The result is the token-by-token one up to
float32 rounding in a different order; ``tests/daemon/test_chunked_prefill.py`` states the
tolerance on outputs and final states and checks greedy continuations after the prefill.
(On CUDA, MLX runs float32 matmuls in TF32 unless ``MLX_ENABLE_TF32=0``: there the state
differs from the token loop's by ~4e-4 relative, outputs by one bf16 ulp on ~5% of them.)

Where: on by default on a GPU without Metal (``default_enabled``); elsewhere on request
(``load_model(..., chunked_prefill=True)`` or ``lm.chunked_prefill = True``).
Scope: prefill only (``prefill_hidden``). Decode steps and speculative verifies keep
mlx-lm's token-by-token path (or the compiled one), which the exactness probe and the
fidelity gate govern; serial and speculative decode both prefill through here, so the
caches they start from are the same. Several prompts' pieces of one length may go through
in one forward (batched_prefill.py: rows' attention caches merged, left-padded; their
GatedDeltaNet states stacked, unpadded).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, BatchKVCache

from .forward import backbone_layers, gdn_conv_qkv, gdn_projections

CHUNK = 64
# Shorter forwards gain nothing from chunking (and speculative verifies are never prefill).
MIN_T = 2 * CHUNK


def unit_lower_inverse(m: mx.array) -> mx.array:
    """Inverse of unit lower-triangular matrices [..., C, C] (C a power of two), by block
    doubling: the inverses of the diagonal blocks of size s give those of size 2s."""
    C = m.shape[-1]
    lead = m.shape[:-2]
    inv = mx.ones((*lead, C, 1, 1), dtype=m.dtype)  # the 1x1 diagonal blocks of a unit matrix
    s = 1
    while s < C:
        n = C // (2 * s)
        # the n diagonal blocks of size 2s: [..., n, 2s, 2s]
        blocks = mx.moveaxis(mx.diagonal(m.reshape(*lead, n, 2 * s, n, 2 * s), axis1=-4, axis2=-2), -1, -3)
        lower_left = blocks[..., s:, :s]
        a_inv, d_inv = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        ll = -(d_inv @ (lower_left @ a_inv))
        top = mx.concatenate([a_inv, mx.zeros_like(a_inv)], axis=-1)
        bottom = mx.concatenate([ll, d_inv], axis=-1)
        inv = mx.concatenate([top, bottom], axis=-2)
        s *= 2
    return inv.reshape(*lead, C, C)


def chunk_gated_delta(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    log_g: mx.array,
    beta: mx.array,
    state: mx.array,
    chunk: int = CHUNK,
) -> tuple[mx.array, mx.array]:
    """The gated delta rule over a whole sequence, chunked.

    Shapes (as mlx-lm's ``gated_delta_ops``, scalar gating): q, k [B, T, Hk, Dk] (already
    normalized, q carrying the readout scale); v [B, T, Hv, Dv]; log_g [B, T, Hv] (log of
    the decay g); beta [B, T, Hv]; state [B, Hv, Dv, Dk] float32.
    Returns y [B, T, Hv, Dv] in q's dtype, and the final state (float32)."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    rep = Hv // Hk
    C = chunk
    N = -(-T // C)
    pad = N * C - T
    f32 = mx.float32

    def heads_first(x: mx.array, h: int, r: int) -> mx.array:
        # [B, T, H, D] -> [N, B, h, r, C, D]: chunk index first so each chunk is contiguous
        if pad:
            x = mx.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.astype(f32).reshape(B, N, C, h, r, -1)
        return x.transpose(1, 0, 3, 4, 2, 5)

    # Padding at the end is inert: k = 0 and beta = 0 write nothing, log_g = 0 keeps the state.
    qc = heads_first(q, Hk, 1)  # [N, B, Hk, 1, C, Dk]
    kc = heads_first(k, Hk, 1)
    vc = heads_first(v, Hk, rep)  # [N, B, Hk, rep, C, Dv]
    lg = heads_first(log_g[..., None], Hk, rep)[..., 0]  # [N, B, Hk, rep, C]
    bc = heads_first(beta[..., None], Hk, rep)[..., 0]

    cum = mx.cumsum(lg, axis=-1)  # log G_t within the chunk
    idx = mx.arange(C)
    incl = idx[:, None] >= idx[None, :]
    strict = idx[:, None] > idx[None, :]
    diff = cum[..., :, None] - cum[..., None, :]  # log (G_t / G_j)
    decay_incl = mx.exp(mx.where(incl, diff, -mx.inf))
    decay_strict = mx.where(strict, decay_incl, 0.0)

    kT = kc.swapaxes(-1, -2)
    kk = kc @ kT  # [N, B, Hk, 1, C, C]
    qk = qc @ kT
    a = bc[..., :, None] * kk * decay_strict  # [N, B, Hk, rep, C, C]
    t_inv = unit_lower_inverse(a + mx.eye(C, dtype=f32))
    g_in = mx.exp(cum)  # G_t
    w = t_inv @ ((bc * g_in)[..., None] * kc)  # [.., C, Dk]
    u_prime = t_inv @ (bc[..., None] * vc)  # [.., C, Dv]
    p = qk * decay_incl  # [.., C, C]
    q_decayed = g_in[..., None] * qc  # [.., C, Dk]
    g_end = mx.exp(cum[..., -1])  # G_C
    k_to_end = mx.exp(cum[..., -1:] - cum)[..., None] * kc  # (G_C / G_j) k_j

    s = state.astype(f32).reshape(B, Hk, rep, Dv, Dk)
    us, starts = [], []
    for n in range(N):  # the only sequential part: hand the state from chunk to chunk
        starts.append(s)
        u = u_prime[n] - w[n] @ s.swapaxes(-1, -2)  # [B, Hk, rep, C, Dv]
        us.append(u)
        s = g_end[n][..., None, None] * s + u.swapaxes(-1, -2) @ k_to_end[n]
    u_all = mx.stack(us)  # [N, B, Hk, rep, C, Dv]
    s_all = mx.stack(starts)  # [N, B, Hk, rep, Dv, Dk]
    y = q_decayed @ s_all.swapaxes(-1, -2) + p @ u_all  # [N, B, Hk, rep, C, Dv]
    y = y.transpose(1, 0, 4, 2, 3, 5).reshape(B, N * C, Hv, Dv)[:, :T]
    return y.astype(q.dtype), s.reshape(B, Hv, Dv, Dk)


# -- the GatedDeltaNet layer and the backbone, for prefill ------------------------------------


def gdn_prefill_forward(attn: nn.Module, inputs: mx.array, cache: ArraysCache, chunk: int = CHUNK) -> mx.array:
    """mlx-lm's GatedDeltaNet.__call__ (qwen3_5 and qwen3_next projections) for unpadded
    rows (B >= 1, each writing all S tokens) with a cache, with the recurrence chunked.
    Updates ``cache``."""
    B, S, _ = inputs.shape
    qkv, z, b, a = gdn_projections(attn, inputs)
    conv_state = cache[0]
    if conv_state is None:
        conv_state = mx.zeros((B, attn.conv_kernel_size - 1, attn.conv_dim), dtype=inputs.dtype)
    conv_input = mx.concatenate([conv_state, qkv], axis=1)
    cache[0] = mx.contiguous(conv_input[:, -(attn.conv_kernel_size - 1) :, :])
    q, k, v = gdn_conv_qkv(attn, conv_input, B, S)

    beta = mx.sigmoid(b)
    # log of mlx-lm's compute_g (g = exp(-exp(A_log) * softplus(a + dt_bias))), taken
    # directly so that a decay that underflows to 0 in g stays finite here.
    log_g = -mx.exp(attn.A_log.astype(mx.float32)) * nn.softplus(a + attn.dt_bias)
    state = cache[1]
    if state is None:
        state = mx.zeros((B, attn.num_v_heads, attn.head_v_dim, attn.head_k_dim), dtype=mx.float32)
    out, state = chunk_gated_delta(q, k, v, log_g, beta, state, chunk)
    cache[1] = state
    cache.advance(S)
    out = attn.norm(out, z)
    return attn.out_proj(out.reshape(B, S, -1))


def applies(lm, tokens: mx.array, cache: list | None) -> bool:
    """A prompt chunk this path handles: rows of at least MIN_T tokens through a qwen3_5 /
    qwen3_next backbone held on one process, linear layers unsharded, each GatedDeltaNet
    cache unpadded (every row writes all T tokens: no per-row lengths or left padding).
    One row: its plain caches. Several rows (batched_prefill.py): the attention layers hold
    batch caches of that many rows (BatchKVCache), whose masks carry each row's left
    padding; the chunked recurrence itself takes any batch."""
    bb = lm.backbone
    if cache is None or tokens.ndim != 2 or tokens.shape[1] < MIN_T:
        return False
    if not lm.supports_mtp or getattr(bb, "pipeline_size", 1) > 1:
        return False
    layers = backbone_layers(bb)
    if len(cache) != len(layers):
        return False
    B = tokens.shape[0]
    for layer, c in zip(layers, cache):
        if layer.is_linear:
            attn = layer.linear_attn
            if not isinstance(c, ArraysCache) or c.lengths is not None or c.left_padding is not None:
                return False
            if getattr(attn, "sharding_group", None) is not None:
                return False
            if B > 1 and any(x is not None and x.shape[0] != B for x in c.cache):
                return False
        elif B > 1 and not (isinstance(c, BatchKVCache) and c.offset.shape[0] == B):
            return False
    return True


def prefill_hidden(lm, tokens: mx.array, cache: list, chunk: int = CHUNK) -> mx.array:
    """The backbone forward of mlx-lm's qwen3_5 / qwen3_next (DecoderLayer: h = x +
    mixer(norm(x)); h + mlp(norm2(h))) with chunked GatedDeltaNet layers; final-normed
    hidden states [B, T, H]. The caller checked ``applies``. The attention layers take the
    mask of their cache: causal for one row, the batch cache's left-padded one for several."""
    from mlx_lm.models.base import create_attention_mask

    bb = lm.backbone
    h = bb.embed_tokens(tokens)
    fa_mask = create_attention_mask(h, cache[bb.fa_idx]) if bb.fa_idx is not None else None
    for layer, c in zip(backbone_layers(bb), cache):
        if layer.is_linear:
            r = gdn_prefill_forward(layer.linear_attn, layer.input_layernorm(h), c, chunk)
        else:
            r = layer.self_attn(layer.input_layernorm(h), fa_mask, c)
        h = h + r
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return bb.norm(h)


def default_enabled() -> bool:
    """Chunk on a GPU without Metal (CUDA), where it was measured: 27B-shaped prefill of
    2,048 tokens 19.6x faster on the H200 (bench/results/README.md). Not on Metal (mlx-lm's
    fused kernel runs there) and not on the CPU: the Linux ``mlx[cpu]`` wheel's matmuls go
    through reference BLAS (~2 GFLOP/s here), where the chunked form's extra matmul work
    costs what the token loop's dispatch does (0.95x measured on this machine)."""
    return mx.default_device() == mx.gpu and not mx.metal.is_available()
