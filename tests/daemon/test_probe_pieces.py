"""The background probes a forward a piece (engine/pieces.py): a request that arrives while a
start-up probe runs waits for one forward, never for a height's worth of them or for a timed
pair. Counted on the bundled model by running each probe under PiecewiseRun and recording
every forward the model ran in each piece."""

from __future__ import annotations

import pytest

mx = pytest.importorskip("mlx.core")

from daemon.engine.pieces import PiecewiseRun  # noqa: E402
from daemon.engine.prefill import batched_prefill as bp  # noqa: E402
from daemon.engine.prefill import mixed_forward as mf  # noqa: E402
from daemon.engine.prefill.cost_pairs import paired_median  # noqa: E402

pytestmark = pytest.mark.quick


class _Counter:
    """Top-level calls of the counted functions (a counted call inside another is not one more
    forward: forward_rows and prefill call the model's own forwards)."""
    calls = 0
    depth = 0


def _pieces(fn) -> tuple[object, list[int]]:
    """fn's result and, per piece, how many counted calls it made."""
    run, per_piece = PiecewiseRun(fn), []
    while True:
        before = _Counter.calls
        done = run.step()
        per_piece.append(_Counter.calls - before)
        if done:
            assert run.error is None, run.error
            return run.result, per_piece


@pytest.fixture
def counted():
    """A wrapper that counts a function's top-level calls."""
    _Counter.calls = _Counter.depth = 0

    def counting(fn):
        def wrapper(*a, **k):
            _Counter.calls += _Counter.depth == 0
            _Counter.depth += 1
            try:
                return fn(*a, **k)
            finally:
                _Counter.depth -= 1
        return wrapper

    return counting


def test_the_together_check_runs_one_forward_a_piece(tiny, monkeypatch, counted):
    view = tiny.layer_kinds_view()
    monkeypatch.setattr(type(view), "prefill_hidden", counted(type(view).prefill_hidden))
    monkeypatch.setattr(bp, "forward_rows", counted(bp.forward_rows))
    heights, pieces = (2, 3), (1, 9)
    worst, per_piece = _pieces(lambda: bp.max_prefill_diff(view, heights, pieces))
    assert worst == {2: 0.0, 3: 0.0}
    forwards = sum(per_piece)
    prefixed = sum(1 for B in heights for i in range(B) if bp.PROBE_PREFIXES[i % len(bp.PROBE_PREFIXES)])
    assert forwards == prefixed + sum(len(pieces) * (B + 1) for B in heights)
    assert max(per_piece) == 1, per_piece  # before: each height's B lone forwards and the together one in one piece


def test_the_mixed_check_runs_one_forward_a_piece(tiny, monkeypatch, counted):
    view = tiny.layer_kinds_view()
    monkeypatch.setattr(type(view), "layer_kinds_view", lambda self: view)
    monkeypatch.setattr(type(view), "hidden", counted(type(view).hidden))
    monkeypatch.setattr(mf, "mixed_hidden", counted(mf.mixed_hidden))
    monkeypatch.setattr(mf, "prefill", counted(mf.prefill))
    ok, per_piece = _pieces(lambda: mf.mixed_matches_alone(view, rows=3, pieces=(1, 6)))
    assert ok is True
    assert max(per_piece) == 1, per_piece  # a prompt prefill, a group's forward or the mixed one
    assert sum(per_piece) == 2 * (3 + 1 + 3 + 1)  # per piece length: 3 rows' prompts, a prefix, 3 groups, mixed


def test_a_cost_pair_times_each_side_in_a_piece_of_its_own():
    calls: list[str] = []

    def side(name: str, seconds: float):
        def run() -> float:
            calls.append(name)
            _Counter.calls += 1
            return seconds
        return run

    _Counter.calls = 0
    ratio, per_piece = _pieces(lambda: paired_median(side("rows", 3.0), side("one", 1.5), reps=3))
    assert ratio == 2.0
    assert calls == ["one", "rows"] + ["rows", "one"] * 3  # an untimed run of each first
    assert max(per_piece) == 1 and sum(per_piece) == 8, per_piece
