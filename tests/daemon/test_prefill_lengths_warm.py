"""The prefill_lengths start-up part (engine_thread/warmup.py): every token count a lone
prompt's forward can have, forwarded once, a count a piece, on caches of its own."""

from __future__ import annotations

import pytest

mx = pytest.importorskip("mlx.core")

from daemon.engine.pieces import PiecewiseRun  # noqa: E402
from daemon.engine_thread import warmup  # noqa: E402

pytestmark = pytest.mark.quick


def test_the_counts_left_are_those_the_prefill_stage_did_not_run():
    # full's prefill stage forwards the whole chunk, chunk // 2 + 1, min(chunk, 17) and 1 token(s)
    assert warmup.remaining_lengths("full", 8) == [2, 3, 4, 6, 7]
    assert warmup.remaining_lengths("full", 40) == [n for n in range(1, 41) if n not in (1, 17, 21, 40)]
    assert warmup.remaining_lengths("light", 8) == [1, 2, 3, 4, 5, 6, 7]  # light's one prefill: the chunk, cut at 16
    assert warmup.remaining_lengths("off", 4) == [1, 2, 3, 4]


def test_each_count_is_one_forward_a_piece_on_a_cache_of_its_own(tiny, monkeypatch):
    view = tiny.layer_kinds_view()
    seen: list[list[tuple[int, int]]] = [[]]
    real = type(view).prefill_hidden

    def recording(self, tokens, cache):
        depth = max(c.offset for c in cache if hasattr(c, "offset"))
        seen[-1].append((tokens.shape[-1], depth))
        return real(self, tokens, cache)

    monkeypatch.setattr(type(view), "prefill_hidden", recording)
    run = PiecewiseRun(lambda: warmup.prefill_each_length(view, [3, 5, 2], chunk=4, head=None))
    while not run.step():
        seen.append([])
    assert run.error is None, run.error
    # A pause before each count: the first piece is empty, then one forward each, each from
    # an empty cache (depth 0), a count longer than the chunk still one forward.
    assert seen == [[], [(3, 0)], [(5, 0)], [(2, 0)]]
