"""Does a speculative verify compute what serial decode computes, bit for bit, here?

Exact mode promises serial's tokens at temperature 0. Speculation keeps that promise by
construction only where a verify forward of T tokens gives the same logits and leaves the
same cache as T one-token steps. On CPU it does (the fidelity gate: 0 deviation). On the
H200 (MLX on CUDA) it does not: matmuls of 2-5 rows run other kernels than the one-row
ones, and the rounding differences live on in the committed cache, so a later near-tie can
fall the other way even when the exact guard re-decides it serially (bench/results:
fidelity_h200_*: 1 prompt in 10, 1.6-1.7 flips per 1000 tokens, with and without the
compiled path). The guard bounds the rate; it cannot make it zero.

``verify_matches_serial`` probes it once per model and rollback strategy: a few short
prompts, T one-token steps against one T-token verify through the strategy (capture: the
per-token states; snapshot: the plain forward and the prefix re-forward), comparing every
position's logits and the caches after a full and after a partial accept. The worker uses
it to decide what an exact temperature-0 request gets on this backend
(``speculation.exact_on_inexact_backend``).

``ragged_verify_matches_serial`` probes the batched form (batch_spec.py): rows of
different lengths verified together, each keeping a different prefix (holes in the
attention KV, per-row GatedDeltaNet gathers), then verified again through the holes; every
row's logits must equal its own one-token steps. Exact rows batch-speculate only then.
"""

from __future__ import annotations

import random

import mlx.core as mx

from mlx_lm.models.cache import ArraysCache

from ..caches.ragged_cache import RaggedKVCache, keep_ragged
from ..kernels.forward import cache_arrays
from ..model.capture import capture_hidden
from ..pieces import pause
from .rollback import make_rollback

PROBE_T = 4  # verify length probed (depth 3); shorter ones use the same kernels here
PROBE_LENGTHS = (7, 33)


def _same(a: list[mx.array], b: list[mx.array]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and mx.array_equal(x, y).item() for x, y in zip(a, b))


def verify_matches_serial(lm, strategy: str, seed: int = 0) -> bool:
    """True when a T-token verify through ``strategy`` equals T serial steps bit for bit
    (logits at every position; caches after a full and a partial accept). Cached on ``lm``."""
    probed = lm.__dict__.setdefault("_verify_matches_serial", {})
    if strategy in probed:
        return probed[strategy]
    lm = lm.layer_kinds_view()  # what holds for one layer of each kind holds for the model
    rng = random.Random(seed)
    V = lm.text_args.vocab_size
    ok = True
    for n in PROBE_LENGTHS:
        prompt = [rng.randrange(V) for _ in range(n)]
        block = [rng.randrange(V) for _ in range(PROBE_T)]

        def fresh() -> list:
            cache = lm.make_cache()
            lm.hidden(mx.array([prompt], dtype=mx.uint32), cache)
            mx.eval([c.state for c in cache])
            pause()
            return cache

        cache = fresh()
        serial_logits, after = [], {}
        for i, tok in enumerate(block):
            lg = lm.logits(lm.hidden(mx.array([[tok]], dtype=mx.uint32), cache))[0, -1]
            mx.eval(lg)
            serial_logits.append(lg)
            if i + 1 in (2, PROBE_T):
                after[i + 1] = cache_arrays(cache)

        for keep in (PROBE_T, 2):
            cache = fresh()
            rb = make_rollback(strategy, lm, cache)
            logits = lm.logits(rb.forward(mx.array([block], dtype=mx.uint32)))[0]
            mx.eval(logits)
            if not all(mx.array_equal(logits[i], serial_logits[i]).item() for i in range(PROBE_T)):
                ok = False
            rb.commit(keep)
            if not _same(cache_arrays(cache), after[keep]):
                ok = False
            pause()
        if not ok:
            break
    probed[strategy] = ok
    return ok


def exact_guard(lm, strategy: str, configured: float) -> float | None:
    """The near-tie guard exact mode needs on this backend: None (no guard) where a verify
    through ``strategy`` is bit-identical to serial steps, else ``configured``.

    Where the verify's logits equal serial's bit for bit, its argmax at every position is
    serial's argmax, and re-deciding a near tie with a one-token forward computes the same
    logits again: the guard cannot change a token there, it only costs a serial step per
    near tie (about 17% of depth-1 cycles on the bundled model). Where the probe
    finds a difference, the guard stays: it bounds the flips that difference can cause."""
    from .speculative import resolve_rollback

    return None if verify_matches_serial(lm, resolve_rollback(strategy)) else configured


def ragged_verify_matches_serial(lm, seed: int = 0) -> bool:
    """True when a batched verify with ragged acceptance gives every row serial's logits,
    bit for bit: two verifies of three rows (prompt lengths 7, 33 and 1), the first keeping
    1, 3 and 2 of its 3 positions. Cached on ``lm``."""
    probed = lm.__dict__.setdefault("_ragged_verify_matches_serial", None)
    if probed is not None:
        return probed
    model, lm = lm, lm.layer_kinds_view()  # what holds for one layer of each kind holds for the model
    rng = random.Random(seed)
    V = lm.text_args.vocab_size
    rows = [([rng.randrange(V) for _ in range(n)], [rng.randrange(V) for _ in range(5)]) for n in (7, 33, 1)]
    keep = [1, 3, 2]

    def prefilled(prompt: list[int]) -> list:
        cache = lm.make_cache()
        if len(prompt) > 1:
            lm.hidden(mx.array([prompt[:-1]], dtype=mx.uint32), cache)
        mx.eval([c.state for c in cache])
        return cache

    # Serial: one-token steps over the last prompt token, the kept block, then two more.
    want = []
    for (prompt, block), kept in zip(rows, keep):
        cache = prefilled(prompt)
        seq = [prompt[-1]] + block[: kept - 1] + block[3:5]
        want.append([lm.logits(lm.hidden(mx.array([[t]], dtype=mx.uint32), cache))[0, -1] for t in seq])
        mx.eval(want[-1])
        pause()
    # Batched: verify [last, b1, b2] for every row, keep a ragged prefix, verify [b4, b5].
    caches = [prefilled(p) for p, _ in rows]
    pause()
    merged = []
    for layer in zip(*caches):
        if isinstance(layer[0], ArraysCache):
            m = ArraysCache.merge(list(layer))
            m.left_padding = None
        else:
            m = RaggedKVCache.merge(list(layer))
        merged.append(m)
    first = mx.array([[p[-1]] + b[:2] for p, b in rows], dtype=mx.uint32)
    rec: list = []
    got1 = lm.logits(capture_hidden(lm, first, merged, rec))
    keep_ragged(merged, rec, keep, 3)
    got2 = lm.logits(capture_hidden(lm, mx.array([b[3:5] for _, b in rows], dtype=mx.uint32), merged, []))
    ok = True
    for i, kept in enumerate(keep):
        got = [got1[i, j] for j in range(kept)] + [got2[i, 0], got2[i, 1]]
        ok = ok and all(mx.array_equal(g, w).item() for g, w in zip(got, want[i]))
    model.__dict__["_ragged_verify_matches_serial"] = ok
    return ok
