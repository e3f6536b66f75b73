"""Council load, pushed by the daemon's server loop and scheduler, read by the governor.

Thread-safe: the server loop and the step loop write, the governor's tick reads.
The arrival rate is an exponentially weighted rate with time constant ``tau_s``: each
arrival adds 1/tau and the sum decays as exp(-dt/tau), so a steady rate r reads r.
"""

from __future__ import annotations

import math
import os
import threading
from typing import Callable

from .base import LoadReading


def system_cpu_load() -> float | None:
    """1-minute load average per core (psutil's getloadavg works on Windows too)."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except (OSError, AttributeError):
        try:
            import psutil

            return psutil.cpu_percent(interval=None) / 100.0
        except Exception:
            return None


class LoadTracker:
    def __init__(self, tau_s: float = 30.0, cpu_load: Callable[[], float | None] | None = system_cpu_load):
        self.tau_s = tau_s
        self._cpu_load = cpu_load
        self._lock = threading.Lock()
        self._rate = 0.0
        self._rate_at: float | None = None
        self._active = 0
        self._queued: dict[str, int] = {}

    def record_arrival(self, now: float) -> None:
        with self._lock:
            self._rate = self._decayed(now) + 1.0 / self.tau_s
            self._rate_at = now if self._rate_at is None else max(now, self._rate_at)

    def set_active(self, n: int) -> None:
        with self._lock:
            self._active = max(0, int(n))

    def set_queued(self, seat: str, n: int) -> None:
        with self._lock:
            if n > 0:
                self._queued[seat] = int(n)
            else:
                self._queued.pop(seat, None)

    def _decayed(self, now: float) -> float:
        if self._rate_at is None:
            return 0.0
        return self._rate * math.exp(-max(0.0, now - self._rate_at) / self.tau_s)

    def read(self, now: float) -> LoadReading:
        try:
            cpu = self._cpu_load() if self._cpu_load else None
        except Exception:
            cpu = None
        with self._lock:
            return LoadReading(
                active_streams=self._active,
                queued=sum(self._queued.values()),
                queued_by_seat=dict(self._queued),
                arrival_rate=self._decayed(now),
                cpu_load=cpu,
            )
