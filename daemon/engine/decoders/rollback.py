"""Sound rollback of a hybrid model's cache after a partially accepted verify.

Layers are of two kinds:
- gated full attention: ``KVCache``, trimmable (``trim(n)`` just lowers ``offset``; later
  writes overwrite the stale slots);
- GatedDeltaNet: ``ArraysCache`` holding [conv_state, recurrent_state]. Not trimmable: a
  recurrent state cannot be un-applied.

Two strategies, same interface (``forward`` the verify tokens, then ``commit(keep)`` to
leave exactly the first ``keep`` of them in the cache):

- ``SnapshotRollback`` ("snapshot"): before the verify, keep references to every
  ArraysCache's arrays (MLX arrays are immutable and the GDN layer rebinds its slots, so a
  reference *is* a snapshot, at no cost) and each KVCache's offset. On a partial accept,
  rebind the references, trim the KVs, and re-forward the accepted prefix.
- ``CaptureRollback`` ("capture"): run the verify through a capturing variant of the
  GatedDeltaNet forward that keeps the conv input (whose sliding window gives the conv state
  after every position) and the recurrent state after every token. Commit the state at
  the last kept index; no re-forward.

The verify forwards themselves (plain and capturing, eager and compiled) are in
``forward.py``. The model's position is read from an attention layer's ``KVCache.offset``
(``attention_offset``), never from a linear layer's cache slot.

dtype discipline: the recurrent state is float32; what the capturing GDN block returns to
the residual stream is in the activation dtype (the per-token readout is cast back, as in
mlx-lm's ops path), so verify never promotes the residual stream to float32.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache

from ..kernels.forward import _Capture
from ..model.capture import capture_hidden
from ..model.model import LoadedModel

STRATEGIES = ("capture", "snapshot")


def attention_offset(cache: list) -> int:
    """The model's position: the offset of the first attention layer's KVCache."""
    for c in cache:
        if isinstance(c, KVCache) or (hasattr(c, "offset") and not isinstance(c, ArraysCache)):
            return c.offset
    raise ValueError("no attention layer in this cache: the position is unknown")


@dataclass
class Snapshot:
    arrays: list[tuple[ArraysCache, list]] = field(default_factory=list)
    offsets: list[tuple[Any, int]] = field(default_factory=list)

    @classmethod
    def take(cls, cache: list) -> "Snapshot":
        s = cls()
        for c in cache:
            if isinstance(c, ArraysCache):
                s.arrays.append((c, list(c.cache)))
            elif hasattr(c, "offset"):
                s.offsets.append((c, c.offset))
            else:  # pragma: no cover - unknown cache kinds are refused up front
                raise TypeError(f"cannot snapshot a {type(c).__name__}")
        return s

    def restore(self) -> None:
        for c, arrays in self.arrays:
            c.cache = list(arrays)
        for c, off in self.offsets:
            c.trim(c.offset - off)


class CacheMark:
    """Every slot of some caches as it is now, to undo forwards that were built but never run.

    ``Snapshot`` suffices once a forward has run (a KV slot past the offset is overwritten
    later). A forward that was only built has already rebound the KV buffers: mlx-lm writes
    them by slice assignment, which replaces the array object's graph in place, so the next
    evaluation reading the buffer would still compute the unrun forward. The mark keeps
    aliases of the buffers as they were (``mx.stop_gradient``: a new array object on the
    same data, no copy). Drop the mark before the built forward runs, or the aliases keep
    it from writing the buffer in place (it would copy the buffer instead)."""

    def __init__(self, caches: list):
        self.arrays: list[tuple[ArraysCache, list]] = []
        self.kv: list[tuple[Any, int, Any, Any]] = []
        for c in caches:
            if isinstance(c, ArraysCache):
                self.arrays.append((c, list(c.cache)))
            elif isinstance(c, KVCache):
                alias = lambda x: None if x is None else mx.stop_gradient(x)  # noqa: E731
                self.kv.append((c, c.offset, alias(c.keys), alias(c.values)))
            else:  # pragma: no cover - unknown cache kinds are refused up front
                raise TypeError(f"cannot mark a {type(c).__name__}")

    def restore(self) -> None:
        for c, arrays in self.arrays:
            c.cache = list(arrays)
        for c, off, k, v in self.kv:
            c.offset, c.keys, c.values = off, k, v


def check_cache(cache: list) -> None:
    for c in cache:
        if not isinstance(c, (ArraysCache, KVCache)):
            raise TypeError(f"speculation needs ArraysCache/KVCache layers, got {type(c).__name__}")
        if isinstance(c, ArraysCache) and (c.lengths is not None or c.left_padding is not None):
            raise ValueError("speculation runs one unpadded sequence per cache")


# -- strategies ----------------------------------------------------------------------------------


class SnapshotRollback:
    """(a) snapshot before verify; on partial accept restore and re-forward the prefix."""

    name = "snapshot"

    def __init__(self, lm: LoadedModel, cache: list):
        self.lm, self.cache = lm, cache
        self.tokens: mx.array | None = None
        self.snap: Snapshot | None = None
        self.refed = 0  # tokens re-forwarded so far (telemetry)

    def forward(self, tokens: mx.array) -> mx.array:
        """tokens [1, T] -> final-normed hidden [1, T, H]; the cache advances by T."""
        self.snap = Snapshot.take(self.cache)
        self.tokens = tokens
        return self.lm.hidden(tokens, self.cache)

    def detach(self) -> tuple:
        """Take this verify's record away (a verify built after it starts a new one)."""
        out, self.tokens, self.snap = (self.tokens, self.snap), None, None
        return out

    def attach(self, record: tuple) -> None:
        """Give back a record from ``detach`` (the cache restored to just after its verify)."""
        self.tokens, self.snap = record

    def commit(self, keep: int) -> None:
        """Leave exactly the first ``keep`` verify tokens in the cache."""
        tokens, snap = self.tokens, self.snap
        self.tokens = self.snap = None  # hold no stale state past the commit
        if keep == tokens.shape[1]:
            return
        snap.restore()
        if keep > 0:
            self.lm.hidden(tokens[:, :keep], self.cache)
            self.refed += keep


class CaptureRollback:
    """(b) per-token state capture during verify; commit the state at the last kept index."""

    name = "capture"

    def __init__(self, lm: LoadedModel, cache: list):
        self.lm, self.cache = lm, cache
        self.rec: list[_Capture] = []
        self.T = 0
        self.snap: Snapshot | None = None

    def forward(self, tokens: mx.array) -> mx.array:
        self.snap = Snapshot.take(self.cache)
        self.rec = []
        self.T = tokens.shape[1]
        return capture_hidden(self.lm, tokens, self.cache, self.rec)

    def detach(self) -> tuple:
        out, self.rec, self.snap = (self.rec, self.snap, self.T), [], None
        return out

    def attach(self, record: tuple) -> None:
        self.rec, self.snap, self.T = record

    def commit(self, keep: int) -> None:
        rec, snap = self.rec, self.snap
        self.rec, self.snap = [], None  # hold no per-token states past the commit
        if keep == self.T:
            return
        if keep == 0:
            snap.restore()
            return
        for c, off in snap.offsets:
            c.trim(c.offset - (off + keep))
        for cap in rec:
            cap.cache[0] = mx.contiguous(cap.conv_input[:, keep : keep + cap.n_keep, :])
            cap.cache[1] = cap.states[keep - 1]


def make_rollback(strategy: str, lm: LoadedModel, cache: list):
    if strategy == "capture":
        return CaptureRollback(lm, cache)
    if strategy == "snapshot":
        return SnapshotRollback(lm, cache)
    raise ValueError(f"unknown rollback strategy {strategy!r} (one of {', '.join(STRATEGIES)})")
