"""The heartbeat and liveness policy both clients follow (zguide: no wait is unbounded).

While anything waits, the client sends Ping every ``heartbeat_interval_s`` (from the
Welcome; ``DEFAULT_HEARTBEAT_INTERVAL_S`` until then), which also keeps the daemon from
declaring the connection gone, and says Hello again before a request after a quiet spell
(the daemon forgets the seat of a connection it has not heard from). Silence of
``timeout_s`` while waiting means the daemon is unavailable. Times are ``time.monotonic()``
seconds passed in by the caller, so the policy itself does no I/O and reads no clock.
"""

from __future__ import annotations

# Until the Welcome announces the daemon's interval.
DEFAULT_HEARTBEAT_INTERVAL_S = 1.0
# The async heartbeat task wakes this often per interval, so a late ping is late by a quarter.
TICKS_PER_INTERVAL = 4
MIN_TICK_S = 0.005


class Liveness:
    """When the client last sent and heard, and since when something has been waiting."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.last_sent = 0.0
        self.last_heard = 0.0
        # When the current run of outstanding work began (AsyncClient's heartbeat task
        # measures silence from it, so an idle client is never declared unavailable).
        self.busy_since: float | None = None

    def interval_s(self, heartbeat_interval_s: float | None) -> float:
        """The ping interval: the Welcome's when known, else the default (never above timeout_s)."""
        if heartbeat_interval_s is not None:
            return heartbeat_interval_s
        return min(DEFAULT_HEARTBEAT_INTERVAL_S, self.timeout_s)

    def sent(self, now: float) -> None:
        self.last_sent = now

    def heard(self, now: float) -> None:
        self.last_heard = now

    def quiet(self, now: float, interval: float) -> bool:
        """Nothing sent for an interval: time to Ping, or to say Hello again before a request."""
        return now - self.last_sent >= interval

    def silence(self, now: float, waiting_since: float) -> float:
        """How long the daemon has said nothing while something waited."""
        return now - max(self.last_heard, waiting_since)

    def poll_s(self, now: float, interval: float, silence: float, deadline: float | None) -> float:
        """How long a blocking wait may last before the next ping, the timeout or the deadline."""
        wait = min(interval - (now - self.last_sent), self.timeout_s - silence)
        if deadline is not None:
            wait = min(wait, deadline - now)
        return wait

    def tick_s(self, interval: float) -> float:
        return max(MIN_TICK_S, min(interval, self.timeout_s) / TICKS_PER_INTERVAL)

    def start_busy(self, now: float, outstanding: bool) -> None:
        """Called before work is added: a new run of waiting starts when nothing was outstanding."""
        if not outstanding:
            self.busy_since = now
