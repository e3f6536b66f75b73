"""A batch KV cache whose rows can give back different numbers of their last slots.

Batched speculation writes the same number of positions for every row (a verify of k+1
tokens, a head feed padded to the longest row's pending pairs) and then each row keeps its
own prefix. Moving each row's keys to close the gap would copy the whole cache every cycle;
instead the rejected slots become **holes**: ``punch`` marks them invalid in a per-row
validity array and lowers that row's ``offset`` by their number, so

- every later query masks them out (``make_mask`` ands the validity into mlx-lm's causal,
  left-padded mask), and
- the row's next tokens get the RoPE positions they would have had without them (qwen3_5 /
  qwen3_next attention rotates by ``cache.offset``, a per-row array in a BatchKVCache).

A hole holds finite stale keys and values; masked to -inf before the softmax it weighs
exactly 0. On the CPU backend a row attending through holes computes what it computes over
its contiguous keys, bit for bit (tests/daemon/test_ragged_cache.py measures it); where a
backend rounds otherwise, exact rows do not batch (``batch.batch_matches_serial``).

Holes are dropped (``compact``) when a row leaves (``filter``), when a row is taken out
(``extract`` gathers its valid slots), and when they pass ``COMPACT_SHARE`` of the slots.
Invariant: ``valid`` is None (no holes) or a bool array [B, _idx].
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache

# Compact when holes are this share of the written slots: the mask and the attention read
# every slot, holes included, so they cost what live keys cost.
COMPACT_SHARE = 0.25


class RaggedKVCache(BatchKVCache):
    def __init__(self, left_padding: list[int]):
        super().__init__(left_padding)
        self.valid: mx.array | None = None
        self.n_holes = 0  # host-side count, so deciding to compact never syncs the device

    @classmethod
    def from_batch(cls, c: BatchKVCache) -> "RaggedKVCache":
        out = cls([0])
        out.keys, out.values, out.offset, out.left_padding, out._idx = c.keys, c.values, c.offset, c.left_padding, c._idx
        return out

    @classmethod
    def merge(cls, caches: list) -> "RaggedKVCache":
        """Plain per-row KVCaches (or RaggedKVCaches) into one, left-padded."""
        plain = [c.extract(0) if isinstance(c, RaggedKVCache) else c for c in caches]
        return cls.from_batch(BatchKVCache.merge(plain))

    # ------------------------------------------------------------------ writing
    def update_and_fetch(self, keys, values):
        n = keys.shape[2]
        out = super().update_and_fetch(keys, values)
        if self.valid is not None:
            self.valid = mx.concatenate([self.valid, mx.ones((self.valid.shape[0], n), dtype=mx.bool_)], axis=1)
        return out

    def trim(self, n: int) -> int:
        n = super().trim(n)
        if self.valid is not None:
            self.valid = self.valid[:, : self._idx]
        return n

    def punch(self, keep: list[int], written: int) -> None:
        """After a forward that wrote ``written`` slots per row, row i keeps its first
        ``keep[i]`` of them; the rest become holes."""
        dropped = [written - k for k in keep]
        if not any(dropped):
            return
        self.punch_lazy(mx.array(keep), written)
        self.n_holes += sum(dropped)
        if self.holes_due():
            self.compact()

    def punch_lazy(self, keep: mx.array, written: int) -> None:
        """``punch`` with each row's count still on the device ([B] ints): the host reads
        nothing, so the next cycle can be built on this one before its acceptance is known
        (batch_ahead.py). The holes are not counted here: the host adds
        them to ``n_holes`` once it reads the counts, and compacts only then (``holes_due``)."""
        B = keep.shape[0]
        kept = mx.arange(written)[None, :] < keep.reshape(B, 1)  # [B, written]
        valid = self.valid if self.valid is not None else mx.ones((B, self._idx - written), dtype=mx.bool_)
        self.valid = mx.concatenate([valid[:, : self._idx - written], kept], axis=1)
        self.offset = self.offset - (written - keep).astype(self.offset.dtype)

    def holes_due(self) -> bool:
        return self.valid is not None and self.n_holes > COMPACT_SHARE * self.valid.shape[0] * self._idx

    # ------------------------------------------------------------------ reading
    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        mask = create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)
        if self.valid is None:
            return mask
        B = self.valid.shape[0]
        keys_valid = mx.concatenate([self.valid, mx.ones((B, N), dtype=mx.bool_)], axis=1)
        return mx.logical_and(mask, keys_valid[:, None, None, :])

    def _rows_slots(self) -> list[list[int]]:
        """Per row, the indices of its live slots (left padding and holes excluded)."""
        lp = self.left_padding.tolist()
        valid = self.valid.tolist() if self.valid is not None else None
        return [[s for s in range(p, self._idx) if valid is None or valid[i][s]] for i, p in enumerate(lp)]

    # ------------------------------------------------------------------ reshaping
    def compact(self) -> None:
        """Drop every hole: each row's live slots right-aligned at ``_idx``, left-padded."""
        if self.valid is None:
            return
        if self.keys is None:
            self.valid, self.n_holes = None, 0
            return
        rows = self._rows_slots()
        n = max((len(r) for r in rows), default=0)
        idx = mx.array([[r[0] if r else 0] * (n - len(r)) + r for r in rows], dtype=mx.int32)  # [B, n]
        gather = idx[:, None, :, None]
        self.keys = mx.take_along_axis(self.keys, gather, axis=2)
        self.values = mx.take_along_axis(self.values, gather, axis=2)
        self.left_padding = mx.array([n - len(r) for r in rows])
        self.offset = mx.array([len(r) for r in rows])
        self._idx = n
        self.valid = None
        self.n_holes = 0

    def filter(self, batch_indices) -> None:
        if self.valid is not None:
            self.valid = self.valid[batch_indices]
        super().filter(batch_indices)  # may shift left by the smallest left padding
        if self.valid is not None:
            self.valid = self.valid[:, self.valid.shape[1] - self._idx :]
            self.compact()

    def extend(self, other) -> None:
        self.compact()
        if isinstance(other, RaggedKVCache):
            other.compact()
        super().extend(other)

    def extract(self, idx: int) -> KVCache:
        """Row ``idx``'s own KVCache: its live slots, contiguous."""
        if self.keys is None:
            return KVCache()  # nothing written yet (a head that never drafted)
        if self.valid is None:
            return super().extract(idx)
        slots = mx.array(self._rows_slots()[idx], dtype=mx.int32)
        cache = KVCache()
        cache.keys = mx.contiguous(self.keys[idx : idx + 1, :, slots])
        cache.values = mx.contiguous(self.values[idx : idx + 1, :, slots])
        cache.offset = cache.keys.shape[2]
        return cache

    @property
    def state(self):
        """The arrays to evaluate (no setter: rows move between caches by merge/extract)."""
        return [x for x in (self.keys, self.values, self.offset, self.left_padding, self.valid) if x is not None]


def keep_kv(c, keep: list[int] | mx.array, written: int) -> None:
    """Row i keeps its first keep[i] of the ``written`` slots of the last forward (one row
    in its own KVCache: a trim). ``keep`` on the device ([B] ints): a RaggedKVCache only."""
    if isinstance(keep, mx.array):
        c.punch_lazy(keep, written)
    elif isinstance(c, RaggedKVCache):
        c.punch(keep, written)
    else:
        c.trim(written - keep[0])


def keep_ragged(cache: list, rec: list, keep: list[int] | mx.array, T: int) -> None:
    """Ragged rollback after a verify of T positions through the capturing walk
    (forward.capture_hidden): row i keeps its first keep[i] positions. Attention layers
    punch holes; each GatedDeltaNet layer takes, per row, the recurrent state after its
    last kept token and the conv window ending there (capture rollback's commit, per row).
    ``keep`` on the device ([B] ints): nothing is read by the host (``punch_lazy``)."""
    lazy = isinstance(keep, mx.array)
    for c in cache:
        if not isinstance(c, ArraysCache):
            keep_kv(c, keep, T)
    if not lazy and min(keep) == T:
        return  # every row kept the whole verify: the capture already left that state
    B = keep.shape[0] if lazy else len(keep)
    last = (keep - 1).astype(mx.int32) if lazy else mx.array([k - 1 for k in keep], dtype=mx.int32)
    for cap in rec:
        states = mx.stack(cap.states, axis=1)  # [B, T, ...]
        idx = last.reshape((B, 1) + (1,) * (states.ndim - 2))
        cap.cache[1] = mx.take_along_axis(states, idx, axis=1)[:, 0]
        window = (last[:, None] + 1 + mx.arange(cap.n_keep)[None, :])[:, :, None]  # [B, n_keep, 1]
        cap.cache[0] = mx.take_along_axis(cap.conv_input, window, axis=1)


class BatchMark:
    """A batch's caches (attention and GatedDeltaNet layers alike) as they are now, to undo a
    cycle issued ahead: ``restore`` puts back each attention layer's offsets, validity, slot
    count and buffers and each recurrent layer's arrays. The cycle was queued to the device
    when it was built, so the slots it wrote past the restored count are stale and written
    over later (rollback.CacheMark's aliases are for forwards built and never run). The host's
    hole count is left as it is: it is counted when a cycle is read, which may come after
    the mark, and it only decides when to compact."""

    FIELDS = ("keys", "values", "offset", "left_padding", "_idx", "valid")

    def __init__(self, caches: list):
        self.saved = [(c, list(c.cache) if isinstance(c, ArraysCache) else {f: getattr(c, f) for f in self.FIELDS})
                      for c in caches]

    def restore(self) -> None:
        for c, saved in self.saved:
            if isinstance(c, ArraysCache):
                c.cache = list(saved)
            else:
                for f, v in saved.items():
                    setattr(c, f, v)
