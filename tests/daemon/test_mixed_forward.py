"""One forward over decoding rows and prompts' pieces (daemon/engine/mixed_forward.py): each
group's hidden states and caches bit-identical to its own forward on this CPU backend, and
decoding on from the mixed forward's caches gives serial decode's tokens."""

from __future__ import annotations

import copy
import random

import pytest

mx = pytest.importorskip("mlx.core")

from daemon.engine.mixed_forward import _states, mixed_hidden, mixed_matches_alone  # noqa: E402
from daemon.engine.serial import prefill  # noqa: E402


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
    mx.eval([t for t, _ in groups], [_states(c) for _, c in groups])
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
        assert all(mx.array_equal(x, y).item() for x, y in zip(_states(a), _states(b)))


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
    assert all(mx.array_equal(x, y).item() for x, y in zip(_states(piece_cache), _states(cold)))


@pytest.mark.quick
def test_the_probe_passes_here_and_bad_calls_are_refused(lm):
    assert mixed_matches_alone(lm, rows=2, pieces=(3,))
    with pytest.raises(ValueError, match="at least one group"):
        mixed_hidden(lm, [])
