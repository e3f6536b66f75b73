"""Progress lines of the long measurement commands (daemon/measure/progress.py), on a fake clock."""

from __future__ import annotations

import io

from daemon.measure.progress import Progress, Quiet
import pytest

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_one_line_per_step_with_an_estimate_of_what_is_left_then_a_summary():
    buf, clock = io.StringIO(), FakeClock()
    p = Progress("gate", 4, stream=buf, clock=clock)
    for i in range(4):
        p.step(f"arm exact depth {i + 1}")
        clock.t += 10.0  # each step takes 10 s
    p.finish("PASS")
    lines = buf.getvalue().splitlines()
    assert lines == [
        "[gate 1/4] arm exact depth 1 (0 s elapsed, estimate after the first step)",
        "[gate 2/4] arm exact depth 2 (10 s elapsed, ~30 s left)",
        "[gate 3/4] arm exact depth 3 (20 s elapsed, ~20 s left)",
        "[gate 4/4] arm exact depth 4 (30 s elapsed, ~10 s left)",
        "[gate done] 4 steps in 40 s: PASS",
    ]


def test_steps_added_later_and_long_runs():
    buf, clock = io.StringIO(), FakeClock()
    p = Progress("tune", 0, stream=buf, clock=clock)
    p.add(2)
    p.step("a")
    clock.t += 1000.0
    p.step("b")
    p.step("c")  # one more than counted: the total grows rather than showing 3/2
    clock.t += 4000.0
    p.finish()
    lines = buf.getvalue().splitlines()
    assert lines[1] == "[tune 2/2] b (16 min 40 s elapsed, ~16 min 40 s left)"  # this step and none after
    assert lines[2].startswith("[tune 3/3] c")
    assert lines[3] == "[tune done] 3 steps in 1 h 23 min"


def test_quiet_prints_nothing(capsys):
    q = Quiet()
    q.add(3)
    q.step("x")
    q.finish("y")
    assert capsys.readouterr().err == "" and q.done == 1
