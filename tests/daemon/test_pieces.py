"""engine/pieces.py: a check run a piece at a time, and the same check run plainly."""

from __future__ import annotations

import pytest

from daemon.engine.pieces import PiecewiseRun, pause

pytestmark = pytest.mark.quick


def _check(log: list[str]) -> int:
    total = 0
    for i in range(3):
        log.append(f"forward {i}")
        total += i
        pause()
    return total


def test_each_step_runs_to_the_next_pause_and_the_end_gives_the_result():
    log: list[str] = []
    run = PiecewiseRun(lambda: _check(log))
    assert log == []  # nothing runs before the first step
    assert run.step() is False and log == ["forward 0"]
    log.append("a request's step")  # the caller's work between two pieces
    assert run.step() is False and log[-1] == "forward 1"
    assert run.step() is False
    assert run.step() is True and run.result == 3 and run.error is None
    assert run.pieces == 4 and run.busy_s >= run.longest_s > 0
    assert log == ["forward 0", "a request's step", "forward 1", "forward 2"]
    assert run.step() is True and run.pieces == 4  # done stays done


def test_called_plainly_a_pause_does_nothing():
    log: list[str] = []
    assert _check(log) == 3 and len(log) == 3


def test_a_check_that_raises_ends_with_its_error():
    def broken() -> None:
        pause()
        raise RuntimeError("kernel refused")

    run = PiecewiseRun(broken)
    assert run.step() is False
    assert run.step() is True and isinstance(run.error, RuntimeError) and run.result is None


def test_abandon_runs_the_checks_finally_blocks():
    cleaned: list[bool] = []

    def swaps_and_restores() -> None:
        try:
            pause()
            pause()
        finally:
            cleaned.append(True)

    run = PiecewiseRun(swaps_and_restores)
    run.step()
    run.abandon()
    assert cleaned == [True] and run.done
    PiecewiseRun(swaps_and_restores).abandon()  # never started: nothing to clean, no error
    assert cleaned == [True]
