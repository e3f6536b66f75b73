"""One line per step on stderr for the long measurement commands (gates, benches, tune).

A fidelity gate at 48 tokens runs for many minutes on a big model; without these lines an
operator cannot tell a slow run from a stuck one. Each line names the step (arm, prompt)
and estimates what is left from the mean time of the steps so far; ``finish`` prints one
summary line. stdout stays the report (tables, JSON paths), so pipes that read it are
unaffected.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _clock(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class Progress:
    """``step(what)`` as each of ``total`` steps starts; ``finish(summary)`` at the end."""

    def __init__(self, label: str, total: int, stream: TextIO | None = None, clock=time.perf_counter):
        self.label = label
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self.done = 0
        self.t0 = clock()

    def add(self, steps: int) -> None:
        """More steps than first counted (a phase whose size is known only later)."""
        self.total += steps

    def step(self, what: str) -> None:
        elapsed = self.clock() - self.t0
        self.total = max(self.total, self.done + 1)
        if self.done:
            left = f"~{_clock(elapsed / self.done * (self.total - self.done))} left"
        else:
            left = "estimate after the first step"
        self.done += 1
        print(f"[{self.label} {self.done}/{self.total}] {what} ({_clock(elapsed)} elapsed, {left})",
              file=self.stream, flush=True)

    def finish(self, summary: str = "") -> None:
        tail = f": {summary}" if summary else ""
        print(f"[{self.label} done] {self.done} steps in {_clock(self.clock() - self.t0)}{tail}",
              file=self.stream, flush=True)


class Quiet(Progress):
    """No output: what library callers (tests, the tuner's inner loops) get by default."""

    def __init__(self):
        super().__init__("", 0, stream=sys.stderr)

    def step(self, what: str) -> None:
        self.done += 1

    def finish(self, summary: str = "") -> None:
        pass
