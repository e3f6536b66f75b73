"""Chunked gated-delta prefill against mlx-lm's token-by-token recurrence (gated_delta_ops).

Stated numerics (measured on CPU; see chunked_prefill.py for why they differ at all):
- float32 inputs: outputs and final state agree with the token loop to REL_TOL (relative to
  the largest magnitude); measured 1e-7..4e-6, including a carried-in state, grouped heads,
  a length that is not a multiple of the chunk, decays that underflow, identical keys.
- bfloat16 inputs (the model's activations): every output within one bf16 ulp of the token
  loop's (the recurrence itself is float32 either way; only the final rounding can differ).
- the bundled bf16 model: greedy continuations after a chunked prefill equal those after the
  token-by-token prefill up to the first position where the reference's top-2 logit margin
  is within NEAR_TIE_ULPS ulps of its top logit (an argmax a one-ulp change may flip; the
  divergences seen were at margins of 0 and 1 ulp).
"""

from __future__ import annotations

import math
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.gated_delta import compute_g, gated_delta_ops, normalize_qk

from daemon.engine.kernels import chunked_prefill as cp
from daemon.measure.fidelity import load_prompts
from daemon.engine.model.loading import load_model
from daemon.engine.kernels.forward import cache_arrays
from daemon.engine.prefill.prefill import prefill

BUNDLED = Path(__file__).resolve().parents[2] / "daemon" / "assets" / "tiny-qwen35"
REL_TOL = 2e-5
NEAR_TIE_ULPS = 2
CONTINUATION = 32


def _inputs(T, Hk, Hv, D, dtype=mx.float32, a_shift=0.0, key_noise=1.0, b_shift=0.0, seed=0):
    mx.random.seed(seed)
    base = mx.random.normal((1, 1, Hk, D))
    q = mx.random.normal((1, T, Hk, D)).astype(dtype)
    k = (base + key_noise * mx.random.normal((1, T, Hk, D))).astype(dtype)
    v = mx.random.normal((1, T, Hv, D)).astype(dtype)
    q, k = normalize_qk(q, k, inv_scale=D**-0.5, eps=1e-6)
    a = (mx.random.normal((1, T, Hv)) + a_shift).astype(dtype)
    b = (mx.random.normal((1, T, Hv)) + b_shift).astype(dtype)
    A_log = mx.log(mx.random.uniform(0, 16, (Hv,)))
    dt_bias = mx.ones(Hv)
    g = compute_g(A_log, a, dt_bias)
    log_g = -mx.exp(A_log) * nn.softplus(a + dt_bias)
    state = 0.5 * mx.random.normal((1, Hv, D, D))
    return q, k, v, g, log_g, mx.sigmoid(b), state


@pytest.mark.quick
@pytest.mark.parametrize(
    "T,Hk,Hv,D,chunk,kw",
    [
        (200, 2, 4, 32, 64, {}),  # grouped heads, T not a multiple of the chunk
        (77, 1, 3, 16, 16, {"a_shift": 8.0}),  # decays that underflow to 0 in g
        (130, 2, 2, 32, 32, {"a_shift": -8.0, "key_noise": 0.0, "b_shift": 6.0}),  # identical keys, beta ~ 1
        (5, 2, 2, 16, 64, {}),  # shorter than one chunk
    ],
)
def test_chunked_matches_token_loop_float32(T, Hk, Hv, D, chunk, kw):
    q, k, v, g, log_g, beta, s0 = _inputs(T, Hk, Hv, D, **kw)
    y_ref, s_ref = gated_delta_ops(q, k, v, g, beta, s0)
    y, s = cp.chunk_gated_delta(q, k, v, log_g, beta, s0, chunk)
    assert y.shape == y_ref.shape and y.dtype == y_ref.dtype and s.shape == s_ref.shape
    assert not mx.isnan(y).any().item()
    for got, ref in ((y, y_ref), (s, s_ref)):
        err = mx.abs(got - ref).max().item()
        assert err <= REL_TOL * mx.abs(ref).max().item(), err


@pytest.mark.quick
def test_chunked_bf16_outputs_within_one_ulp():
    q, k, v, g, log_g, beta, s0 = _inputs(300, 2, 4, 64, dtype=mx.bfloat16)
    y_ref, s_ref = gated_delta_ops(q, k, v, g, beta, s0)
    y, s = cp.chunk_gated_delta(q, k, v, log_g, beta, s0)
    assert y.dtype == mx.bfloat16 and s.dtype == mx.float32
    ref32, got32 = y_ref.astype(mx.float32), y.astype(mx.float32)
    # one bf16 ulp at each element's magnitude: 2^(floor(log2|x|) - 7)
    mag = mx.maximum(mx.abs(ref32), mx.abs(got32))
    ulp = mx.power(2.0, mx.floor(mx.log2(mx.maximum(mag, 2.0**-126))) - 7)
    assert mx.all(mx.abs(got32 - ref32) <= ulp).item()
    assert mx.abs(s - s_ref).max().item() <= REL_TOL * mx.abs(s_ref).max().item()


@pytest.mark.quick
def test_unit_lower_inverse():
    mx.random.seed(3)
    m = mx.tril(0.1 * mx.random.normal((2, 3, 64, 64)), -1) + mx.eye(64)
    inv = cp.unit_lower_inverse(m)
    assert mx.abs(inv @ m - mx.eye(64)).max().item() < 1e-5
    assert mx.all(mx.triu(inv, 1) == 0).item()


@pytest.fixture(scope="module")
def lm():
    return load_model(BUNDLED)


def _greedy_after_prefill(lm, prompt, chunked, chunk, n=CONTINUATION):
    """Prefill prompt[:-1] (chunked or token by token), then n greedy steps through the
    usual decode path; returns the tokens and each step's top-2 margin and top logit."""
    cache = lm.make_cache()
    ids = mx.array([prompt[:-1]], dtype=mx.uint32)
    if chunked:
        cp.prefill_hidden(lm, ids, cache, chunk)
    else:
        lm.hidden(ids, cache)
    tok, toks, margins = prompt[-1], [], []
    for _ in range(n):
        lg = lm.logits(lm.hidden(mx.array([[tok]], dtype=mx.uint32), cache))[0, -1]
        top2 = mx.sort(lg.astype(mx.float32))[-2:].tolist()
        tok = mx.argmax(lg).item()
        toks.append(tok)
        margins.append((top2[1] - top2[0], abs(top2[1])))
    return toks, margins


def _assert_agree_until_near_tie(ref, ref_margins, got):
    for i, (a, b) in enumerate(zip(ref, got)):
        if a != b:
            margin, top = ref_margins[i]
            ulp = 2.0 ** (math.floor(math.log2(top)) - 7)  # bf16
            assert margin <= NEAR_TIE_ULPS * ulp, f"diverged at {i} with a decisive margin {margin} (ulp {ulp})"
            return i
    return None


def test_greedy_continuations_agree_on_fidelity_prompts(lm):
    """Chunk of 8 so that the short fidelity prompts span several chunks."""
    prompts = [lm.encode_prompt(p, None, None) for p in load_prompts()]
    full = 0
    for p in prompts:
        ref, margins = _greedy_after_prefill(lm, p, False, 8)
        got, _ = _greedy_after_prefill(lm, p, True, 8)
        full += _assert_agree_until_near_tie(ref, margins, got) is None
    assert full >= len(prompts) // 2  # most run the whole continuation without a near-tie


def test_long_prompt_through_the_engine_prefill(lm):
    """The real path: prefill.prefill -> lm.prefill_hidden, default chunk, chunking on vs off.
    Caches close (bf16 activations), continuations agree up to a near-tie."""
    prompt = sum((lm.encode_prompt(p, None, None) for p in load_prompts()), []) * 2
    assert len(prompt) - 1 >= cp.MIN_T
    saved = lm.chunked_prefill
    try:
        caches = {}
        for chunked in (False, True):
            lm.chunked_prefill = chunked
            cache = lm.make_cache()
            prefill(lm, prompt, cache)
            caches[chunked] = cache_arrays(cache)
        # the first GDN layer sees identical inputs: its state differs by float32 rounding only
        s_ref, s_got = caches[False][1], caches[True][1]
        assert s_ref.dtype == mx.float32 and s_ref.ndim == 4
        assert mx.abs(s_ref - s_got).max().item() <= REL_TOL * mx.abs(s_ref).max().item()
        for a, b in zip(caches[False], caches[True]):  # deeper layers: bf16 propagation
            assert a.shape == b.shape
            assert mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item() <= 0.05 * mx.abs(a.astype(mx.float32)).max().item() + 1e-3
    finally:
        lm.chunked_prefill = saved
    ref, margins = _greedy_after_prefill(lm, prompt, False, cp.CHUNK)
    got, _ = _greedy_after_prefill(lm, prompt, True, cp.CHUNK)
    _assert_agree_until_near_tie(ref, margins, got)


def test_the_daemons_resumable_prefill_takes_the_chunked_path(lm):
    """engine/prefill/prefill.py's ChunkedPrefill (what the daemon runs) leaves the caches that
    prefill.prefill leaves at the same chunk size, chunked GatedDeltaNet on; with it off the
    caches differ (so the comparison can tell the two paths apart)."""
    from daemon.engine.prefill.prefill import ChunkedPrefill

    prompt = sum((lm.encode_prompt(p, None, None) for p in load_prompts()), [])[:300]
    saved = lm.chunked_prefill

    def caches(chunked: bool, resumable: bool):
        lm.chunked_prefill = chunked
        cache = lm.make_cache()
        if resumable:
            job = ChunkedPrefill(lm, prompt, cp.MIN_T, cache)
            while job.step():
                pass
        else:
            prefill(lm, prompt, cache, cp.MIN_T)
        return cache_arrays(cache)

    try:
        daemon_path, serial_path, token_loop = caches(True, True), caches(True, False), caches(False, False)
    finally:
        lm.chunked_prefill = saved
    assert all(mx.array_equal(a, b).item() for a, b in zip(daemon_path, serial_path, strict=True))
    assert not all(mx.array_equal(a, b).item() for a, b in zip(daemon_path, token_loop, strict=True))


def test_prefill_path_declines_what_it_does_not_handle(lm):
    cache = lm.make_cache()
    short = mx.zeros((1, cp.MIN_T - 1), dtype=mx.uint32)
    assert not cp.applies(lm, short, cache)
    assert not cp.applies(lm, mx.zeros((2, cp.MIN_T), dtype=mx.uint32), cache)
    assert cp.applies(lm, mx.zeros((1, cp.MIN_T), dtype=mx.uint32), cache)
    assert lm.chunked_prefill == cp.default_enabled()
