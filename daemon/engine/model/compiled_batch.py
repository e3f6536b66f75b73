"""The compiled step's self-check for batches: B rows decoded and verified together.

``compiled.CompiledDecode`` runs a batch of B rows through the same traced layers as one
row (``compiled.py`` says what is compiled and why); it is used for B >= 2 only once this
check finds it bit-identical to the eager forward on the two kinds of batch the daemon runs:

- the plain batch (batch.py): rows of different prompt lengths prefilled alone, merged into
  mlx-lm's left-padded ``BatchKVCache`` and stacked ``ArraysCache``; a few greedy one-token
  steps;
- the speculating batch (batch_spec.py): the same rows merged into ``RaggedKVCache`` (a
  verify's rejected slots become holes); a capturing verify of ``VERIFY_T`` positions, a
  ragged keep (every row a different prefix: holes in the attention KV, per-row gathers of
  the GatedDeltaNet states), a one-token step through the holes (the batch at depth 0),
  then a second capturing verify and keep.

Every hidden state, every per-token recurrent state the captures recorded and every cache
array at the end are compared, eager against compiled, at each height of ``HEIGHTS``.
Other heights run traces of the same code at another batch size: what a trace fuses is
elementwise (mx.compile fuses no reduction and no matmul), each element computed on its
own, so the batch size does not enter its rounding. The check answers for the traced code;
the start-up probes after it (batch.batch_matches_serial, exactness.ragged_verify_matches_
serial) then ask whether a batched row equals a serial one, through whichever path won.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache

from ..caches.ragged_cache import RaggedKVCache, keep_ragged
from ..pieces import pause
from .capture import capture_hidden

HEIGHTS = (2, 3)  # an even and an odd height: ~0.5 s for both, both ways, bundled model on this CPU
STEPS = 3  # one-token steps of the plain batch
VERIFY_T = 4  # the speculating batch's verify length (depth 3)


def _rows(lm, B: int) -> list[list]:
    """B rows' own caches, prefilled alone (eagerly: the first steps of an empty cache are
    eager anyway); row i holds 2 + 3 i tokens, so every batch carries left padding."""
    vocab = lm.text_args.vocab_size
    rows = []
    for i in range(B):
        cache = lm.make_cache()
        lm.backbone(mx.array([[(7 * j + 11 * i + 3) % vocab for j in range(2 + 3 * i)]], dtype=mx.uint32), cache)
        mx.eval([c.state for c in cache])
        rows.append(cache)
    return rows


def _merged(rows: list[list], ragged: bool) -> list:
    """Copies of the rows' caches merged as the plain batch (left-padded BatchKVCache) or
    the speculating one (RaggedKVCache) does."""
    out = []
    for layer in zip(*copy.deepcopy(rows)):
        if isinstance(layer[0], ArraysCache):
            m = ArraysCache.merge(list(layer))
            m.left_padding = None  # merged from filled states: no mask (SpecBatchDecoder.merge_layer)
        else:
            m = RaggedKVCache.merge(list(layer)) if ragged else BatchKVCache.merge(list(layer))
        out.append(m)
    return out


def _arrays(cache: list) -> list[mx.array]:
    """Every array a batch cache holds, KV cut to its written slots."""
    out = []
    for c in cache:
        if isinstance(c, ArraysCache):
            out += [mx.array(x) for x in c.cache if x is not None]
        else:
            out += [mx.array(x[..., : c._idx, :]) for x in (c.keys, c.values)]
            out += [mx.array(c.offset)] + ([mx.array(c.valid)] if getattr(c, "valid", None) is not None else [])
    return out


def _greedy(lm, h: mx.array) -> mx.array:
    return mx.argmax(lm.logits(h)[:, -1, :], axis=-1).reshape(-1, 1).astype(mx.uint32)


def _plain(lm, rows: list[list], forward: Callable) -> list[mx.array]:
    B = len(rows)
    cache = _merged(rows, ragged=False)
    tok = mx.array([[5 + i] for i in range(B)], dtype=mx.uint32)
    out = []
    for _ in range(STEPS):
        h = forward(tok, cache, None)
        tok = _greedy(lm, h)
        mx.eval(h, tok)
        out.append(h)
    return out + _arrays(cache)


def _speculating(lm, rows: list[list], forward: Callable) -> list[mx.array]:
    B = len(rows)
    cache = _merged(rows, ragged=True)
    V = lm.text_args.vocab_size
    block = mx.array([[(13 * i + 17 * t + 2) % V for t in range(VERIFY_T)] for i in range(B)], dtype=mx.uint32)
    out = []
    for cycle in range(2):
        rec: list = []
        h = forward(block, cache, rec)
        out += [h] + [s for cap in rec for s in cap.states]
        keep = [1 + (i + cycle) % VERIFY_T for i in range(B)]  # every row its own prefix
        keep_ragged(cache, rec, keep, VERIFY_T)
        mx.eval(out, [c.state for c in cache])
        if cycle == 0:
            h = forward(_greedy(lm, h), cache, None)  # depth 0 through the holes
            out.append(h)
            mx.eval(h)
        block = (block + 1) % V
    return out + _arrays(cache)


def batch_self_check(lm, compiled, heights: tuple[int, ...] = HEIGHTS) -> str | None:
    """None when the compiled batched forwards reproduce the eager ones bit for bit, else
    the first difference. ``compiled`` must admit batches (``batched`` True) while it runs."""

    def forward(use_compiled: bool) -> Callable:
        def run(tokens: mx.array, cache: list, rec: list | None) -> mx.array:
            if use_compiled and not compiled.applies(tokens, cache):
                raise RuntimeError(f"the compiled step declined a batched forward of shape {tuple(tokens.shape)}")
            saved = lm.compiled_decode
            lm.compiled_decode = compiled if use_compiled else None
            try:
                return lm.hidden(tokens, cache) if rec is None else capture_hidden(lm, tokens, cache, rec)
            finally:
                lm.compiled_decode = saved

        return run

    for B in heights:
        rows = _rows(lm, B)
        for what, run in (("plain batch", _plain), ("speculating batch", _speculating)):
            eager = run(lm, rows, forward(False))
            pause()  # between the arms: forward() has put the step back
            comp = run(lm, rows, forward(True))
            pause()
            for i, (a, b) in enumerate(zip(eager, comp, strict=True)):
                if a.shape != b.shape or not mx.array_equal(a, b).item():
                    diff = "shape" if a.shape != b.shape else \
                        f"up to {mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item():.3g}"
                    return f"{what} B={B}, array {i}: compiled differs from eager ({diff})"
    return None
