"""The prefix cache's bookkeeping on real (random-weight) model caches: which snapshot a
prompt continues from, that snapshots stay pristine, LRU under the byte budget."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest

from daemon.engine.prefix_cache import PrefixCache

from model_helpers import next_logits, prefilled


@pytest.fixture(scope="module")
def lm(random_model_path):
    from daemon.engine.loading import load_model

    return load_model(random_model_path, compile_decode=False)


@pytest.mark.quick
def test_longest_aligned_prefix_wins_and_snapshots_stay_pristine(lm):
    rng = random.Random(0)
    prompt = [rng.randrange(1, 500) for _ in range(100)]
    pc = PrefixCache(max_bytes=1 << 30, chunk=16)
    assert pc.boundaries(len(prompt), 0) == {96}
    assert pc.boundaries(len(prompt), 0, [40]) == {96, 32}
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
