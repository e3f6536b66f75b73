"""SeatStats: the status table's per-seat rows stay bounded on a daemon that runs for months."""

from __future__ import annotations

from daemon.engine_thread.seat_stats import SeatStats
import pytest

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_idle_seats_leave_and_busy_ones_stay():
    clock = Clock()
    s = SeatStats(clock, idle_s=60.0)
    s.count("planner", 5)
    s.count("critic", 3)
    clock.t += 30
    s.count("planner", 1)
    clock.t += 45  # critic idle 75 s, planner 45 s
    s.prune(busy=set())
    assert s.totals == {"planner": 6}
    clock.t += 100
    s.mark_busy({"planner"})  # queued work keeps a seat, tokens or not
    s.prune(busy={"planner"})
    assert s.totals == {"planner": 6}


def test_seat_names_invented_per_request_do_not_grow_without_bound():
    clock = Clock()
    s = SeatStats(clock, idle_s=1e9, max_seats=8)
    for i in range(1000):
        clock.t += 0.01
        s.count(f"seat-{i}", 1)
        s.prune(busy={"seat-0"})
    assert len(s.totals) <= 8 + 1 and "seat-0" in s.totals and "seat-999" in s.totals


def test_rates_over_the_last_ten_seconds():
    clock = Clock()
    s = SeatStats(clock)
    assert s.rates() == (0.0, {})
    for _ in range(10):
        s.count("a", 10)
        clock.t += 1.0
    total, per_seat = s.rates()
    assert abs(total - 10.0) < 1e-9 and per_seat == {"a": 10.0}
    clock.t += 30
    assert s.rates() == (0.0, {})


def test_first_token_is_kept_per_seat_and_leaves_with_the_seat():
    clock = Clock()
    s = SeatStats(clock, idle_s=30, max_seats=2)
    s.first_token("planner", 0.2)
    s.first_token("planner", 0.05)  # the latest request's, not the first's
    s.first_token("critic", 0.4)
    assert s.ttft_s == {"planner": 0.05, "critic": 0.4}
    clock.t += 10
    s.first_token("judge", 0.1)  # a third seat: the longest idle goes, its TTFT with it
    s.prune(busy=set())
    assert set(s.ttft_s) == set(s.totals) and "judge" in s.ttft_s and len(s.ttft_s) == 2
    clock.t += 60
    s.prune(busy=set())
    assert s.ttft_s == {} and s.totals == {}
