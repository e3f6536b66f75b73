"""One forward over several groups of rows with their own caches and query lengths: a step that
carries the decoding rows' next positions and a prompt's piece together, so a long prefill
rides along with the streams instead of stalling them.

A group is (tokens [B, T], cache): the continuous batch's rows at T = 1 with their merged
batch caches, a prompt's piece at B = 1, T = L with its plain cache, or any other. Each layer
runs its dense parts once over every group's positions flattened into one [1, N, D] row (the
norms, the projections, the MLP: each weight read once for all of them) and its mixer per
group (attention against the group's KV cache with its own mask and rope offsets; the
GatedDeltaNet conv and recurrence from the group's own state), op for op as mlx-lm's
qwen3_5 / qwen3_next blocks compute them (``forward.gdn_projections`` and the code it copies).

Exactness: the mixers are mlx-lm's ops on the group's own tensors; the dense parts see the
group's rows inside a taller matrix. Where the backend's matmul rounds a row the same at any
height (this CPU's: batch.batch_matches_serial) a group's hidden states are bit-identical to
its own forward; elsewhere they are not, and ``mixed_matches_alone`` says which (a probe the
caller runs once, as the batch's is run).
"""

from __future__ import annotations

import copy
import random
import time
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask, create_ssm_mask, scaled_dot_product_attention

from ..kernels.forward import attention_projections, backbone_layers, gdn_mix, gdn_projections
from ..pieces import pause
from .cost_pairs import paired_median
from .prefill import prefill


@dataclass
class Ride:
    """A prompt's piece carried by a decode forward (``hidden_with``): its tokens [1, L] and
    its plain cache, which the forward advances by L; ``hidden`` [1, L, H] (lazy) once a
    forward carried it, None while none has."""
    tokens: mx.array
    cache: list
    hidden: mx.array | None = None


def hidden_with(lm, tokens: mx.array, cache: list, ride: Ride | None) -> mx.array:
    """``lm.hidden(tokens, cache)``, carrying ``ride``'s piece in the same forward when given."""
    if ride is None:
        return lm.hidden(tokens, cache)
    h, ride.hidden = mixed_hidden(lm, [(tokens, cache), (ride.tokens, ride.cache)])
    return h


def _attention(attn: nn.Module, x: mx.array, sizes: list[tuple[int, int]], masks: list, caches: list) -> mx.array:
    """mlx-lm's gated attention (Qwen3NextAttention) over the flattened groups: projections
    once, rope / cache / attention per group, the output projection once."""
    q_all, k_all, v_all = attention_projections(attn, x)
    outs, start = [], 0
    for (B, L), mask, cache in zip(sizes, masks, caches):
        n = B * L
        queries, gate = mx.split(q_all[:, start:start + n].reshape(B, L, attn.num_attention_heads, -1), 2, axis=-1)
        gate = gate.reshape(B, L, -1)
        keys, values = k_all[:, start:start + n], v_all[:, start:start + n]
        queries = attn.q_norm(queries).transpose(0, 2, 1, 3)
        keys = attn.k_norm(keys.reshape(B, L, attn.num_key_value_heads, -1)).transpose(0, 2, 1, 3)
        values = values.reshape(B, L, attn.num_key_value_heads, -1).transpose(0, 2, 1, 3)
        queries = attn.rope(queries, offset=cache.offset)
        keys = attn.rope(keys, offset=cache.offset)
        keys, values = cache.update_and_fetch(keys, values)
        if hasattr(attn, "attend"):  # the invariant attention (invariant.py): the kernel its own forward picks
            out = attn.attend(queries, keys, values, cache, mask)
        else:
            out = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=attn.scale, mask=mask)
        outs.append((out.transpose(0, 2, 1, 3).reshape(B, L, -1) * mx.sigmoid(gate)).reshape(1, n, -1))
        start += n
    return attn.o_proj(mx.concatenate(outs, axis=1))


def _gdn(attn: nn.Module, x: mx.array, sizes: list[tuple[int, int]], masks: list, caches: list) -> mx.array:
    """mlx-lm's GatedDeltaNet over the flattened groups: projections once, conv and
    recurrence per group from its own state, the gated norm and output projection once."""
    qkv_all, z_all, b_all, a_all = gdn_projections(attn, x)
    outs, start = [], 0
    for (B, L), mask, cache in zip(sizes, masks, caches):
        n = B * L
        qkv = qkv_all[:, start:start + n].reshape(B, L, -1)
        b = b_all[:, start:start + n].reshape(B, L, -1)
        a = a_all[:, start:start + n].reshape(B, L, -1)
        out = gdn_mix(attn, qkv, a, b, mask, cache)
        outs.append(out.reshape(1, n, *out.shape[2:]))
        start += n
    out = attn.norm(mx.concatenate(outs, axis=1), z_all)
    return attn.out_proj(out.reshape(1, x.shape[1], -1))


def mixed_hidden(lm, groups: list[tuple[mx.array, list]]) -> list[mx.array]:
    """Final-normed hidden states [B, T, H] for each (tokens [B, T], cache) group, from one
    walk over the backbone. Each group's cache advances by T as its own forward would."""
    if not groups:
        raise ValueError("a mixed forward needs at least one group")
    if getattr(lm.text_module, "sharding_group", None) is not None:
        raise ValueError("a mixed forward runs on one process (a tensor-parallel group's blocks sum across ranks)")
    backbone = lm.backbone
    sizes = [tuple(tokens.shape) for tokens, _ in groups]
    hs = [backbone.embed_tokens(tokens) for tokens, _ in groups]
    fa = getattr(backbone, "fa_idx", None)
    ssm = getattr(backbone, "ssm_idx", None)
    fa_masks = [create_attention_mask(h, cache[fa]) if fa is not None else None for h, (_, cache) in zip(hs, groups)]
    ssm_masks = [create_ssm_mask(h, cache[ssm]) if ssm is not None else None for h, (_, cache) in zip(hs, groups)]
    x = mx.concatenate([h.reshape(1, -1, h.shape[-1]) for h in hs], axis=1)
    for i, layer in enumerate(backbone_layers(backbone)):
        caches = [cache[i] for _, cache in groups]
        normed = layer.input_layernorm(x)
        if layer.is_linear:
            r = _gdn(layer.linear_attn, normed, sizes, ssm_masks, caches)
        else:
            r = _attention(layer.self_attn, normed, sizes, fa_masks, caches)
        h = x + r
        x = h + layer.mlp(layer.post_attention_layernorm(h))
    x = backbone.norm(x)
    out, start = [], 0
    for B, L in sizes:
        out.append(x[:, start:start + B * L].reshape(B, L, -1))
        start += B * L
    return out


def cache_states(caches: list) -> list[mx.array]:
    """Every array the caches hold (their ``state``), flattened."""
    return [v for _, v in tree_flatten([c.state for c in caches]) if v is not None]


def _decoding_rows(lm, rows: int, lengths: tuple[int, ...], rng: random.Random) -> tuple[mx.array, list]:
    """``rows`` rows that prefilled random prompts of the given lengths (in turn, at random),
    merged as the continuous batch merges them (left-padded attention caches), with each
    row's next input token [rows, 1]: the probes' decoding group."""
    V = lm.text_args.vocab_size
    states = []
    for _ in range(rows):
        c = lm.make_cache()
        states.append((c, prefill(lm, [rng.randrange(V) for _ in range(rng.choice(lengths))], c)))
        pause()
    batch = [type(layer[0]).merge(list(layer)) for layer in zip(*[c for c, _ in states])]
    return mx.concatenate([last for _, last in states])[:, None], batch


def mixed_matches_alone(lm, rows: int = 3, pieces=(1, 6), seed: int = 0) -> bool:
    """True when a mixed forward leaves every group's hidden states and caches bit-identical
    to the group's own forward on this backend: ``rows`` decoding rows (prompts of different
    lengths, so their merged attention caches are left-padded) beside a prompt's piece of
    each length in ``pieces``, one resumed from a prefix and one fresh. The caller includes
    the longest piece it will carry (a chunk): the invariant kernels (invariant.py) take
    forwards up to a height and MLX's above it, which a short piece alone would not reach."""
    lm = lm.layer_kinds_view()  # what holds for one layer of each kind holds for the model
    rng = random.Random(seed)
    V = lm.text_args.vocab_size
    for L in pieces:
        groups = [_decoding_rows(lm, rows, (2, 9, 23), rng)]
        for prefix in (0, 13):
            c = lm.make_cache()
            if prefix:
                prefill(lm, [rng.randrange(V) for _ in range(prefix + 1)], c)
                pause()
            groups.append((mx.array([[rng.randrange(V) for _ in range(L)]], dtype=mx.uint32), c))
        mx.eval([g[0] for g in groups], [cache_states(c) for _, c in groups])
        mixed = [(tokens, copy.deepcopy(cache)) for tokens, cache in groups]
        alone = []
        for tokens, cache in groups:  # a forward a piece: a request arriving mid-check waits for one
            alone.append(lm.hidden(tokens, cache))
            mx.eval(alone[-1], cache_states(cache))
            pause()
        together = mixed_hidden(lm, mixed)
        mx.eval(together, [cache_states(c) for _, c in mixed])
        same = [mx.array_equal(a, b) for a, b in zip(alone, together)]
        for (_, a), (_, b) in zip(groups, mixed):
            same += [mx.array_equal(x, y) for x, y in zip(cache_states(a), cache_states(b))]
        equal = mx.all(mx.stack(same)).item()  # one wait for the device, not one an array
        pause()
        if not equal:
            return False
    return True


def mixed_cost_ratio(lm, rows: int, piece: int = 8, reps: int = 3, seed: int = 0) -> float:
    """What one forward carrying ``rows`` decoding rows and a ``piece``-token prompt piece
    costs, over the two forwards it replaces (the rows' step, then the piece's): the median
    of ``reps`` paired timings after one untimed run of each (first-use compiles). Near 1
    where a forward is compute-bound (this CPU: 0.96-1.06 at pieces of 4-32 tokens,
    bench/results/mixed_step_cpu.json); lower where launches dominate (a GPU)."""
    rng = random.Random(seed)
    V = lm.text_args.vocab_size

    toks, batch = _decoding_rows(lm, rows, (3, 9, 17), rng)
    piece_cache = lm.make_cache()
    prefill(lm, [rng.randrange(V) for _ in range(12)], piece_cache)
    ids = mx.array([[rng.randrange(V) for _ in range(piece)]], dtype=mx.uint32)
    mx.eval(toks, ids, cache_states(batch + piece_cache))

    def seconds(mixed: bool) -> float:
        b, pc = copy.deepcopy(batch), copy.deepcopy(piece_cache)
        t0 = time.perf_counter()
        if mixed:
            hd, hp = mixed_hidden(lm, [(toks, b), (ids, pc)])
            mx.eval(lm.logits(hd), hp, cache_states(b + pc))
        else:
            logits = lm.logits(lm.hidden(toks, b))
            mx.async_eval(logits, cache_states(b))
            hp = lm.hidden(ids, pc)
            mx.eval(logits, hp, cache_states(b + pc))
        return time.perf_counter() - t0

    return paired_median(lambda: seconds(True), lambda: seconds(False), reps)


def mixed_pays(ratio: float) -> bool:
    """Whether decode forwards should carry prompts' pieces at this cost ratio: only for a
    clear saving of a fifth. On this CPU the start-up timing read 0.91-1.04 (short caches)
    where the benchmark's long-cache iterations read 0.94-1.04: a nearer threshold would turn
    on for noise."""
    return ratio < 0.8
