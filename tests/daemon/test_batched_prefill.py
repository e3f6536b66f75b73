"""Several prompts' prefill pieces in one forward (daemon/engine/prefill/batched_prefill.py) vs each
ChunkedPrefill stepping alone: caches, head histories and hidden states bit-identical on
this CPU backend, pieces cut at every part's stops, continuations serial decode's."""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest

mx = pytest.importorskip("mlx.core")

from daemon.engine.prefill import batched_prefill as bp  # noqa: E402
from daemon.engine.kernels import chunked_prefill as cp  # noqa: E402
from daemon.engine.kernels.forward import cache_arrays  # noqa: E402
from daemon.engine.model.mtp_head import load_mtp_head  # noqa: E402
from daemon.engine.prefill.prefill import ChunkedPrefill  # noqa: E402
from daemon.engine.decoders.sampling import Sampler  # noqa: E402
from daemon.engine.decoders.serial import serial_decode  # noqa: E402
from daemon.engine.caches.head_history import HeadHistory  # noqa: E402
from daemon.engine.decoders.speculative import speculative_decode  # noqa: E402
from daemon.engine.types import SamplingParams  # noqa: E402

N = 12


@pytest.fixture(scope="module")
def head(tiny):
    return load_mtp_head(tiny)


def tokens(lm, n, seed):
    rng = random.Random(seed)
    return [rng.randrange(1, lm.text_args.vocab_size) for _ in range(n)]


# (prompt length, chunk, tokens already in the cache (a prefix-cache hit), head history?, stops)
ROWS = [
    (45, 16, 0, True, (21, 30)),
    (37, 8, 13, False, ()),
    (60, 32, 0, False, (7,)),
    (29, 16, 5, True, (17,)),
]


def make_parts(lm, head, rows=ROWS, solo_steps=(0, 0, 1, 0)):
    """The same parts every call: each row's prompt, its cache holding ``start`` tokens
    already (prefilled alone), some advanced alone by a step first (uneven positions)."""
    parts = []
    for i, (n, chunk, start, with_head, stops) in enumerate(rows):
        prompt = tokens(lm, n, seed=i)
        cache = lm.make_cache()
        if start:
            lead = ChunkedPrefill(lm, prompt[: start + 1], start, cache)
            lead.step()
        history = HeadHistory(head) if with_head else None
        p = ChunkedPrefill(lm, prompt, chunk, cache, history, start=start, stops=stops)
        for _ in range(solo_steps[i]):
            p.step()
        parts.append(p)
    return parts


def state(p: ChunkedPrefill) -> list:
    out = cache_arrays(p.cache)
    if p.history is not None:
        out += [mx.array(x) for x in p.history.state()] + [mx.array(x) for x in p.history.h + p.history.t]
    return out


def assert_same(a: ChunkedPrefill, b: ChunkedPrefill):
    assert a.pos == b.pos and (a.history is None) == (b.history is None)
    if a.history is not None:
        assert a.history.n == b.history.n and a.history.offset == b.history.offset
    sa, sb = state(a), state(b)
    assert len(sa) == len(sb)
    for x, y in zip(sa, sb):
        assert x.shape == y.shape and x.dtype == y.dtype and mx.array_equal(x, y).item()


def run_together(parts, limit=None):
    """Prefill every part to its end together (a row leaves when it is done); returns
    the pieces forwarded, and each part's positions after each of its pieces."""
    pieces, seen = [], [[] for _ in parts]
    while True:
        active = [i for i, p in enumerate(parts) if not p.done]
        if not active:
            return pieces, seen
        got = bp.prefill_together([parts[i] for i in active], limit)
        assert len(set(got)) == 1 and got[0] >= 1
        pieces.append(got[0])
        for i in active:
            seen[i].append(parts[i].pos)


@pytest.mark.quick
def test_together_leaves_each_parts_solo_state_bit_for_bit(tiny, head):
    """Rows of different cache lengths, with and without a head history, with stops: after
    every together step each part holds what stepping it alone by the same piece leaves."""
    together, solo = make_parts(tiny, head), make_parts(tiny, head)
    caches_before = [(p.cache, list(p.cache)) for p in together]
    while any(not p.done for p in together):
        active = [i for i, p in enumerate(together) if not p.done]
        (L, *_) = bp.prefill_together([together[i] for i in active])
        for i in active:
            assert solo[i].step(limit=L) == L
            assert_same(together[i], solo[i])
    for p in solo:
        assert p.done and p.step() == 0
    for (lst, objs), p in zip(caches_before, together):  # the caller's cache list and layer objects
        assert p.cache is lst and all(a is b for a, b in zip(p.cache, objs))


@pytest.mark.quick
def test_pieces_respect_every_parts_stops_chunk_and_limit(tiny, head):
    parts = make_parts(tiny, head)
    starts = [p.pos for p in parts]
    pieces, seen = run_together(parts, limit=12)
    assert max(pieces) <= 12
    for (n, chunk, _, _, stops), p, pos0, positions in zip(ROWS, parts, starts, seen):
        assert positions[-1] == p.total == n - 1
        assert set(stops) <= {pos0, *positions}, "a piece ran past a snapshot stop"
        sizes = [b - a for a, b in zip([pos0] + positions, positions)]
        assert max(sizes) <= min(chunk, 12)
    assert parts[0].next_piece() == 0 and parts[0].next_piece(limit=3) == 0


@pytest.mark.quick
def test_next_piece_is_what_step_forwards(tiny):
    p = ChunkedPrefill(tiny, tokens(tiny, 30, 9), 8, tiny.make_cache(), stops=(5, 19))
    for limit in (None, 3, None, 100, None, None, 2):
        want = p.next_piece(limit)
        assert p.step(limit) == want
    while not p.done:
        p.step()
    assert p.next_piece() == 0 and p.step() == 0
    with pytest.raises(ValueError, match="at least 1"):
        ChunkedPrefill(tiny, [1, 2, 3], 8, tiny.make_cache()).next_piece(0)


@pytest.mark.quick
def test_forward_rows_hidden_states_match_each_row_alone(tiny):
    """The hidden states themselves (the head history's input), rows of different cache
    lengths, pieces of 1 and 9 tokens: what the start-up probe checks."""
    d = bp.max_prefill_diff(tiny, heights=(2, 3), pieces=(1, 9))
    assert d == {2: 0.0, 3: 0.0}
    assert bp.together_matches_solo(tiny, max_rows=3), "measured bit-identical on this CPU backend"
    assert tiny._prefill_together_matches_solo[(3, tiny.chunked_prefill)] is True  # cached on the model


@pytest.mark.quick
def test_admission_rule():
    assert bp.may_prefill_together(exact=False, greedy=True, matches_solo=False)  # fast: always
    assert bp.may_prefill_together(exact=True, greedy=False, matches_solo=False)  # sampled: always
    assert not bp.may_prefill_together(exact=True, greedy=True, matches_solo=False)
    assert bp.may_prefill_together(exact=True, greedy=True, matches_solo=True)


@pytest.mark.quick
def test_bad_input_raises_a_clear_value_error(tiny, head):
    with pytest.raises(ValueError, match="at least one part"):
        bp.prefill_together([])
    a, b = make_parts(tiny, head)[:2]
    with pytest.raises(ValueError, match="twice"):
        bp.prefill_together([a, a])
    while not b.done:
        b.step()
    with pytest.raises(ValueError, match="part 1 has finished"):
        bp.prefill_together([a, b])
    with pytest.raises(ValueError, match="finished"):
        bp.prefill_together([b])
    with pytest.raises(ValueError, match="at least 1"):
        bp.prefill_together([a, make_parts(tiny, head)[2]], limit=0)
    assert a.pos == 0  # nothing was forwarded by a refused call


def test_greedy_continuations_equal_serial_decodes(tiny, head):
    """After prefilling together, each row continues as serial_decode of its whole prompt
    would (rows without a head), or speculating from its primed history (rows with one)."""
    parts = make_parts(tiny, head)
    run_together(parts)
    for i, p in enumerate(parts):
        sampler = Sampler(SamplingParams())
        ref = [s.tokens[0] for s in itertools.islice(serial_decode(tiny, p.prompt, Sampler(SamplingParams())), N)]
        if p.history is None:
            gen = serial_decode(tiny, [p.last_token], sampler, cache=p.cache)
        else:
            gen = speculative_decode(tiny, head, [p.last_token], sampler, 2, guard_margin=None, cache=p.cache,
                                     history=p.history, pipeline=False)
        got = []
        for s in gen:
            got += s.tokens
            if len(got) >= N:
                break
        gen.close()
        assert got[:N] == ref, f"row {i}"


def test_head_evicted_before_a_together_step_drops_the_history(tiny, head):
    together, solo = make_parts(tiny, head), make_parts(tiny, head)
    for parts in (together, solo):
        parts[0].history.head = SimpleNamespace(unloaded=True)  # the governor evicted the head
    (L, *_) = bp.prefill_together(together)
    for p, q in zip(together, solo):
        q.step(limit=L)
        assert_same(p, q)
    assert together[0].history is None and together[3].history is not None


def test_chunked_recurrence_takes_several_unpadded_rows(tiny):
    """Where the chunked GatedDeltaNet prefill is on (CUDA; forced here), a together piece of
    MIN_T tokens runs it at B > 1 with the attention layers' batch-cache masks, and matches
    each row's own chunked prefill bit for bit on this CPU backend."""
    from mlx_lm.models.cache import ArraysCache

    rows = [(cp.MIN_T + 40, cp.MIN_T, 0, False, ()), (cp.MIN_T + 20, cp.MIN_T, 17, False, ())]
    saved = tiny.chunked_prefill
    calls = []
    original = cp.prefill_hidden

    def spy(lm, toks, cache, chunk=cp.CHUNK):
        calls.append(toks.shape[0])
        return original(lm, toks, cache, chunk)

    try:
        tiny.chunked_prefill = True
        cp.prefill_hidden = spy
        together, solo = make_parts(tiny, None, rows, (0, 0)), make_parts(tiny, None, rows, (0, 0))
        assert bp.prefill_together(together) == [cp.MIN_T] * 2
        for p in solo:
            p.step()
        for p, q in zip(together, solo):
            assert_same(p, q)
        assert 2 in calls and calls.count(1) >= 2
        merged = [bp._merge(list(layer)) for layer in zip(*[p.cache for p in together])]
        ids = mx.zeros((2, cp.MIN_T), dtype=mx.uint32)
        assert cp.applies(tiny, ids, merged)
        assert not cp.applies(tiny, ids, together[0].cache)  # two rows need batch attention caches
        padded = merged
        for c in padded:
            if isinstance(c, ArraysCache):
                c.left_padding = mx.array([0, 3])
        assert not cp.applies(tiny, ids, padded)  # a padded recurrence is not this path's
    finally:
        tiny.chunked_prefill = saved
        cp.prefill_hidden = original


@pytest.mark.quick
def test_the_cost_ratio_and_when_sharing_pays(tiny):
    """A forward of 3 rows costs more than one row's and less than ~6 here; sharing pays
    when the prompts' average wait falls: ratio < (rows + 1) / 2."""
    ratio = bp.together_cost_ratio(tiny, 3, piece=8, reps=1)
    assert 0.5 < ratio < 6.0, ratio
    assert bp.together_pays(1.1, 4) and bp.together_pays(2.4, 4)
    assert not bp.together_pays(2.5, 4) and not bp.together_pays(3.6, 4)
