"""Rollback of GatedDeltaNet + attention caches after a partial accept, both strategies."""

from __future__ import annotations

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import ArraysCache, KVCache

from daemon.engine.model.loading import load_model
from daemon.engine.model.mtp_head import load_mtp_head
from daemon.engine.model.capture import capture_hidden
from daemon.engine.decoders.rollback import STRATEGIES, attention_offset, make_rollback

TOL = 1e-3


@pytest.fixture(scope="module")
def lm(random_model_path):
    return load_model(random_model_path)


def _prefill(lm, tokens):
    cache = lm.make_cache()
    lm.hidden(mx.array([tokens]), cache)
    return cache


def _serial_reference(lm, prompt, extra):
    """The caches of a serial run over the same committed tokens (one token per step)."""
    cache = _prefill(lm, prompt)
    for t in extra:
        lm.hidden(mx.array([[t]]), cache)
    return cache


def _assert_caches_equal(got, want):
    assert attention_offset(got) == attention_offset(want)
    for g, w in zip(got, want):
        if isinstance(w, ArraysCache):
            for a, b in zip(g.cache, w.cache):  # conv state, recurrent state
                assert a.dtype == b.dtype and a.shape == b.shape
                assert mx.allclose(a.astype(mx.float32), b.astype(mx.float32), atol=TOL, rtol=TOL)
        else:
            assert g.offset == w.offset
            n = w.offset
            for a, b in ((g.keys, w.keys), (g.values, w.values)):
                assert mx.allclose(a[..., :n, :].astype(mx.float32), b[..., :n, :].astype(mx.float32), atol=TOL, rtol=TOL)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    strategy=st.sampled_from(STRATEGIES),
    depth=st.integers(1, 4),
    data=st.data(),
    prompt=st.lists(st.integers(0, 511), min_size=2, max_size=12),
)
def test_rollback_equals_serial_run(lm, strategy, depth, data, prompt):
    verify = data.draw(st.lists(st.integers(0, 511), min_size=depth + 1, max_size=depth + 1))
    keep = data.draw(st.integers(0, depth + 1))  # 0: guarded first position; k+1: all kept
    cache = _prefill(lm, prompt)
    rb = make_rollback(strategy, lm, cache)
    rb.forward(mx.array([verify]))
    rb.commit(keep)
    want = _serial_reference(lm, prompt, verify[:keep])
    _assert_caches_equal(cache, want)
    # And the next step agrees, so no stale slot survives.
    nxt = data.draw(st.integers(0, 511))
    a = lm.logits(lm.hidden(mx.array([[nxt]]), cache))
    b = lm.logits(lm.hidden(mx.array([[nxt]]), want))
    assert mx.allclose(a.astype(mx.float32), b.astype(mx.float32), atol=TOL, rtol=TOL)


@pytest.mark.quick
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_partial_accept_never_shortens_the_prompt(lm, strategy):
    prompt = list(range(10, 40))
    for keep in range(0, 5):
        cache = _prefill(lm, prompt)
        rb = make_rollback(strategy, lm, cache)
        rb.forward(mx.array([[1, 2, 3, 4]]))
        rb.commit(keep)
        assert attention_offset(cache) == len(prompt) + keep
        for c in cache:
            if isinstance(c, KVCache):
                assert c.offset == len(prompt) + keep
            else:
                assert c[0] is not None and c[1] is not None  # never emptied


def test_offset_comes_from_attention_layer(lm):
    cache = _prefill(lm, [1, 2, 3])
    assert isinstance(cache[0], ArraysCache)  # layer 0 is linear; its slot is no offset
    assert attention_offset(cache) == 3
    with pytest.raises(ValueError):
        attention_offset([c for c in cache if isinstance(c, ArraysCache)])


def test_capture_forward_is_lm_hidden_op_for_op(lm):
    prompt = [7, 8, 9, 10, 11]
    c1, c2 = _prefill(lm, prompt), _prefill(lm, prompt)
    toks = mx.array([[3, 1, 4, 1, 5]])
    h1 = lm.hidden(toks, c1)
    rec = []
    h2 = capture_hidden(lm, toks, c2, rec)
    assert mx.array_equal(h1, h2)
    assert len(rec) == sum(isinstance(c, ArraysCache) for c in c1)
    for a, b in zip(c1, c2):
        if isinstance(a, ArraysCache):
            assert mx.array_equal(a[0], b[0]) and mx.array_equal(a[1], b[1])




def test_no_float32_leak_into_the_residual_stream(lm, random_model_path):
    """Every block returns the activation dtype (bf16) though the GDN state is float32."""
    from daemon.engine.kernels.forward import gdn_capture

    bb = lm.backbone
    cache = lm.make_cache()
    x = bb.embed_tokens(mx.array([[5, 6, 7, 8]]))
    assert x.dtype == mx.bfloat16
    for layer, c in zip(bb.layers, cache):
        mask = "causal" if not layer.is_linear else None
        y = layer(x, mask=mask, cache=c)
        assert y.dtype == x.dtype, f"{type(layer).__name__} promoted {x.dtype} -> {y.dtype}"
        if layer.is_linear:
            assert c[1].dtype == mx.float32  # the recurrent state itself stays float32
            r = gdn_capture(layer.linear_attn, layer.input_layernorm(x), None, ArraysCache(2), [])
            assert r.dtype == x.dtype
        x = y
    h = bb.norm(x)
    assert h.dtype == mx.bfloat16 and lm.logits(h).dtype == mx.bfloat16
    rec = []
    assert capture_hidden(lm, mx.array([[1, 2, 3]]), lm.make_cache(), rec).dtype == mx.bfloat16
    head = load_mtp_head(lm)
    assert head(h, mx.array([[6, 7, 8, 9]]), head.make_cache()).dtype == mx.bfloat16


@pytest.fixture(scope="module")
def next_lm():
    """A tiny random qwen3_next model (in_proj_qkvz / in_proj_ba projections), bf16."""
    from pathlib import Path

    from mlx_lm.models import qwen3_next

    from daemon.engine.model.model import LoadedModel

    args = qwen3_next.ModelArgs(
        model_type="qwen3_next", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=2, linear_num_value_heads=2, linear_num_key_heads=1, linear_key_head_dim=32,
        linear_value_head_dim=32, linear_conv_kernel_dim=4, num_experts=0, num_experts_per_tok=0,
        decoder_sparse_step=1, shared_expert_intermediate_size=0, mlp_only_layers=[], moe_intermediate_size=0,
        rms_norm_eps=1e-6, vocab_size=128, num_key_value_heads=1, rope_theta=10000.0, partial_rotary_factor=0.25,
        max_position_embeddings=512, head_dim=32, full_attention_interval=2, tie_word_embeddings=True,
    )
    mx.random.seed(11)
    model = qwen3_next.Model(args)
    model.apply(lambda x: x.astype(mx.bfloat16) if x.dtype == mx.float32 else x)
    return LoadedModel(model=model, tokenizer=None, path=Path("qwen3-next-random"), config={}, model_type="qwen3_next")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_qwen3_next_capture_and_rollback(next_lm, strategy):
    lm = next_lm
    prompt = [3, 9, 27, 81, 115, 1, 2]
    c1, c2 = _prefill(lm, prompt), _prefill(lm, prompt)
    toks = mx.array([[5, 6, 7, 8]])
    assert mx.array_equal(lm.hidden(toks, c1), capture_hidden(lm, toks, c2, []))
    for keep in range(5):
        cache = _prefill(lm, prompt)
        rb = make_rollback(strategy, lm, cache)
        rb.forward(toks)
        rb.commit(keep)
        _assert_caches_equal(cache, _serial_reference(lm, prompt, toks[0, :keep].tolist()))


def test_qwen3_next_speculation_is_token_identical(next_lm):
    import itertools

    from daemon.engine.model.mtp_head import MTPHead
    from daemon.engine.decoders.sampling import Sampler
    from daemon.engine.decoders.serial import serial_decode
    from daemon.engine.decoders.speculative import speculative_decode
    from daemon.engine.types import SamplingParams

    lm = next_lm
    head = MTPHead(lm.text_args)
    head.apply(lambda x: x.astype(mx.bfloat16))
    head._lm = lm
    prompt = [3, 9, 27, 81, 115, 1, 2]
    ref = [t for s in itertools.islice(serial_decode(lm, prompt, Sampler(SamplingParams())), 20) for t in s.tokens]
    for k in (1, 3):
        got = []
        for s in speculative_decode(lm, head, prompt, Sampler(SamplingParams()), k):
            got += s.tokens
            if len(got) >= 20:
                break
        assert got[:20] == ref
