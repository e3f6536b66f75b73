"""Tokens per seat for `councild status`: totals, the last-10-seconds rate, the last request's
time to first token, and which seats are still worth a row.

A seat that has had no work for ``idle_s`` leaves the table (its total with it): a daemon that
runs for months serves seats that come and go, and a client that invents a seat name per
request must not grow the daemon's memory or the status reply without bound. So at most
``max_seats`` are kept; past that the longest-idle seat goes first. Pure: the clock is
injected, the engine thread owns the object.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable

WINDOW_S = 10.0
SEAT_IDLE_S = 600.0
MAX_SEATS = 256


class SeatStats:
    def __init__(self, clock: Callable[[], float] = time.monotonic, idle_s: float = SEAT_IDLE_S,
                 max_seats: int = MAX_SEATS):
        self.clock, self.idle_s, self.max_seats = clock, idle_s, max_seats
        self.window: deque[tuple[float, int, str]] = deque()  # (when, tokens, seat)
        self.totals: dict[str, int] = {}
        self.last_active: dict[str, float] = {}
        self.ttft_s: dict[str, float] = {}  # the seat's latest first token, seconds after arrival

    def count(self, seat: str, n: int) -> None:
        now = self.clock()
        self.window.append((now, n, seat))
        self.totals[seat] = self.totals.get(seat, 0) + n
        self.last_active[seat] = now
        self._trim(now)

    def first_token(self, seat: str, seconds: float) -> None:
        self.ttft_s[seat] = seconds
        self.last_active[seat] = self.clock()
        self.totals.setdefault(seat, 0)

    def mark_busy(self, seats: Iterable[str]) -> None:
        """Seats with work queued or running are active now, tokens or not."""
        now = self.clock()
        for seat in seats:
            self.last_active[seat] = now
            self.totals.setdefault(seat, 0)

    def _trim(self, now: float) -> None:
        while self.window and now - self.window[0][0] > WINDOW_S:
            self.window.popleft()

    def prune(self, busy: set[str]) -> None:
        now = self.clock()
        for seat, last in list(self.last_active.items()):
            if seat not in busy and now - last > self.idle_s:
                self._forget(seat)
        if len(self.last_active) > self.max_seats:
            idle = sorted((t, s) for s, t in self.last_active.items() if s not in busy)
            for _, seat in idle[: len(self.last_active) - self.max_seats]:
                self._forget(seat)

    def _forget(self, seat: str) -> None:
        del self.last_active[seat], self.totals[seat]
        self.ttft_s.pop(seat, None)

    def rates(self) -> tuple[float, dict[str, float]]:
        """(tokens/s over the window, per seat), 0 until half a second of data exists."""
        now = self.clock()
        self._trim(now)
        span = min(WINDOW_S, now - self.window[0][0]) if self.window else 0.0
        if span <= 0.5:
            return 0.0, {}
        per_seat: dict[str, int] = {}
        for _, n, seat in self.window:
            per_seat[seat] = per_seat.get(seat, 0) + n
        return sum(per_seat.values()) / span, {s: round(n / span, 2) for s, n in per_seat.items()}
