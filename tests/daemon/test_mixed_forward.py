"""One forward over decoding rows and prompts' pieces (daemon/engine/prefill/mixed_forward.py): each
group's hidden states and caches bit-identical to its own forward on this CPU backend, and
decoding on from the mixed forward's caches gives serial decode's tokens."""

from __future__ import annotations

import copy
import random
from itertools import islice

import pytest

mx = pytest.importorskip("mlx.core")

from daemon.engine.decoders.batch import BatchDecoder  # noqa: E402
from daemon.engine.decoders.batch_spec import SpecBatchDecoder  # noqa: E402
from daemon.engine.prefill.mixed_forward import Ride, cache_states, mixed_hidden, mixed_matches_alone  # noqa: E402
from daemon.engine.prefill.prefill import ChunkedPrefill  # noqa: E402
from daemon.engine.decoders.sampling import Sampler  # noqa: E402
from daemon.engine.decoders.serial import serial_decode  # noqa: E402
from daemon.engine.prefill.prefill import prefill  # noqa: E402
from daemon.engine.types import SamplingParams  # noqa: E402


def _ids(lm, n, rng):
    return [rng.randrange(1, lm.text_args.vocab_size) for _ in range(n)]


def _decoding_rows(lm, lengths, rng):
    """Rows that prefilled prompts of these lengths, merged as the continuous batch merges
    them (left-padded attention caches), with each row's next input token."""
    states = []
    for n in lengths:
        c = lm.make_cache()
        states.append((c, prefill(lm, _ids(lm, n, rng), c)))
    merged = [type(layer[0]).merge(list(layer)) for layer in zip(*[c for c, _ in states])]
    return mx.concatenate([last for _, last in states])[:, None], merged


def _piece(lm, prefix, L, rng):
    c = lm.make_cache()
    if prefix:
        prefill(lm, _ids(lm, prefix + 1, rng), c)
    return mx.array([_ids(lm, L, rng)], dtype=mx.uint32), c


@pytest.mark.quick
@pytest.mark.parametrize("rows,L", [(1, 5), (3, 1), (4, 17)])
def test_each_group_is_its_own_forward_bit_for_bit(lm, rows, L):
    rng = random.Random(rows * 100 + L)
    groups = [_decoding_rows(lm, [rng.choice((3, 11, 30)) for _ in range(rows)], rng),
              _piece(lm, 0, L, rng), _piece(lm, 19, L + 2, rng)]
    mx.eval([t for t, _ in groups], [cache_states(c) for _, c in groups])
    mixed = [(t, copy.deepcopy(c)) for t, c in groups]
    alone = [lm.hidden(t, c) for t, c in groups]
    together = mixed_hidden(lm, mixed)
    mx.eval(alone, together)
    for (t, _), a, b in zip(groups, alone, together):
        assert b.shape == a.shape == (*t.shape, lm.text_args.hidden_size)
        assert mx.array_equal(a, b).item()
    for (_, a), (_, b) in zip(groups, mixed):
        assert [c.offset if isinstance(c.offset, int) else c.offset.tolist() for c in a if hasattr(c, "offset")] == \
               [c.offset if isinstance(c.offset, int) else c.offset.tolist() for c in b if hasattr(c, "offset")]
        assert all(mx.array_equal(x, y).item() for x, y in zip(cache_states(a), cache_states(b)))


def test_decoding_on_after_mixed_steps_is_serial_decode(lm):
    """A row that decodes beside a prompt's pieces for several steps (its token fed back,
    greedy) emits what it emits alone, and the prompt's cache after its pieces continues as
    its cold prefill's does."""
    rng = random.Random(7)
    toks, batch = _decoding_rows(lm, [4, 15], rng)
    solo_toks, solo_batch = toks, copy.deepcopy(batch)
    prompt = _ids(lm, 24, rng)
    piece_cache, cold = lm.make_cache(), lm.make_cache()
    prefill(lm, prompt + [1], cold)  # prefills the 24 prompt tokens (the last is left for decode)
    got, want = [], []
    for start in range(0, 24, 6):
        piece = mx.array([prompt[start:start + 6]], dtype=mx.uint32)
        hd, _ = mixed_hidden(lm, [(toks, batch), (piece, piece_cache)])
        toks = mx.argmax(lm.logits(hd)[:, -1], axis=-1).astype(mx.uint32)[:, None]
        solo_toks = mx.argmax(lm.logits(lm.hidden(solo_toks, solo_batch))[:, -1], axis=-1).astype(mx.uint32)[:, None]
        got.append(toks.reshape(-1).tolist())
        want.append(solo_toks.reshape(-1).tolist())
    assert got == want
    assert all(mx.array_equal(x, y).item() for x, y in zip(cache_states(piece_cache), cache_states(cold)))


@pytest.mark.quick
def test_the_probe_passes_here_and_bad_calls_are_refused(lm):
    assert mixed_matches_alone(lm, rows=2, pieces=(3,))
    with pytest.raises(ValueError, match="at least one group"):
        mixed_hidden(lm, [])


def _serial(lm, prompt, n):
    return [s.tokens[0] for s in islice(serial_decode(lm, prompt, Sampler(SamplingParams())), n)]


def _ride_along(bd, lm, prompt, step_rows, pieces=5):
    """Drive ``bd`` (rows added already) for as long as ``step_rows`` says, offering each step
    the prompt's next piece; a piece no forward carried runs alone, as the worker's prefill
    phase runs it. Returns (rows' tokens, pieces carried, pieces run alone, the prefill)."""
    pre = ChunkedPrefill(lm, prompt, 64, lm.make_cache())
    got, carried, alone = {r: [] for r in bd.row_ids}, 0, 0
    cycle = 0
    while step_rows(bd, cycle, got):
        n = pre.next_piece(pieces)
        ride = Ride(pre.piece_ids(n)[None], pre.cache) if n else None
        for r, s in bd.step(ride).items():
            got[r] += s.tokens if hasattr(s, "tokens") else [s]
        if ride is not None and ride.hidden is not None:
            pre.ridden(ride.hidden, n)
            carried += 1
        elif n:
            pre.step(n)
            alone += 1
        cycle += 1
    return got, carried, alone, pre


def test_the_plain_batch_carries_pieces_and_stays_serial(lm):
    rng = random.Random(3)
    prompts = [_ids(lm, n, rng) for n in (6, 19, 11)]
    prompt = _ids(lm, 41, rng)
    refs = {i: _serial(lm, p, 12) for i, p in enumerate(prompts)}
    bd = BatchDecoder(lm, max_rows=4)
    for i, p in enumerate(prompts):
        bd.add(i, Sampler(SamplingParams()), p, exact=True)
    got, carried, alone, pre = _ride_along(bd, lm, prompt, lambda bd, cycle, got: cycle < 12)
    assert {i: got[i][:12] for i in refs} == refs
    assert carried == 8 and alone == 0 and pre.done  # 40 tokens in pieces of 5
    cold = lm.make_cache()
    prefill(lm, prompt, cold)
    assert all(mx.array_equal(x, y).item() for x, y in zip(cache_states(pre.cache), cache_states(cold)))


def test_the_speculating_batch_carries_pieces_in_depth_zero_cycles_only_and_stays_serial(lm, head):
    """Depth 0 with cycles queued ahead (a piece rides in the next cycle's forward), depth 2
    in between (a drafting cycle carries nothing: the piece runs alone), a row joining while a
    cycle carrying a piece is queued ahead (undone: the rows' part only). Every row decodes
    serial's tokens; the prompt's state is its cold prefill's."""
    rng = random.Random(4)
    prompts = [_ids(lm, n, rng) for n in (6, 19, 11)]
    prompt = _ids(lm, 61, rng)
    N = 24
    refs = {i: _serial(lm, p, N) for i, p in enumerate(prompts)}
    depth = {"k": 0}
    bd = SpecBatchDecoder(lm, lambda: head, lambda B: depth["k"], max_rows=4)
    assert bd.exact_ok
    for i in range(2):
        bd.add(i, Sampler(SamplingParams()), prompts[i], exact=True)

    def step_rows(bd, cycle, got):
        depth["k"] = 2 if cycle % 7 in (3, 4) else 0
        if cycle == 2:
            bd.add(2, Sampler(SamplingParams()), prompts[2], exact=True)
            got[2] = []
        for r in [r for r in bd.row_ids if len(got[r]) >= N]:
            bd.remove(r)
        return len(bd) > 0

    got, carried, alone, pre = _ride_along(bd, lm, prompt, step_rows)
    assert {i: got[i][:N] for i in refs} == refs
    assert carried > 0 and alone > 0 and bd.stats.ahead_undone > 0 and bd.stats.drafted > 0
    assert pre.done
    cold = lm.make_cache()
    prefill(lm, prompt, cold)
    assert all(mx.array_equal(x, y).item() for x, y in zip(cache_states(pre.cache), cache_states(cold)))


def test_with_the_invariant_kernels_each_group_gets_its_own_forwards_kernels_and_the_probe_can_say_no(lm):
    """Through the invariant classes (reference ops on this CPU) a group's attention is the
    kernel its own forward picks (InvariantAttention.attend), so mixed forwards stay
    bit-identical, up to and past the kernels' height (where the flattened projections fall
    back to MLX's matmul: the same bits as the reference on this CPU, not on a GPU, which is why
    start-up probes a whole chunk's piece); a perturbed multi-row product makes the probe say no
    (a lone decoding row is a one-row product alone, part of a multi-row one mixed)."""
    from daemon.engine.kernels import invariant

    invariant.install(lm.text_module)
    try:
        assert mixed_matches_alone(lm, rows=2, pieces=(1, 6, invariant.MAX_ROWS))
        invariant.PERTURB_BATCHED = True
        assert not mixed_matches_alone(lm, rows=1, pieces=(6,))
    finally:
        invariant.PERTURB_BATCHED = False
        invariant.uninstall(lm.text_module)
