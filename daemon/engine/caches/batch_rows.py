"""The rows of a continuous batch and their caches: the bookkeeping BatchDecoder (depth 0,
batch.py) and SpecBatchDecoder (speculating, batch_spec.py) share.

Rows are found by id (any hashable: the worker's job key); a decoder keeps the per-row state
it needs on its own row objects, of which this module reads ``row_id`` only.

One row keeps its own plain per-layer caches (KVCache / ArraysCache), so a batch of one runs
the ops a lone request runs (serial numerics). From two rows on, each layer's caches are
merged by the decoder's ``merge_layer`` (mlx-lm's batch caches, or RaggedKVCache), a joining
row is appended with ``extend``, a leaving one dropped with ``filter``; when one row is left
it gets its plain caches back (``extract_layer``).
"""

from __future__ import annotations

from collections.abc import Hashable

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

# The batch heights batch_matches_serial probes; a decoder admits no more rows than this.
DEFAULT_MAX_ROWS = 16


def extract_layer(c, i: int):
    """Row i's own cache of one layer, copied out of the batch's (an ArraysCache's slices
    made contiguous: a strided view would be carried into every later step)."""
    out = c.extract(i)
    if isinstance(out, ArraysCache):
        out.cache = [mx.contiguous(a) if a is not None else None for a in out.cache]
    return out


class RowBatch:
    """Rows by id and the joining and leaving of their caches. A subclass defines
    ``admits`` and may set ``merge_layer`` and ``refusal`` (why ``admits`` said no)."""

    refusal = "this row may not join the batch"

    def __init__(self, max_rows: int):
        self.max_rows = max_rows
        self._rows: list = []

    # ------------------------------------------------------------------ introspection
    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, row_id: Hashable) -> bool:
        return any(r.row_id == row_id for r in self._rows)

    def handle(self, row_id: Hashable) -> RowHandle:
        """The worker's ``generator`` for a batched job: ``close()`` removes the row."""
        return RowHandle(self, row_id)

    @property
    def row_ids(self) -> list:
        return [r.row_id for r in self._rows]

    def _index(self, row_id: Hashable) -> int:
        for i, r in enumerate(self._rows):
            if r.row_id == row_id:
                return i
        raise KeyError(row_id)

    # ------------------------------------------------------------------ joining and leaving
    def admits(self, sampler, exact: bool) -> bool:
        raise NotImplementedError

    def remove(self, row_id: Hashable) -> None:
        raise NotImplementedError

    def _check_join(self, row_id: Hashable, sampler, exact: bool) -> None:
        """Raise ValueError unless a row of this id and kind may join now."""
        if row_id in self:
            raise ValueError(f"row {row_id!r} is already in the batch")
        if not self.admits(sampler, exact):
            raise ValueError(self.refusal)
        if len(self._rows) >= self.max_rows:
            raise ValueError(f"the batch is full ({self.max_rows} rows)")

    @staticmethod
    def merge_layer(c):
        """One row's cache of one layer as a one-row batch cache (mlx-lm's merge)."""
        return type(c).merge([c])

    def _joined(self, batch_cache: list | None, row_cache: list) -> list:
        """The batch's caches with a joining row's appended (called before the row is in
        ``_rows``): the row's own caches while it is the only one."""
        if not self._rows:
            return row_cache
        if len(self._rows) == 1:
            batch_cache = [self.merge_layer(c) for c in batch_cache]
        for bc, c in zip(batch_cache, row_cache):
            bc.extend(self.merge_layer(c))
        return batch_cache

    def _taken_out(self, batch_cache: list, i: int) -> list:
        """Row i's own caches (the batch's own while it has one row)."""
        return batch_cache if len(self._rows) == 1 else [extract_layer(c, i) for c in batch_cache]

    def _drop_row(self, i: int) -> list[int]:
        """Forget row i; returns the indices (as they were) of the rows that stay."""
        del self._rows[i]
        return [j for j in range(len(self._rows) + 1) if j != i]

    @staticmethod
    def _kept(batch_cache: list, keep: list[int]) -> list | None:
        """The batch's caches holding only rows ``keep``: None for none, the survivor's own
        plain caches for one (back to serial numerics), else filtered in place."""
        if not keep:
            return None
        if len(keep) == 1:
            return [extract_layer(c, keep[0]) for c in batch_cache]
        idx = mx.array(keep)
        for c in batch_cache:
            c.filter(idx)
        return batch_cache


class RowHandle:
    """What the worker can store as a batched job's ``generator``: ``close()`` (which
    ``_finish`` already calls) removes the row from the batch; it is never iterated, since
    the decoder's ``step`` advances every row at once."""

    def __init__(self, decoder: RowBatch, row_id: Hashable):
        self.decoder = decoder
        self.row_id = row_id

    def __iter__(self):
        return self

    def __next__(self):
        raise RuntimeError("a batched row is advanced by its decoder's step(), not next()")

    def close(self) -> None:
        if self.row_id in self.decoder:
            self.decoder.remove(self.row_id)
