"""Several prompts' prefill pieces in one forward, so prompts arriving together prefill together.

A lone ``ChunkedPrefill.step()`` forwards one request's piece at batch height 1; on a
device that is mostly idle at that height (a GPU; a small model) B prompts' pieces of the
same length L go through one forward for little more than one costs. ``prefill_together``
does that for parts that each have a piece to run:

- L is the smallest of the parts' next pieces (each cut as its own ``step()`` would cut
  it: chunk size, its ``stops``, what is left; and the caller's ``limit``), so no part ever
  runs past a snapshot stop and every row writes exactly L tokens;
- per layer the rows' caches are merged with mlx-lm's batch caches: attention layers into a
  ``BatchKVCache``, left-padded (rows hold different lengths: other prompts, prefix-cache
  hits); GatedDeltaNet layers stacked on the batch axis, unpadded (every row writes all L
  tokens, so the recurrence needs no mask) — which is also what the chunked recurrence
  takes on CUDA (chunked_prefill.applies, B > 1);
- after the forward each part gets its own plain per-layer caches back, written into its
  cache objects in place (the list and each layer's object stay the ones the caller gave:
  prefix-cache snapshots taken from ``prefill.cache``, and anything else holding them, see
  the same state a lone step leaves), and its hidden states feed its own head history.

Exactness. Batched rows may round differently from one-row forwards (matmul heights, the
padded attention). ``together_matches_solo`` probes it once per model: rows with different
cache lengths and pieces, together vs each alone, every hidden state and cache array
bit-identical. A request that must be exact at temperature 0 prefills together only where
that holds (``may_prefill_together``); "fast" requests and sampled ones always may (the
same rule as batch.BatchDecoder.admits). That covers the forward only: a part whose own
next piece is longer than L is cut, off its chunk grid, just as ``step(limit)`` cuts it, and
where off-grid splits change the numbers (prefix_cache.splits_agree False) that part's state
is no longer its cold run's: the caller applies its ``step(limit)`` rule (compare each
part's ``next_piece()`` with what was forwarded), or groups parts by ``common_piece``.
"""

from __future__ import annotations

import copy
import random
import time

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache

from ..caches.batch_rows import DEFAULT_MAX_ROWS, extract_layer
from ..kernels.forward import cache_arrays
from ..model.model import LoadedModel
from ..pieces import pause
from .cost_pairs import paired_median
from .prefill import ChunkedPrefill

# Piece lengths the probe forwards; a piece of chunked_prefill.MIN_T is added where the
# chunked recurrence is on (it only takes pieces that long).
PROBE_PIECES = (1, 9)
# Tokens already in the probe rows' caches (row i takes PROBE_PREFIXES[i % 4]): fresh rows
# and prefix-cache hits side by side, so the attention caches carry left padding.
PROBE_PREFIXES = (0, 3, 11, 6)


def prefill_together(parts: list[ChunkedPrefill], limit: int | None = None) -> list[int]:
    """Advance each part by one piece of the same length in one batched forward; returns
    the tokens forwarded per part (all equal). One part: its own ``step(limit)``, serial
    numerics. Raises ValueError for no parts, a finished one, one given twice, parts of
    different models, or caches of kinds the batch caches do not merge."""
    _check(parts)
    if len(parts) == 1:
        return [parts[0].step(limit)]
    L = common_piece(parts, limit)
    for p in parts:
        p.check_head()
    tokens = mx.stack([p.piece_ids(L) for p in parts])
    h = forward_rows(parts[0].lm, [p.cache for p in parts], tokens)
    arrays = []
    for i, p in enumerate(parts):
        arrays += [c.state for c in p.cache] + p.absorb(h[i : i + 1], L)
    mx.eval(arrays)  # one evaluation for every row: the forward, the extracts, each head feed
    return [L] * len(parts)


def common_piece(parts: list[ChunkedPrefill], limit: int | None = None) -> int:
    """The piece length ``prefill_together(parts, limit)`` forwards: the shortest of the
    parts' next pieces (0 if one is done)."""
    return min(p.next_piece(limit) for p in parts)


def forward_rows(lm: LoadedModel, caches: list[list], tokens: mx.array) -> mx.array:
    """Row i of ``tokens`` [B, L] continues ``caches[i]`` (plain per-layer caches), all in one
    forward; each row's cache objects are updated in place. Returns the hidden states
    [B, L, H], lazy."""
    merged = [_merge(list(layer)) for layer in zip(*caches)]
    h = lm.prefill_hidden(tokens, merged)  # the chunked recurrence where it is on and applies
    for i, cache in enumerate(caches):
        for dst, batch in zip(cache, merged):
            _write_back(dst, extract_layer(batch, i))
    return h


def _merge(layer: list):
    """One layer's per-row caches as one batch cache."""
    if type(layer[0]) is KVCache:
        return BatchKVCache.merge(layer)  # left-padded to the longest row
    merged = ArraysCache.merge(layer)  # rows without state yet get zeros, as their first forward would
    merged.left_padding = None  # every row writes all L tokens: no padding, no mask
    return merged


def _write_back(dst, row) -> None:
    """Put a row's extracted state into its own cache object (same object, as a lone step)."""
    if isinstance(dst, KVCache):
        dst.keys, dst.values, dst.offset = row.keys, row.values, row.offset
    else:
        dst.cache = row.cache


def _check(parts: list[ChunkedPrefill]) -> None:
    if not parts:
        raise ValueError("prefill_together needs at least one part")
    if len({id(p) for p in parts}) != len(parts):
        raise ValueError("a part was given twice: each part forwards one piece per call")
    lm = parts[0].lm
    for i, p in enumerate(parts):
        if p.done:
            raise ValueError(f"part {i} has finished its prefill (nothing left to forward)")
        if p.lm is not lm:
            raise ValueError(f"part {i} belongs to another model: rows of one forward share the weights")
        if len(p.cache) != len(parts[0].cache):
            raise ValueError(f"part {i} has {len(p.cache)} cache layers, part 0 has {len(parts[0].cache)}")
        if len(parts) > 1:
            for c in p.cache:
                plain_arrays = type(c) is ArraysCache and c.left_padding is None and c.lengths is None
                if type(c) is not KVCache and not plain_arrays:
                    raise ValueError(f"part {i} holds a {type(c).__name__}: only plain KVCache and ArraysCache "
                                     "layers merge into a batch")
    for c0, *rest in zip(*[p.cache for p in parts]):
        if any(type(c) is not type(c0) for c in rest):
            raise ValueError("parts' caches differ in their layers' kinds")


# ---------------------------------------------------------------------- admission and probe


def may_prefill_together(exact: bool, greedy: bool, matches_solo: bool) -> bool:
    """Whether a request may prefill with others: all but an exact (mode exact/off)
    temperature-0 request on a backend where ``together_matches_solo`` is False."""
    return not (exact and greedy) or matches_solo


def max_prefill_diff(lm: LoadedModel, heights=(2, 3, 4), pieces=PROBE_PIECES, seed: int = 0) -> dict[int, float]:
    """Per batch height, the largest |together - alone| over every piece's hidden states and
    every cache array after it. Rows hold different cache lengths (PROBE_PREFIXES) and
    forward different tokens; each height runs ``pieces`` one after another, the together
    rows continuing their together caches, the lone rows theirs. A pause after every forward
    (engine/pieces.py): a request that arrives mid-check waits for one forward, not a height's
    B + 1 (its pieces reached 163-173 ms on this CPU at 8 rows; on an H100 a council's first
    prompts waited for an 84 ms piece of this part, bench/results/h100_2026-12-07d)."""
    V = lm.text_args.vocab_size
    out = {}
    for B in heights:
        rng = random.Random(seed * 1000 + B)
        solo = []
        for i in range(B):
            cache = lm.make_cache()
            prefix = PROBE_PREFIXES[i % len(PROBE_PREFIXES)]
            if prefix:
                lm.prefill_hidden(mx.array([[rng.randrange(V) for _ in range(prefix)]], dtype=mx.uint32), cache)
                mx.eval([c.state for c in cache])
                pause()
            solo.append(cache)
        together = [copy.deepcopy(c) for c in solo]
        worst = 0.0
        for L in pieces:
            tokens = mx.array([[rng.randrange(V) for _ in range(L)] for _ in range(B)], dtype=mx.uint32)
            h_solo = []
            for i in range(B):
                h_solo.append(lm.prefill_hidden(tokens[i : i + 1], solo[i]))
                mx.eval(h_solo[-1], [c.state for c in solo[i]])
                pause()
            h_together = forward_rows(lm, together, tokens)
            mx.eval(h_together, [c.state for cache in together for c in cache])
            diffs = [_diff(h_solo[i][0], h_together[i]) for i in range(B)]
            for a, b in zip(solo, together):
                diffs += [_diff(x, y) for x, y in zip(cache_arrays(a), cache_arrays(b), strict=True)]
            worst = max(worst, mx.max(mx.stack(diffs)).item())  # one wait for the device, not one a diff
            pause()
        out[B] = worst
    return out


def together_matches_solo(lm: LoadedModel, max_rows: int = DEFAULT_MAX_ROWS) -> bool:
    """True when prefilling rows together leaves, on this backend, hidden states and caches
    bit-identical to each row alone (probed once per model, heights 2..``max_rows``, and per
    prefill path: the chunked recurrence's verdict is its own)."""
    probed = lm.__dict__.setdefault("_prefill_together_matches_solo", {})
    key = (max_rows, lm.chunked_prefill)
    if key not in probed:
        from ..kernels.chunked_prefill import MIN_T

        heights = sorted({h for h in (2, 3, 4, max_rows) if 2 <= h <= max_rows})
        pieces = PROBE_PIECES + ((MIN_T,) if lm.chunked_prefill else ())
        # One layer of each kind answers for the model (LoadedModel.layer_kinds_view).
        probed[key] = all(d == 0.0 for d in max_prefill_diff(lm.layer_kinds_view(), heights, pieces).values())
    return probed[key]


def together_cost_ratio(lm: LoadedModel, rows: int, piece: int = 16, reps: int = 2, seed: int = 0) -> float:
    """What one forward of ``rows`` fresh rows x ``piece`` tokens costs, over one row's: the
    median of ``reps`` paired timings, after one untimed run of each (first-use compiles).
    Small pieces: a tail's size, and a start-up cost of ~0.3 s on this CPU.
    Where the device is idle at one row (a GPU, a small model) this is near 1; where a
    forward is compute-bound (a CPU) near ``rows``."""
    rng = random.Random(seed)
    V = lm.text_args.vocab_size

    def seconds(B: int) -> float:
        caches = [lm.make_cache() for _ in range(B)]
        tokens = mx.array([[rng.randrange(V) for _ in range(piece)] for _ in range(B)], dtype=mx.uint32)
        t0 = time.perf_counter()
        h = lm.prefill_hidden(tokens, caches[0]) if B == 1 else forward_rows(lm, caches, tokens)
        mx.eval(h, [c.state for cache in caches for c in cache])
        return time.perf_counter() - t0

    return paired_median(lambda: seconds(rows), lambda: seconds(1), reps)


def together_pays(ratio: float, rows: int) -> bool:
    """Whether prompts should share forwards at this cost ratio: together, every one of
    ``rows`` prompts waits for the one forward (``ratio`` one-row forwards); one after
    another, the k-th waits k. Together pays on average when ratio < (rows + 1) / 2. (On
    this CPU the bundled model's 4 rows cost 3.1-3.2: a council's time to first token rose
    1.8x with rows together while its tokens per second rose 1.2x, bench/results/README.md.)"""
    return ratio < (rows + 1) / 2


def _diff(a: mx.array, b: mx.array) -> mx.array:
    """The largest |a - b| as a float32 scalar, not read yet (inf where the shapes differ)."""
    if a.shape != b.shape:
        return mx.array(float("inf"), dtype=mx.float32)
    return mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max()
