"""RaggedKVCache (daemon/engine/caches/ragged_cache.py): holes instead of moved keys."""

from __future__ import annotations

import pytest

mx = pytest.importorskip("mlx.core")

from mlx_lm.models.cache import KVCache  # noqa: E402

from daemon.engine.caches.ragged_cache import RaggedKVCache  # noqa: E402

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)

H, D = 2, 4


def kv(n: int, seed: int) -> KVCache:
    c = KVCache()
    if n:
        k = mx.random.normal((1, H, n, D), key=mx.random.key(seed))
        c.update_and_fetch(k, k + 1)
    return c


def write(c, n: int, seed: int):
    B = c.offset.shape[0] if isinstance(c, RaggedKVCache) else 1
    k = mx.random.normal((B, H, n, D), key=mx.random.key(seed))
    return c.update_and_fetch(k, k + 1)


def test_merge_pads_left_and_offsets_count_real_tokens():
    c = RaggedKVCache.merge([kv(3, 0), kv(5, 1)])
    assert c.offset.tolist() == [3, 5] and c.left_padding.tolist() == [2, 0] and c._idx == 5
    m = c.make_mask(1)
    assert m.shape == (2, 1, 1, 6)
    assert m[0, 0, 0].tolist() == [False, False, True, True, True, True]
    assert m[1, 0, 0].tolist() == [True] * 6


def test_punch_makes_holes_lowers_offsets_and_masks_them_for_later_queries():
    c = RaggedKVCache.merge([kv(3, 0), kv(5, 1)])
    write(c, 4, 2)  # a verify of 4 positions for both rows
    c.punch([1, 3], 4)  # row 0 keeps 1 of them, row 1 keeps 3
    assert c.offset.tolist() == [3 + 1, 5 + 3]  # RoPE positions of the next tokens: no gap
    m = c.make_mask(2)  # two new queries
    assert m.shape == (2, 1, 2, 11)
    row0 = m[0, 0, 1].tolist()
    # left padding (2), the prompt (3), 1 kept, 3 holes, then the two new slots (causal).
    assert row0 == [False, False, True, True, True, True, False, False, False, True, True]
    row1 = m[1, 0, 0].tolist()
    assert row1 == [True] * 5 + [True, True, True, False] + [True, False]


def test_extract_gathers_live_slots_in_order():
    c = RaggedKVCache.merge([kv(3, 0), kv(5, 1)])
    keys, _ = write(c, 4, 2)
    c.punch([1, 3], 4)
    out = c.extract(0)
    assert out.offset == 4
    want = mx.concatenate([keys[0:1, :, 2:5], keys[0:1, :, 5:6]], axis=2)
    assert mx.array_equal(out.keys, want).item()
    out1 = c.extract(1)
    assert out1.offset == 8 and mx.array_equal(out1.keys, keys[1:2, :, :8]).item()


def test_compact_drops_holes_and_keeps_every_row_equal():
    c = RaggedKVCache.merge([kv(3, 0), kv(5, 1), kv(1, 2)])
    write(c, 4, 3)
    before = [c.extract(i) for i in range(3)]
    c.punch([2, 4, 1], 4)
    kept = [c.extract(i) for i in range(3)]
    c.compact()
    assert c.valid is None and c.n_holes == 0
    assert c.offset.tolist() == [5, 9, 2]
    for i in range(3):
        got = c.extract(i)
        assert got.offset == kept[i].offset
        assert mx.array_equal(got.keys, kept[i].keys).item() and mx.array_equal(got.values, kept[i].values).item()
    assert before[1].offset == 9


def test_filter_and_extend_keep_rows_intact_through_holes():
    c = RaggedKVCache.merge([kv(3, 0), kv(5, 1), kv(2, 2)])
    write(c, 3, 4)
    c.punch([1, 3, 2], 3)
    want = [c.extract(i) for i in range(3)]
    c.filter(mx.array([0, 2]))
    assert c.valid is None  # compacted on a row leaving
    for got, w in zip([c.extract(0), c.extract(1)], [want[0], want[2]]):
        assert got.offset == w.offset and mx.array_equal(got.keys, w.keys).item()
    c.extend(RaggedKVCache.merge([kv(7, 5)]))
    assert c.offset.tolist() == [want[0].offset, want[2].offset, 7]
    assert mx.array_equal(c.extract(0).keys, want[0].keys).item()


def test_holes_past_the_share_compact_on_their_own():
    c = RaggedKVCache.merge([kv(2, 0), kv(2, 1)])
    for s in range(6):
        write(c, 4, 10 + s)
        c.punch([1, 1], 4)  # 3 of every 4 written slots become holes
    assert c.n_holes <= 0.25 * 2 * c._idx + 6  # compacted along the way
    assert c.offset.tolist() == [8, 8]
