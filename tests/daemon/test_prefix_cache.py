"""The prefix cache's bookkeeping on real (random-weight) model caches: which snapshot a
prompt continues from, that snapshots stay pristine, LRU under the byte budget."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest

from daemon.engine.caches.prefix_cache import PrefixCache

from model_helpers import next_logits, prefilled


@pytest.fixture(scope="module")
def lm(random_model_path):
    from daemon.engine.model.loading import load_model

    return load_model(random_model_path, compile_decode=False)


@pytest.mark.quick
def test_longest_aligned_prefix_wins_and_snapshots_stay_pristine(lm):
    rng = random.Random(0)
    prompt = [rng.randrange(1, 500) for _ in range(100)]
    pc = PrefixCache(max_bytes=1 << 30, chunk=16)
    assert pc.boundaries(len(prompt), 0) == {96, 80}  # the prompt's last two grid points
    assert pc.boundaries(len(prompt), 0, [40]) == {96, 80, 32}
    for p in (32, 64):
        assert pc.store(prompt[:p], prefilled(lm, prompt[:p], 16), None) is not None
    assert pc.store(prompt[:50], prefilled(lm, prompt[:50], 16), None) is None  # unaligned: refused
    snap, n = pc.lookup(prompt, want_head=False)
    assert n == 64 and snap.tokens == tuple(prompt[:64])
    assert pc.lookup(prompt[:40] + [7] * 60, want_head=False)[1] == 32
    assert pc.lookup([9] + prompt[1:], want_head=False) == (None, 0)
    assert pc.lookup(prompt, want_head=True) == (None, 0)  # no head history stored
    # A restored cache continues exactly as the live one would; using it leaves the
    # snapshot as it was (a second restore computes the same thing).
    ref = next_logits(lm, prefilled(lm, prompt[:64], 16), prompt[64])
    for _ in range(2):
        cache, history = pc.restore(snap, prompt[64], head=None)
        assert history is None
        assert mx.array_equal(next_logits(lm, cache, prompt[64]), ref).item()
    assert pc.stats()["hits"] == 2 and pc.stats()["misses"] == 2


def test_lru_under_the_byte_budget(lm):
    rng = random.Random(1)
    prompts = [[rng.randrange(1, 500) for _ in range(32)] for _ in range(4)]
    probe = PrefixCache(max_bytes=1 << 30, chunk=16)
    one = probe.store(prompts[0], prefilled(lm, prompts[0], 16), None).nbytes
    pc = PrefixCache(max_bytes=int(2.5 * one), chunk=16)
    for p in prompts[:2]:
        pc.store(p, prefilled(lm, p, 16), None)
    assert pc.lookup(prompts[0], want_head=False)[1] == 0  # 33-token prompt needed: none of 32 usable
    assert pc.lookup(prompts[0] + [5], want_head=False)[1] == 32  # touch prompts[0]: now most recent
    pc.store(prompts[2], prefilled(lm, prompts[2], 16), None)
    assert pc.nbytes <= pc.max_bytes and len(pc.entries) == 2
    assert pc.lookup(prompts[1] + [5], want_head=False)[1] == 0  # the least recently used went
    assert pc.lookup(prompts[0] + [5], want_head=False)[1] == 32
    freed, tokens = pc.evict_oldest()
    assert freed == one and tokens == 32 and len(pc.entries) == 1


# ---------------------------------------------------------------- reuse at every token
def _state_bits(cache) -> list:
    from daemon.engine.caches.prefix_cache import filled_arrays

    out = filled_arrays(cache)
    mx.eval(out)
    return out


def _same(a, b) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and mx.array_equal(x, y).item() for x, y in zip(a, b))


def test_the_split_probe_compares_what_a_forward_reads_and_agrees_on_this_cpu(lm):
    """``splits_agree`` at a chunk past the KV cache's 256-slot allocation step: the
    plans' KV buffers differ in capacity (the old probe compared whole buffers and said
    "differs" from 128-token chunks up), their filled parts and the next logits do not."""
    from daemon.engine.caches.prefix_cache import split_plans, splits_agree

    chunk = 128
    n, plans = split_plans(chunk)
    assert [sum(p) for p in plans] == [n] * len(plans) and plans[0][:2] == [chunk, chunk]
    rng = random.Random(3)
    ids = [rng.randrange(1, 500) for _ in range(n)]
    caches = []
    for plan in plans:
        cache, pos = lm.make_cache(), 0
        for m in plan:
            lm.prefill_hidden(mx.array([ids[pos : pos + m]], dtype=mx.uint32), cache)
            pos += m
        caches.append(cache)
    buffers = [{c.keys.shape[2] for c in cache if hasattr(c, "keys") and c.keys is not None} for cache in caches]
    assert len({frozenset(b) for b in buffers}) > 1  # the spare capacity depends on the split
    assert all(_same(_state_bits(caches[0]), _state_bits(c)) for c in caches[1:])
    assert splits_agree(lm, chunk) and splits_agree(lm, 16)


def test_the_split_probe_refuses_a_forward_whose_numbers_depend_on_the_split(lm, monkeypatch):
    """A backend whose short forwards round differently (standing in for MLX on CUDA:
    kernels chosen by row count, the chunked GatedDeltaNet form from 128 tokens): the
    probe says no."""
    from daemon.engine.caches.prefix_cache import splits_agree

    chunk = 32
    real = type(lm).prefill_hidden

    def rounding_by_rows(self, tokens, cache):
        h = real(self, tokens, cache)
        if tokens.shape[1] not in (1, chunk):  # an off-grid chunk: one ulp on one recurrent state
            layer = next(c for c in cache if not hasattr(c, "keys"))
            layer.cache[1] = layer.cache[1] * (1 + 2.0**-20)
        return h

    assert splits_agree(lm, chunk)
    monkeypatch.setattr(type(lm), "prefill_hidden", rounding_by_rows)
    assert not splits_agree(lm, chunk)


def test_where_splits_are_exact_snapshots_sit_at_exact_ends_and_a_resume_is_a_cold_run(lm):
    """Splits exact: the snapshot points are the prompt's and the messages' exact ends and
    the grid point before each; the prefill cuts its chunks there; a later prompt resumes
    from the off-grid snapshot and
    leaves the cold run's state bit for bit (and the same next logits)."""
    from daemon.engine.prefill.prefill import ChunkedPrefill

    chunk = 32
    rng = random.Random(4)
    prompt = [rng.randrange(1, 500) for _ in range(101)]
    pc = PrefixCache(max_bytes=1 << 30, chunk=chunk, splits_exact=True)
    assert pc.boundaries(len(prompt), 0, [41]) == {100, 96, 64, 41, 32}
    assert pc.boundaries(len(prompt), 41, [41]) == {100, 96, 64}
    assert "any token" in pc.stats()["exact_reuse"]
    pre = ChunkedPrefill(lm, prompt, chunk, lm.make_cache(), stops=pc.boundaries(len(prompt), 0, [41]))
    sizes = []
    while not pre.done:
        sizes.append(pre.step())
        if pre.pos == 41:
            assert pc.store(prompt[:41], pre.cache, None) is not None  # exact off the grid here
    assert sizes == [32, 9, 23, 32, 4]
    cold = prefilled(lm, prompt[:-1], chunk)  # the grid: 32, 32, 32, 4
    assert _same(_state_bits(pre.cache), _state_bits(cold))
    # A later prompt sharing the first message: it resumes at 41 and forwards off the grid.
    later = prompt[:41] + [rng.randrange(1, 500) for _ in range(70)]
    snap, n = pc.lookup(later, want_head=False)
    assert n == 41 and snap.exact
    cache, _ = pc.restore(snap, later[41], head=None)
    resumed = ChunkedPrefill(lm, later, chunk, cache, start=41)
    while not resumed.done:
        resumed.step()
    ref = prefilled(lm, later[:-1], chunk)
    assert _same(_state_bits(resumed.cache), _state_bits(ref))
    assert mx.array_equal(next_logits(lm, resumed.cache, later[-1]), next_logits(lm, ref, later[-1])).item()


@pytest.mark.quick
def test_where_splits_are_exact_a_grid_point_sits_before_each_end():
    """An exact end serves only its own continuation; grid points below it serve prompts
    that share less: the last two before the prompt's end (a raw prompt has no other end),
    the last one before each message end, each only past the end before it."""
    pc = PrefixCache(max_bytes=1 << 30, chunk=32, splits_exact=True)
    assert pc.boundaries(101, 0) == {100, 96, 64}  # a raw prompt: its end and two grid points below
    assert pc.boundaries(97, 0) == {96, 64}  # its end on the grid
    assert pc.boundaries(40, 0) == {39, 32}
    assert pc.boundaries(101, 0, [10, 20, 41]) == {10, 20, 41, 32, 100, 96, 64}  # 10 and 20: no grid point past 0
    assert pc.boundaries(101, 0, [33, 40]) == {33, 40, 32, 100, 96, 64}  # 40's grid point is 33's
    assert pc.boundaries(101, 0, [70]) == {64, 70, 100, 96}  # 100's second grid point is 70's
    assert pc.boundaries(101, 97, [41]) == {100}  # resumed past the grid points: only the end
    assert pc.boundaries(101, 50, [41]) == {100, 96, 64}
    # Where splits are not exact: the same grid points, no exact ends.
    grid = PrefixCache(max_bytes=1 << 30, chunk=32, splits_exact=False)
    assert grid.boundaries(101, 0, [10, 20, 41, 70]) == {32, 64, 96}
    assert grid.boundaries(101, 0, fine=True) == {100, 96, 64}


def test_where_splits_are_not_exact_exact_requests_refuse_off_grid_snapshots(lm):
    """Splits not exact: off-grid snapshots (a prompt's end, a continuation) are stored
    inexact and exact lookups pass them by for the grid one below; the snapshot points
    stay on the grid (the prompt's end only for requests that allow inexact reuse)."""
    chunk = 16
    rng = random.Random(5)
    prompt = [rng.randrange(1, 500) for _ in range(60)]
    pc = PrefixCache(max_bytes=1 << 30, chunk=chunk, splits_exact=False)
    assert "chunk grid" in pc.stats()["exact_reuse"]
    assert pc.boundaries(len(prompt), 0, [41]) == {48, 32}
    assert pc.boundaries(len(prompt), 0, [41], fine=True) == {48, 32, 59}
    assert pc.store(prompt[:48], prefilled(lm, prompt[:48], chunk), None) is not None
    assert pc.store(prompt[:59], prefilled(lm, prompt[:59], chunk), None) is None  # claimed exact: refused
    assert pc.store(prompt[:59], prefilled(lm, prompt[:59], chunk), None, exact=False) is not None
    cont = pc.store_final(prompt + [3, 4], prefilled(lm, prompt + [3], chunk), None, seat="s")
    assert cont is not None and not cont.exact
    nxt = prompt + [3, 4, 9, 9]
    assert pc.lookup(nxt, want_head=False)[1] == 48
    assert pc.lookup(nxt, want_head=False, allow_inexact=True)[1] == 61  # the decoder held all but the last


def test_a_continuation_is_exact_only_where_the_decode_left_a_cold_state(lm):
    rng = random.Random(6)
    prompt = [rng.randrange(1, 500) for _ in range(40)]
    pc = PrefixCache(max_bytes=1 << 30, chunk=16, splits_exact=True)
    assert pc.store_final(prompt, prefilled(lm, prompt, 16), None, seat="a").exact
    other = prompt[:20] + [8] * 20
    assert not pc.store_final(other, prefilled(lm, other, 16), None, seat="b", exact=False).exact
    assert pc.lookup(other + [1], want_head=False)[1] == 0
    assert pc.lookup(prompt + [1], want_head=False)[1] == 40
    # What a prefill stores after resuming from the inexact one is inexact too (worker.py
    # asks is_exact with the job's chain), on the grid or off it.
    assert pc.is_exact(57) and pc.is_exact(48) and not pc.is_exact(57, from_exact=False)
    assert not pc.is_exact(48, from_exact=False)


def test_a_snapshot_holds_no_spare_kv_capacity(lm):
    """mlx-lm's KVCache state is its whole buffer (256-slot steps); a snapshot keeps the
    filled part, and a restored cache continues as the live one."""
    rng = random.Random(7)
    prompt = [rng.randrange(1, 500) for _ in range(41)]
    live = prefilled(lm, prompt[:40], 16)
    assert any(c.keys.shape[2] > c.offset for c in live if hasattr(c, "keys") and c.keys is not None)
    pc = PrefixCache(max_bytes=1 << 30, chunk=8, splits_exact=False)
    snap = pc.store(prompt[:40], live, None)
    assert all(c.keys.shape[2] == c.offset == 40 for c in snap.base if hasattr(c, "keys") and c.keys is not None)
    cache, _ = pc.restore(snap, prompt[40], head=None)
    assert mx.array_equal(next_logits(lm, cache, prompt[40]), next_logits(lm, live, prompt[40])).item()


@pytest.mark.quick
def test_a_second_look_counts_one_request_once(lm):
    """relookup: a request that missed (or hit less) looks again after others stored more;
    the statistics count it as its better lookup, and a look that finds nothing longer
    leaves them as they were. Every snapshot taken in bumps the generation."""
    rng = random.Random(2)
    prompt = [rng.randrange(1, 500) for _ in range(70)]
    pc = PrefixCache(max_bytes=1 << 30, chunk=16)
    g0 = pc.generation
    assert pc.lookup(prompt, want_head=False) == (None, 0)  # a miss
    assert pc.relookup(prompt, False, False, held=0) == (None, 0) and pc.stats()["misses"] == 1
    pc.store(prompt[:32], prefilled(lm, prompt[:32], 16), None)
    assert pc.generation == g0 + 1
    snap, n = pc.relookup(prompt, False, False, held=0)
    assert n == 32 and snap.tokens == tuple(prompt[:32])
    assert (pc.stats()["hits"], pc.stats()["misses"], pc.stats()["cached_tokens"]) == (1, 0, 32)
    pc.store(prompt[:64], prefilled(lm, prompt[:64], 16), None)
    assert pc.relookup(prompt, False, False, held=32)[1] == 64
    assert (pc.stats()["hits"], pc.stats()["misses"], pc.stats()["cached_tokens"]) == (1, 0, 64)
    assert pc.relookup(prompt, False, False, held=64) == (None, 64)  # nothing longer: unchanged
    assert (pc.stats()["hits"], pc.stats()["misses"], pc.stats()["cached_tokens"]) == (1, 0, 64)
