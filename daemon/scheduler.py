"""Which request the engine decodes next.

Policy, in order:
1. Class first: interactive before normal before background. A queued request that has
   waited ``starvation_bound_s`` rises one class per bound waited, so nothing starves.
2. Within a class, weighted fair queueing across seats: each seat has a virtual time that
   advances by tokens / weight as its requests decode; the seat with the smallest virtual
   time goes next. A seat that was idle joins at the current minimum, so idling earns no
   credit.
3. FIFO within a seat.

Up to ``max_active`` requests hold caches and are decoded in turn. When a higher-class
request arrives and every slot holds lower-class work, the lowest is parked: it keeps its
generator (and so its cache) and resumes later without recomputing its prompt.

No mlx and no locks: the scheduler lives on the engine thread.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Protocol

from .config import SchedulerConfig

CLASS_RANK = {"interactive": 0, "normal": 1, "background": 2}


class Schedulable(Protocol):
    seat: str
    priority: str
    enqueued_at: float
    weight: float


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self.clock = clock
        self.queues: dict[str, deque] = {}
        self.active: list = []
        self.parked: list = []
        self.vtime: dict[str, float] = {}
        self._order = itertools.count()
        self._last_run: dict[int, int] = {}

    # ------------------------------------------------------------------ bookkeeping
    def submit(self, job: Schedulable) -> None:
        if job.seat not in self._busy_seats():
            # A seat returning from idle starts at the floor of the busy seats: idling
            # earns no credit, and it keeps any debt it ran up before.
            busy = [self.vtime.get(s, 0.0) for s in self._busy_seats()]
            floor = min(busy) if busy else 0.0
            self.vtime[job.seat] = max(self.vtime.get(job.seat, floor), floor)
        self.queues.setdefault(job.seat, deque()).append(job)

    def remove(self, job) -> bool:
        """Forget a job wherever it is (finished, cancelled, expired)."""
        self._last_run.pop(id(job), None)
        if job in self.active:
            self.active.remove(job)
            return True
        if job in self.parked:
            self.parked.remove(job)
            return True
        q = self.queues.get(job.seat)
        if q is not None and job in q:
            q.remove(job)
            return True
        return False

    def waiting(self) -> Iterable:
        yield from self.parked
        for q in self.queues.values():
            yield from q

    def has_work(self) -> bool:
        return bool(self.active or self.parked or any(self.queues.values()))

    def queued_count(self, seat: str | None = None) -> int:
        if seat is not None:
            return len(self.queues.get(seat, ())) + sum(1 for j in self.parked if j.seat == seat)
        return sum(len(q) for q in self.queues.values()) + len(self.parked)

    def position(self, job) -> int:
        """How many waiting jobs would go before this one if nothing else arrived."""
        ranked = sorted(self.waiting(), key=self._queue_key)
        return ranked.index(job) if job in ranked else 0

    # ------------------------------------------------------------------ policy
    def _rank(self, job) -> int:
        rank = CLASS_RANK[job.priority]
        waited = self.clock() - job.enqueued_at
        return max(0, rank - int(waited // self.cfg.starvation_bound_s))

    def _seat_vtime(self, seat: str) -> float:
        return self.vtime.get(seat, 0.0)

    def _busy_seats(self) -> set[str]:
        seats = {j.seat for j in self.active} | {j.seat for j in self.parked}
        seats |= {s for s, q in self.queues.items() if q}
        return seats

    def _queue_key(self, job):
        return (self._rank(job), self._seat_vtime(job.seat), job.enqueued_at)

    def admit(self) -> list:
        """Fill free slots from the waiting jobs, parking lower-class work for higher.
        Returns the jobs that became active."""
        admitted = []
        while True:
            waiting = sorted(self.waiting(), key=self._queue_key)
            if not waiting:
                break
            best = waiting[0]
            if len(self.active) >= self.cfg.max_active:
                worst = max(self.active, key=lambda j: (self._rank(j), self._seat_vtime(j.seat)))
                if self._rank(best) >= self._rank(worst):
                    break
                self.active.remove(worst)
                self.parked.append(worst)
                worst.parked_count = getattr(worst, "parked_count", 0) + 1
            if best in self.parked:
                self.parked.remove(best)
            else:
                self.queues[best.seat].remove(best)
            self.active.append(best)
            admitted.append(best)
        return admitted

    def pick(self):
        """The active job to advance by one decode cycle, or None."""
        if not self.active:
            return None
        job = min(
            self.active,
            key=lambda j: (self._rank(j), self._seat_vtime(j.seat), self._last_run.get(id(j), -1)),
        )
        self._last_run[id(job)] = next(self._order)
        return job

    def charge(self, job, tokens: int) -> None:
        """Account decoded tokens to the job's seat (its share of the model's time)."""
        self.vtime[job.seat] = self._seat_vtime(job.seat) + tokens / job.weight
        # Keep virtual times small: only differences matter.
        floor = min(self.vtime.values())
        if floor > 1e6:
            for seat in self.vtime:
                self.vtime[seat] -= floor
