"""Liveness of the group: a rank that stops hearing from the others exits.

A collective whose peer died may raise (ring: the socket closes) or may block forever (a
peer that hangs, a network that drops packets). A thread outside the engine watches the
time since the last completed exchange with the group and ends the process with
``os._exit`` past the deadline: no collective can be interrupted from Python, and a rank
stuck in one must not hold its clients or its service manager forever.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time

from ..exits import EXIT_SOFTWARE
from ..logs import get_logger

log = get_logger("councild.group")


def leave_group(code: int = EXIT_SOFTWARE) -> None:
    """Exit non-zero at once, after the caller logged why (no interpreter teardown: another
    thread may be inside a collective that will never return). 70 lets the service manager
    restart the group; 78 (a configuration the ranks disagree on) does not."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    os._exit(code)


def _ceil_2dp(seconds: float) -> float:
    """Rounded up, so the logged silence is past the deadline whenever the silence was
    (round() made 3.001 s read as 3.0 against a 3.0 s deadline)."""
    return math.ceil(seconds * 100) / 100


class GroupWatchdog(threading.Thread):
    """``beat()`` after each exchange with the group; silence past the deadline exits.
    The deadline is ``startup_s`` until ``started()`` (ranks load at different speeds),
    then ``timeout_s``."""

    def __init__(self, rank: int, size: int, timeout_s: float, startup_s: float, clock=time.monotonic):
        super().__init__(name="councild-group-watchdog", daemon=True)
        self.rank, self.size = rank, size
        self.timeout_s = timeout_s
        self.deadline_s = startup_s
        self.clock = clock
        self.last = clock()
        self.exchanges = 0
        self._stop = threading.Event()

    def beat(self) -> None:
        self.last = self.clock()
        self.exchanges += 1

    def started(self) -> None:
        self.deadline_s = self.timeout_s
        self.beat()

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        poll = min(0.25, self.timeout_s / 4)
        while not self._stop.wait(poll):
            silent = self.clock() - self.last
            if silent > self.deadline_s:
                log.error("group.peer_lost", rank=self.rank, exit_code=EXIT_SOFTWARE, size=self.size,
                          silent_s=_ceil_2dp(silent), deadline_s=self.deadline_s, exchanges=self.exchanges,
                          reason="no exchange with the group completed within the deadline: a rank died, hangs "
                                 "or cannot be reached; every rank exits so the service manager restarts the group")
                leave_group()
