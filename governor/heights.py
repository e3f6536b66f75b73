"""Batch heights, bucketed: the governor learns cost and chooses depth per bucket, not per
exact height.

A batched cycle's cost depends on how many rows it verifies (measured on the H200, 27B
shape: 4 rows x 2 positions cost 3.28 steps, 8 x 2 cost 4.66; on the CPU the forward is
compute-bound and grows with every position). Heights next to each other cost about the
same per row, and a council changes its height by one often (a request ends, another joins),
so one table entry per exact height would split the samples thin and learn each height
afresh. Buckets: 1 (solo), 2, 3-4, 5-8, 9+: doubling, since a forward's cost grows roughly
with the log of its rows on a GPU until it turns compute-bound.

Bucket 0 (height 1) is the governor's solo depth (``State.depth``); buckets 1.. are the
batched ones (``State.heights``).
"""

from __future__ import annotations

# The largest height of each bucket; the last bucket is open-ended.
BUCKET_TOPS: tuple[int, ...] = (1, 2, 4, 8)
N_BUCKETS = len(BUCKET_TOPS) + 1


def bucket_of(height: int) -> int:
    """The bucket index of a batch height (heights below 1 count as 1)."""
    for i, top in enumerate(BUCKET_TOPS):
        if height <= top:
            return i
    return len(BUCKET_TOPS)


def bucket_top(b: int) -> int:
    """A height that falls in bucket b, its largest (the open last bucket: its smallest), as
    a profile's ``batch_cost_s`` and learned ``depths`` key the bucket."""
    return BUCKET_TOPS[b] if b < len(BUCKET_TOPS) else BUCKET_TOPS[-1] + 1


def bucket_label(b: int) -> str:
    """'1', '2', '3-4', '5-8', '9+'."""
    lo = 1 if b == 0 else BUCKET_TOPS[b - 1] + 1
    if b >= len(BUCKET_TOPS):
        return f"{lo}+"
    hi = BUCKET_TOPS[b]
    return str(hi) if lo == hi else f"{lo}-{hi}"


def depth_at(heights: tuple[int | None, ...], solo_depth: int, height: int) -> int:
    """The depth wanted at ``height`` from a per-bucket table (index = bucket - 1; None: not
    chosen yet). A bucket not chosen yet takes the nearest chosen bucket's depth (ties to the
    lower), else the solo depth: a neighbouring height's measured choice is a better first
    guess than one row's (the replay: a council of 4 that started at the solo depth spent 5%
    of its regime climbing to where the council of 2 already was), and the first cycles
    there are that depth's measurement, which the bucket then adopts or leaves."""
    b = bucket_of(height)
    if b == 0:
        return solo_depth
    chosen = [(abs(i + 1 - b), i, k) for i, k in enumerate(heights) if k is not None]
    if not chosen:
        return solo_depth
    return min(chosen)[2]
