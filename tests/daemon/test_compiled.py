"""The compiled one-token forward: used only where bit-identical, declined elsewhere."""

from __future__ import annotations

import itertools

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache

from daemon.engine.model import compiled as compiled_mod
from daemon.measure.compile_bench import decode_path, format_compile_ab, run_compile_ab
from daemon.engine.model.compiled import CompiledDecode, enable_compiled_decode, self_check
from daemon.engine.model.loading import load_model
from daemon.engine.model.mtp_head import load_mtp_head
from daemon.engine.decoders.sampling import Sampler
from daemon.engine.decoders.serial import serial_decode
from daemon.engine.decoders.speculative import speculative_decode
from daemon.engine.types import SamplingParams


@pytest.fixture(scope="module")
def lm(random_model_path):
    return load_model(random_model_path)


def _serial_hiddens(lm, prompt, n):
    """Greedy tokens and every step's final hidden state, through lm.hidden."""
    cache = lm.make_cache()
    lm.hidden(mx.array([prompt[:-1]], dtype=mx.uint32), cache)
    tok = mx.array([[prompt[-1]]], dtype=mx.uint32)
    toks, hs = [], []
    for _ in range(n):
        h = lm.hidden(tok, cache)
        tok = mx.argmax(lm.logits(h)[:, -1, :], axis=-1).reshape(1, 1).astype(mx.uint32)
        mx.eval(h, tok)
        toks.append(tok.item())
        hs.append(h)
    return toks, hs


def test_the_random_model_decodes_compiled(lm):
    assert lm.decode_path == "compiled"
    assert isinstance(lm.compiled_decode, CompiledDecode)


def test_compiled_steps_are_bit_identical_to_eager(lm):
    prompt = lm.encode_prompt("def load(path):\n    with open(path) as f:", None, None)
    with decode_path(lm, None):
        toks_e, hs_e = _serial_hiddens(lm, prompt, 40)
    toks_c, hs_c = _serial_hiddens(lm, prompt, 40)
    assert toks_c == toks_e
    assert all(mx.array_equal(a, b).item() for a, b in zip(hs_e, hs_c))


def test_load_model_can_stay_eager(random_model_path):
    lm = load_model(random_model_path, compile_decode=False)
    assert lm.compiled_decode is None
    assert lm.decode_path.startswith("eager")


def test_steps_it_does_not_handle_are_declined(lm):
    c = lm.compiled_decode
    cache = lm.make_cache()
    one = mx.array([[1]], dtype=mx.uint32)
    assert not c.applies(one, cache)  # empty linear caches: eager builds the first states
    lm.hidden(mx.array([[1, 2, 3]], dtype=mx.uint32), cache)
    assert c.applies(one, cache)
    assert c.applies(mx.array([[1, 2]], dtype=mx.uint32), cache)  # a verify
    assert not c.applies(mx.array([list(range(compiled_mod.MAX_T + 1))], dtype=mx.uint32), cache)  # a prompt chunk
    assert not c.applies(mx.array([[1], [2]], dtype=mx.uint32), cache)  # two rows over a one-row cache
    assert not c.applies(one, None)
    padded = next(x for x in cache if isinstance(x, ArraysCache))
    padded.left_padding = mx.array([1])
    assert not c.applies(one, cache)
    assert c.try_hidden(one, cache) is None


def test_a_compiled_step_that_differs_is_refused(lm, monkeypatch):
    """A fused kernel that rounds differently must leave the model on the eager path."""

    def off_by_a_little(layer):
        def tail(h):
            return h + layer.mlp(layer.post_attention_layernorm(h)) * 1.01

        return mx.compile(tail)

    monkeypatch.setattr(compiled_mod, "_attention_tail", off_by_a_little)
    reason = self_check(lm, CompiledDecode(lm.backbone))
    assert reason is not None and "differs from eager" in reason
    fresh = load_model(lm.path)
    assert fresh.compiled_decode is None
    assert fresh.decode_path.startswith("eager: step 0: compiled differs from eager")


def test_a_compile_failure_leaves_the_eager_path(lm, monkeypatch):
    def broken(layer):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(compiled_mod, "_linear_layer_step", broken)
    saved = lm.compiled_decode
    try:
        reason = enable_compiled_decode(lm)
        assert reason == "compile failed: RuntimeError: no compiler here"
        assert lm.compiled_decode is saved  # unchanged
    finally:
        lm.compiled_decode = saved


@pytest.mark.parametrize("rollback", ["capture", "snapshot"])
def test_speculation_on_the_compiled_path_matches_eager_serial(lm, rollback):
    """Exact speculation with compiled verify, against serial decode with nothing compiled."""
    head = load_mtp_head(lm)
    prompt = lm.encode_prompt("import json\n\nclass Encoder:", None, None)
    with decode_path(lm, None):
        serial = [s.tokens[0] for s in itertools.islice(serial_decode(lm, prompt, Sampler(SamplingParams())), 48)]
    for depth in (1, 3):
        got: list[int] = []
        gen = speculative_decode(lm, head, prompt, Sampler(SamplingParams()), depth, exact=True, rollback=rollback)
        for step in gen:
            got += step.tokens
            if len(got) >= 48:
                break
        assert got[:48] == serial, depth


def test_capture_verify_uses_the_compiled_forward(lm, monkeypatch):
    from daemon.engine.model.capture import capture_hidden

    calls = []
    real = type(lm.compiled_decode).capture_hidden
    monkeypatch.setattr(type(lm.compiled_decode), "capture_hidden",
                        lambda self, *a: calls.append(a[0].shape) or real(self, *a))
    cache = lm.make_cache()
    lm.hidden(mx.array([[1, 2, 3]], dtype=mx.uint32), cache)
    rec: list = []
    capture_hidden(lm, mx.array([[4, 5, 6]], dtype=mx.uint32), cache, rec)
    assert calls == [(1, 3)]
    assert rec and all(len(cap.states) == 3 for cap in rec)


def test_compile_bench_compares_both_paths(lm):
    head = load_mtp_head(lm)
    prompts = [lm.encode_prompt("x = 1\n", None, None)]
    res = run_compile_ab(lm, head, prompts, depths=(1,), rounds=2, tokens=8, log=lambda m: None)
    assert set(res["arms"]) == {"serial/eager", "serial/compiled", "d1/eager", "d1/compiled"}
    assert all(len(a["raw_tok_s"]) == 2 for a in res["arms"].values())
    assert res["token_mismatches"] == []
    assert set(res["ratio"]) == {"serial", "d1"}
    assert "compiled = eager" in format_compile_ab(res, "t")
    assert lm.compiled_decode is not None  # the eager arm put it back
