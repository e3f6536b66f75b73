"""The compiled batched step (engine/model/compiled.py, compiled_batch.py): B rows through the
traced layers, bit-identical to the eager forward or not used."""

from __future__ import annotations

import itertools
import json

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, BatchKVCache

from daemon.engine.model import compiled as compiled_mod
from daemon.engine.kernels import forward as forward_mod
from daemon.engine.decoders.batch import BatchDecoder
from daemon.engine.decoders.batch_spec import SpecBatchDecoder
from daemon.engine.model.capture import capture_hidden
from daemon.engine.model.loading import load_model
from daemon.engine.caches.ragged_cache import RaggedKVCache, keep_ragged
from daemon.engine.decoders.sampling import Sampler
from daemon.engine.decoders.serial import serial_decode
from daemon.engine.types import SamplingParams
from daemon.measure.compile_bench import decode_path

# Prompt lengths of the rows: a one-token prompt (an empty linear state merged as zeros)
# beside longer ones, so the batch caches carry left padding.
LENGTHS = (1, 6, 17, 30)


@pytest.fixture
def spy(monkeypatch):
    """The batch heights the compiled walk ran at (plain and capturing alike)."""
    heights: list[int] = []
    real = forward_mod.compiled_forward

    def counting(compiled, tokens, cache, rec):
        heights.append(tokens.shape[0])
        return real(compiled, tokens, cache, rec)

    monkeypatch.setattr(compiled_mod, "compiled_forward", counting)
    return heights


def _prompt(lm, i: int, n: int) -> list[int]:
    return [(31 * j + 97 * i + 5) % lm.text_args.vocab_size for j in range(n)]


def _batch(lm, B: int, ragged: bool) -> list:
    """B rows prefilled alone (all but the last prompt token), merged as batch.py
    (BatchKVCache) or batch_spec.py (RaggedKVCache) merges them."""
    rows = []
    for i in range(B):
        cache = lm.make_cache()
        p = _prompt(lm, i, LENGTHS[i % len(LENGTHS)])
        if len(p) > 1:
            lm.hidden(mx.array([p[:-1]], dtype=mx.uint32), cache)
        rows.append(cache)
    merged = []
    for layer in zip(*rows):
        if isinstance(layer[0], ArraysCache):
            m = ArraysCache.merge(list(layer))
            m.left_padding = None
        else:
            m = (RaggedKVCache if ragged else BatchKVCache).merge(list(layer))
        merged.append(m)
    return merged


def _walk(lm, B: int, ragged: bool) -> list[mx.array]:
    """Every hidden state of: (ragged) a capturing verify of 4 positions keeping a different
    prefix per row, then 6 greedy one-token steps, then a 3-position verify (through the
    holes where ragged); and the caches' arrays at the end."""
    cache = _batch(lm, B, ragged)
    tok = mx.array([[_prompt(lm, i, LENGTHS[i % len(LENGTHS)])[-1]] for i in range(B)], dtype=mx.uint32)
    out = []
    if ragged:
        block = mx.concatenate([tok, (tok * 3 + mx.arange(1, 4)[None, :]) % lm.text_args.vocab_size], axis=1)
        rec: list = []
        out.append(capture_hidden(lm, block.astype(mx.uint32), cache, rec))
        keep = [1 + i % 4 for i in range(B)]
        keep_ragged(cache, rec, keep, 4)
        out += [s for cap in rec for s in cap.states]
        tok = mx.array([[int(block[i, keep[i] - 1].item())] for i in range(B)], dtype=mx.uint32)
    for _ in range(6):
        h = lm.hidden(tok, cache)
        tok = mx.argmax(lm.logits(h)[:, -1, :], axis=-1).reshape(B, 1).astype(mx.uint32)
        mx.eval(h, tok)
        out.append(h)
    out.append(lm.hidden(mx.concatenate([tok, tok, tok], axis=1), cache))
    for c in cache:
        if isinstance(c, ArraysCache):
            out += list(c.cache)
        else:
            out += [c.keys[..., : c._idx, :], c.values[..., : c._idx, :]]
    mx.eval(out)
    return out


def test_batches_run_compiled_where_the_check_passes(lm):
    assert lm.decode_path == "compiled" and lm.batch_decode_path == "compiled"
    assert lm.compiled_decode.batched
    cache = _batch(lm, 2, ragged=False)
    assert lm.compiled_decode.applies(mx.array([[1], [2]], dtype=mx.uint32), cache)
    padded = next(c for c in cache if isinstance(c, ArraysCache))
    padded.left_padding = mx.array([1, 0])  # a masked linear state (mlx-lm's own batched prefill): eager
    assert not lm.compiled_decode.applies(mx.array([[1], [2]], dtype=mx.uint32), cache)


@pytest.mark.parametrize("ragged", [False, True], ids=["padded", "holed"])
@pytest.mark.parametrize("B", [2, 4])
def test_compiled_batched_steps_are_bit_identical_to_eager(lm, spy, B, ragged):
    with decode_path(lm, None):
        eager = _walk(lm, B, ragged)
    assert spy == []
    comp = _walk(lm, B, ragged)
    # Every batched forward went through the traced layers: the verify(s) and the 6 steps
    # (the rows' short prefills, one row each, did too).
    assert [h for h in spy if h > 1] == [B] * (6 + 1 + ragged)
    assert len(eager) == len(comp)
    for i, (a, b) in enumerate(zip(eager, comp)):
        assert mx.array_equal(a, b).item(), i


def _serial(lm, prompt: list[int], n: int) -> list[int]:
    return [s.tokens[0] for s in itertools.islice(serial_decode(lm, prompt, Sampler(SamplingParams())), n)]


@pytest.mark.parametrize("B", [2, 4])
def test_the_plain_batch_decodes_compiled_and_stays_serial(lm, spy, B):
    """Rows of mixed prompt lengths, one joining while the others run and leaving at
    different times: each row's greedy tokens are those it decodes alone, with nothing
    compiled; and the batched steps ran compiled."""
    prompts = [_prompt(lm, i, LENGTHS[i % len(LENGTHS)] + 1) for i in range(B)]
    with decode_path(lm, None):
        want = [_serial(lm, p, 12 + 3 * i) for i, p in enumerate(prompts)]
    spy.clear()
    bd = BatchDecoder(lm, max_rows=B, exact_ok=True)
    got: dict[int, list[int]] = {i: [] for i in range(B)}
    for i, p in enumerate(prompts[:-1]):
        bd.add(i, Sampler(SamplingParams()), p, exact=True)
    for step in itertools.count():
        if step == 2:
            bd.add(B - 1, Sampler(SamplingParams()), prompts[-1], exact=True)
        for r, t in bd.step().items():
            got[r].append(t)
        for r in [r for r in bd.row_ids if len(got[r]) >= len(want[r])]:
            bd.remove(r)
        if not len(bd):
            break
    assert got == {i: w for i, w in enumerate(want)}
    assert B in spy


@pytest.mark.parametrize("B", [2, 4])
def test_the_speculating_batch_verifies_compiled_and_stays_serial(lm, head, spy, B):
    """Speculating rows (depth 2, ragged acceptance on the random model's near-ties): every
    row's tokens are serial's with nothing compiled; the batched verifies ran compiled."""
    prompts = [_prompt(lm, i, LENGTHS[i % len(LENGTHS)] + 1) for i in range(B)]
    n = 16
    with decode_path(lm, None):
        want = [_serial(lm, p, n) for p in prompts]
    spy.clear()
    bd = SpecBatchDecoder(lm, lambda: head, lambda height: 2, max_rows=B, exact_ok=True)
    for i, p in enumerate(prompts):
        bd.add(i, Sampler(SamplingParams()), p, exact=True)
    got: dict[int, list[int]] = {i: [] for i in range(B)}
    while len(bd):
        for r, s in bd.step().items():
            got[r] += s.tokens
        for r in [r for r in bd.row_ids if len(got[r]) >= n]:
            bd.remove(r)
    assert {r: v[:n] for r, v in got.items()} == {i: w for i, w in enumerate(want)}
    assert B in spy


def _batch_only_perturbed(layer):
    """An attention tail that rounds differently only at B >= 2 (the shape is known when
    the trace is made): the one-row check passes, the batch's must not."""

    def tail(h):
        out = h + layer.mlp(layer.post_attention_layernorm(h))
        return out * 1.01 if h.shape[0] > 1 else out

    return mx.compile(tail)


def test_a_batch_that_differs_stays_eager_while_one_row_stays_compiled(lm, random_model_path, monkeypatch):
    monkeypatch.setattr(compiled_mod, "_attention_tail", _batch_only_perturbed)
    fresh = load_model(random_model_path)
    assert fresh.decode_path == "compiled"
    assert fresh.batch_decode_path.startswith("eager: plain batch B=2, array 0: compiled differs from eager")
    c = fresh.compiled_decode
    assert not c.batched
    assert not c.applies(mx.array([[1], [2]], dtype=mx.uint32), _batch(fresh, 2, ragged=False))
    # The batch then runs the eager forward: its rows are still serial's.
    prompts = [_prompt(fresh, i, 5 + 4 * i) for i in range(2)]
    want = [_serial(fresh, p, 10) for p in prompts]
    bd = BatchDecoder(fresh, max_rows=2, exact_ok=True)
    for i, p in enumerate(prompts):
        bd.add(i, Sampler(SamplingParams()), p, exact=True)
    got = {0: [], 1: []}
    for _ in range(10):
        for r, t in bd.step().items():
            got[r].append(t)
    assert got == {0: want[0], 1: want[1]}


def test_a_batch_check_that_fails_to_run_leaves_batches_eager(random_model_path, monkeypatch):
    def broken(lm, compiled):
        raise RuntimeError("no batched trace here")

    monkeypatch.setattr(compiled_mod, "batch_self_check", broken)
    fresh = load_model(random_model_path)
    assert fresh.decode_path == "compiled"
    assert fresh.batch_decode_path == "eager: compile failed: RuntimeError: no batched trace here"
    with decode_path(fresh, None):
        assert fresh.batch_decode_path == "eager: compiled steps switched off"
    assert load_model(random_model_path, compile_decode=False).batch_decode_path == "eager: as one row (not requested)"


def test_the_batch_checks_verdict_is_cached_with_the_one_row_checks(random_model_path, tmp_path, monkeypatch):
    """The first start runs the batch check and stores its verdict, the next reads it; a
    stored "differs" keeps the next start's batches eager (its one row compiled)."""
    from daemon.engine_thread.probe_verdicts import CompiledStepCheck, verdicts_for

    monkeypatch.setenv("COUNCILD_CACHE_DIR", str(tmp_path))
    runs = []
    real = compiled_mod.batch_self_check
    monkeypatch.setattr(compiled_mod, "batch_self_check", lambda lm_, c: runs.append(1) or real(lm_, c))
    first = CompiledStepCheck()
    a = load_model(random_model_path, compile_check=first)
    assert (first.verdict, first.batch_verdict, a.batch_decode_path, len(runs)) == ("probed", "probed", "compiled", 1)
    again = CompiledStepCheck()
    b = load_model(random_model_path, compile_check=again)
    assert (again.verdict, again.batch_verdict, b.batch_decode_path, len(runs)) == ("cached", "cached", "compiled", 1)
    key = verdicts_for(b, decode_path=False)
    assert key.key["batch_decode_path"] == "(being decided)"
    assert verdicts_for(b).key["batch_decode_path"] == "compiled"
    data = json.loads(key.path.read_text())
    data["verdicts"]["compiled_step"]["batch_self_check"] = False
    key.path.write_text(json.dumps(data))
    third = CompiledStepCheck()
    c = load_model(random_model_path, compile_check=third)
    assert (third.verdict, third.batch_verdict, c.decode_path) == ("cached", "cached", "compiled")
    assert c.batch_decode_path.startswith("eager: compiled differs from eager") and len(runs) == 1
