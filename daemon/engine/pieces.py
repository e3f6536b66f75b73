"""Long checks cut into pieces: a start-up check runs a piece at a time, between requests.

The daemon serves as soon as its model is loaded; its self-checks, exactness probes, cost
probes and warm-up run afterwards, on the engine thread, when no request is waiting
(daemon/engine_thread/warming.py). A probe is written as a plain function; it calls
``pause()`` between its forwards, and ``PiecewiseRun`` runs it from one pause to the next
per ``step()``. Run directly (a tests' call, a bench's, a group's start-up), ``pause()`` does
nothing and the function runs to its end as before.

The function runs in a greenlet on the caller's thread (the engine thread): its MLX calls are
made where every other MLX call of the engine is made, and nothing runs concurrently with a
request's forward. A pause must sit where the model is in its serving state (a probe that
swaps a path in for a moment pauses only after swapping it back) and outside any timed span
(a cost probe times its forwards between two pauses, never across one).
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Callable
from typing import Any

import greenlet


class _PieceGreenlet(greenlet.greenlet):
    """Marks the greenlet a ``pause()`` may leave (a plain greenlet elsewhere is not ours)."""


def pause() -> None:
    """End the current piece when running under ``PiecewiseRun``; else nothing."""
    current = greenlet.getcurrent()
    if isinstance(current, _PieceGreenlet):
        current.parent.switch()


class PiecewiseRun:
    """``fn()`` run a piece at a time: each ``step()`` runs it to its next ``pause()`` (or its
    end) on the calling thread. Once ``done``, ``result`` is its return value, or ``error``
    the exception it raised. ``busy_s`` sums the pieces' time; ``longest_s`` is the longest
    piece (what a request arriving mid-piece could have waited)."""

    def __init__(self, fn: Callable[[], Any]):
        self._g = _PieceGreenlet(fn)
        self._g.gr_context = contextvars.copy_context()  # its log lines keep the thread's bound fields
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.pieces = 0
        self.busy_s = 0.0
        self.longest_s = 0.0

    def step(self) -> bool:
        """Run one piece; True once the function has finished (returned or raised)."""
        if self.done:
            return True
        t0 = time.perf_counter()
        try:
            value = self._g.switch()
        except Exception as exc:  # noqa: BLE001 - the check's failure is its verdict, reported by the caller
            self.error = exc
            self.done = True
        else:
            if self._g.dead:
                self.result = value
                self.done = True
        dt = time.perf_counter() - t0
        self.pieces += 1
        self.busy_s += dt
        self.longest_s = max(self.longest_s, dt)
        return self.done

    def run_to_end(self) -> None:
        while not self.step():
            pass

    def abandon(self) -> None:
        """Stop an unfinished run (the daemon is stopping): its ``finally`` blocks run now."""
        if not self.done and not self._g.dead:
            try:
                self._g.throw(greenlet.GreenletExit)
            except Exception:  # noqa: BLE001 - a check torn down mid-way has nothing left to report
                pass
            self.done = True
