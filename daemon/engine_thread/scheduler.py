"""Which request the engine decodes next.

Policy, in order:
1. Class first: interactive before normal before background. A waiting request (queued,
   or parked) rises one class per ``starvation_bound_s`` it has waited since it last
   waited, so nothing starves. A running request keeps the class it was admitted at: it
   does not age while it runs (aging running work is what once let a seat hold every slot
   for good: a waiting request never outranked it).
2. Within a class, weighted fair queueing across seats: each seat has a virtual time that
   advances by tokens / weight as its requests decode; the seat with the smallest virtual
   time goes next. A seat that was idle joins at the current minimum, so idling earns no
   credit.
3. FIFO within a seat.

Up to ``max_active`` requests hold caches and are decoded in turn (the live limit: the
config's int, or the governor's with "auto", ``set_max_active``). When every slot is
taken, a waiting request W of seat S displaces (parks) a running request V of another seat
T when V's class is lower than W's (aged) class, or, V's class being no higher than W's:
- slots are unfairly split: n_T / w_T > (n_S + 1) / w_S (n: the seat's running requests,
  w: its weight), so the move makes the split fairer and never ping-pongs; or
- W has waited ``starvation_bound_s`` and T holds more than its weighted share of the
  slots, max_active * w_T / (sum of w over the seats with work). W then runs for at least
  one bound before the first rule may displace it (else, where shares are fractional, the
  first rule would hand the slot straight back and W would starve after all).
A request admitted in this admit is never displaced in the same admit (it runs at least
one cycle), which also makes every admit finish.
A parked request keeps its generator (and so its cache) and resumes later without
recomputing its prompt. The guarantee this gives is in docs/OPERATIONS.md (Fairness).

One engine iteration (OPERATIONS.md, "The engine step") is a decode phase then a prefill
phase, among the running requests of the best class running:
- ``pick_decoder``: the decoding request advanced by one cycle (a batched row's cycle is
  the whole batch's), by the order above;
- ``prefill_plan``: prefill chunks that fill what is left of ``step_token_budget`` (0: one
  chunk per iteration): short remainders first (a prefix-cache hit's tail, a short prompt:
  they fit one chunk), then each seat's oldest prompt before any seat's second (by
  weight), then earliest arrival (a prompt prefilled for ``starvation_bound_s`` already
  stops yielding to short ones). A prompt keeps the chunks until it is done, so cold
  prompts finish first-come instead of all together, and a long one costs the decoding
  streams at most the budget (or one chunk) per cycle. At least one chunk runs whenever a
  prompt waits.

No mlx and no locks: the scheduler lives on the engine thread.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Protocol

from ..config import SchedulerConfig

CLASS_RANK = {"interactive": 0, "normal": 1, "background": 2}


class Schedulable(Protocol):
    seat: str
    priority: str
    enqueued_at: float
    weight: float
    # Prompt tokens still to prefill (0: decoding), and the size of its prefill chunks.
    prefill_left: int
    prefill_chunk: int


def prefill_left(job) -> int:
    return getattr(job, "prefill_left", 0)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, clock: Callable[[], float] = time.monotonic):
        self.cfg = cfg
        self.clock = clock
        # The live limit on requests holding a slot: the one place it is read. The config's
        # int, or with "auto" its start height until the governor sets it (set_max_active).
        self.max_active = cfg.start_height
        self.queues: dict[str, deque] = {}
        self.active: list = []
        self.parked: list = []
        self.vtime: dict[str, float] = {}
        self._order = itertools.count()
        self._last_run: dict[int, int] = {}
        # Per job (by id): when it last started waiting (submitted or parked), the class
        # rank it was admitted at, and when it was admitted (for choosing whom to park).
        self._waiting_since: dict[int, float] = {}
        self._run_rank: dict[int, int] = {}
        self._admitted_at: dict[int, int] = {}
        # Per job: the clock when it was last admitted (a prompt prefilled past the
        # starvation bound stops yielding to short ones: prefill_order).
        self._admitted_clock: dict[int, float] = {}
        self._protected_until: dict[int, float] = {}
        self._admit_calls = 0
        self._call_of: dict[int, int] = {}
        # (parked job, the job it made room for, why, how long that one had waited): the
        # worker logs and clears these.
        self.displaced: list[tuple[object, object, str, float]] = []

    # ------------------------------------------------------------------ the limit
    def set_max_active(self, n: int) -> None:
        """The governor's limit (with max_active = "auto"). Lowering it drops no request:
        those above it finish (or are parked by the rules below), and none is admitted
        until fewer than ``n`` run."""
        self.max_active = max(1, int(n))

    def reconfigure(self, cfg: SchedulerConfig) -> None:
        """New settings (SIGHUP): a pinned max_active applies now; under "auto" the
        governor's limit stays, capped at a lowered ceiling (the governor hears of it)."""
        was_auto = self.cfg.height_auto
        self.cfg = cfg
        if not cfg.height_auto:
            self.max_active = cfg.max_active
        elif not was_auto:
            self.max_active = cfg.start_height
        else:
            self.max_active = min(self.max_active, cfg.max_active_ceiling)

    # ------------------------------------------------------------------ bookkeeping
    def submit(self, job: Schedulable) -> None:
        if job.seat not in self._busy_seats():
            # A seat returning from idle starts at the floor of the busy seats: idling
            # earns no credit, and it keeps any debt it ran up before.
            busy = [self.vtime.get(s, 0.0) for s in self._busy_seats()]
            floor = min(busy) if busy else 0.0
            self.vtime[job.seat] = max(self.vtime.get(job.seat, floor), floor)
        self.queues.setdefault(job.seat, deque()).append(job)
        self._waiting_since[id(job)] = job.enqueued_at

    def remove(self, job) -> bool:
        """Forget a job wherever it is (finished, cancelled, expired)."""
        for book in (self._last_run, self._waiting_since, self._run_rank, self._admitted_at,
                     self._protected_until, self._call_of, self._admitted_clock):
            book.pop(id(job), None)
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
    def waited(self, job) -> float:
        """Seconds a waiting job has waited since it was submitted or last parked."""
        return self.clock() - self._waiting_since.get(id(job), job.enqueued_at)

    def _rank(self, job) -> int:
        """A waiting job's class rank, aged one class per starvation bound waited."""
        rank = CLASS_RANK[job.priority]
        return max(0, rank - int(self.waited(job) // self.cfg.starvation_bound_s))

    def run_rank(self, job) -> int:
        """A running job's rank: the one it was admitted at (running work does not age)."""
        return self._run_rank.get(id(job), CLASS_RANK[job.priority])

    def _seat_vtime(self, seat: str) -> float:
        return self.vtime.get(seat, 0.0)

    def _busy_seats(self) -> set[str]:
        seats = {j.seat for j in self.active} | {j.seat for j in self.parked}
        seats |= {s for s, q in self.queues.items() if q}
        return seats

    def _queue_key(self, job):
        return (self._rank(job), self._seat_vtime(job.seat), job.enqueued_at)

    def running_counts(self) -> dict[str, int]:
        n: dict[str, int] = {}
        for j in self.active:
            n[j.seat] = n.get(j.seat, 0) + 1
        return n

    def shares(self) -> dict[str, float]:
        """Each busy seat's weighted share of the active slots."""
        weights: dict[str, float] = {}
        for j in itertools.chain(self.active, self.waiting()):
            weights[j.seat] = j.weight
        total = sum(weights.values())
        return {s: self.max_active * w / total for s, w in weights.items()} if total else {}

    def _victim_for(self, job) -> tuple[object, str]:
        """The running job that ``job`` may displace now (or None), and the rule that lets
        it: "class", "fair_split" or "starvation" (see the module doc)."""
        rank = self._rank(job)
        now = self.clock()
        # Admitted in this admit: it runs at least one cycle before anyone displaces it.
        movable = [v for v in self.active if self._call_of.get(id(v)) != self._admit_calls]
        lower = [v for v in movable if self.run_rank(v) > rank]
        if lower:
            return max(lower, key=lambda v: (self.run_rank(v), self._seat_vtime(v.seat),
                                             self._admitted_at.get(id(v), 0))), "class"
        n = self.running_counts()
        others = [v for v in movable if v.seat != job.seat and self.run_rank(v) >= rank]
        mine = (n.get(job.seat, 0) + 1) / job.weight
        unfair = [v for v in others if n[v.seat] / v.weight > mine and self._protected_until.get(id(v), 0.0) <= now]
        why = "fair_split"
        if not unfair and self.waited(job) >= self.cfg.starvation_bound_s:
            share = self.shares()
            unfair = [v for v in others if n[v.seat] > share.get(v.seat, 0.0) + 1e-9]
            why = "starvation"
        if not unfair:
            return None, ""
        # The most over-share seat gives up its most recently admitted request.
        return max(unfair, key=lambda v: (n[v.seat] / v.weight, self._admitted_at.get(id(v), 0))), why

    def admit(self) -> list:
        """Fill free slots from the waiting jobs, parking running work where the policy
        says a waiting job may displace it. Returns the jobs that became active."""
        admitted = []
        self._admit_calls += 1
        # Every displacement strictly improves the split (or serves a starved job, whose
        # victim then waits afresh), so this ends; the cap is a belt for the braces.
        for _ in range(4 * self.max_active + 64):
            waiting = sorted(self.waiting(), key=self._queue_key)
            if not waiting:
                break
            best = waiting[0] if len(self.active) < self.max_active else None
            why = ""
            if best is None:
                for cand in waiting:
                    victim, why = self._victim_for(cand)
                    if victim is not None:
                        self._park(victim)
                        self.displaced.append((victim, cand, why, self.waited(cand)))
                        best = cand
                        break
            if best is None:
                break
            if best in self.parked:
                self.parked.remove(best)
            else:
                self.queues[best.seat].remove(best)
            self._run_rank[id(best)] = self._rank(best)
            self._admitted_at[id(best)] = next(self._order)
            self._admitted_clock[id(best)] = self.clock()
            self._call_of[id(best)] = self._admit_calls
            if why == "starvation":
                self._protected_until[id(best)] = self.clock() + self.cfg.starvation_bound_s
            self._waiting_since.pop(id(best), None)
            self.active.append(best)
            admitted.append(best)
        return admitted

    def _park(self, job) -> None:
        self.active.remove(job)
        self.parked.append(job)
        self._run_rank.pop(id(job), None)
        self._protected_until.pop(id(job), None)
        self._waiting_since[id(job)] = self.clock()
        job.parked_count = getattr(job, "parked_count", 0) + 1

    def pick(self):
        """The active job to advance by one decode cycle, or None."""
        if not self.active:
            return None
        job = min(
            self.active,
            key=lambda j: (self.run_rank(j), self._seat_vtime(j.seat), self._last_run.get(id(j), -1)),
        )
        self._last_run[id(job)] = next(self._order)
        return job

    # ------------------------------------------------------------------ the engine step
    def _top_rank(self) -> int | None:
        """The best class among running requests: only it advances this iteration (running
        work of a lower class waits, as with ``pick``)."""
        return min((self.run_rank(j) for j in self.active), default=None)

    def pick_decoder(self):
        """The decoding request (not prefilling) to advance by one cycle this iteration, of
        the best class running; None when none decodes (or only lower classes do)."""
        top = self._top_rank()
        decoding = [j for j in self.active if prefill_left(j) == 0 and self.run_rank(j) == top]
        if not decoding:
            return None
        job = min(decoding, key=lambda j: (self._seat_vtime(j.seat), self._last_run.get(id(j), -1)))
        self._last_run[id(job)] = next(self._order)
        return job

    def prefill_order(self, every_class: bool = False) -> list:
        """Running prompts of the best class running (``every_class``: all of them, class
        by class, for status readers), in the order their chunks go."""
        top = self._top_rank()
        prompts = [j for j in self.active if prefill_left(j) > 0 and (every_class or self.run_rank(j) == top)]
        prompts.sort(key=lambda j: (j.enqueued_at, self._admitted_at.get(id(j), 0)))
        nth: dict[str, int] = {}  # per seat: how many of its prompts come before this one

        now = self.clock()

        def key(j):
            short = prefill_left(j) <= j.prefill_chunk  # one chunk finishes it: in one go
            # A long prompt running past the starvation bound no longer yields to short
            # ones (a stream of them could otherwise hold it back for good).
            overdue = now - self._admitted_clock.get(id(j), now) >= self.cfg.starvation_bound_s
            i = nth[j.seat] = nth.get(j.seat, -1) + 1
            return (self.run_rank(j), not (short or overdue), i / j.weight)

        keyed = [(key(j), n, j) for n, j in enumerate(prompts)]  # n: arrival order, stable
        return [j for _, _, j in sorted(keyed, key=lambda x: (x[0], x[1]))]

    def prefill_plan(self, spent: int, paced: bool = False, order: list | None = None) -> list[tuple[object, int]]:
        """(prompt, chunks) to run in this iteration's prefill phase, in order, after a
        decode phase that forwarded ``spent`` tokens: whole chunks while they fit in
        ``step_token_budget - spent``, one prompt at a time, and at least one chunk (so a
        budget of 0 is one chunk per iteration). ``paced``: others decode and the prefill
        pacer cut this iteration's prefill to one piece: the first prompt's, one chunk.
        ``order``: ``prefill_order()`` when the caller has it already."""
        left = 0 if paced else self.cfg.step_token_budget - spent
        plan: list[tuple[object, int]] = []
        for job in self.prefill_order() if order is None else order:
            rest, n = prefill_left(job), 0
            while rest > 0:
                size = min(job.prefill_chunk, rest)
                if size > left and (plan or n):
                    break
                left -= size
                rest -= size
                n += 1
            if n:
                plan.append((job, n))
            if rest > 0:  # the budget is spent: later prompts wait for this one
                break
        for job, _ in plan:
            self._last_run[id(job)] = next(self._order)
        return plan

    def waiting_by_seat(self) -> dict[str, dict]:
        """Per seat with waiting or prefilling work: requests waiting for a slot, the longest
        such wait (s), and prompts being prefilled with their tokens left."""
        out: dict[str, dict] = {}

        def seat(s: str) -> dict:
            return out.setdefault(s, {"waiting": 0, "longest_wait_s": 0.0, "prefilling": 0, "prefill_left": 0})

        for j in self.waiting():
            d = seat(j.seat)
            d["waiting"] += 1
            d["longest_wait_s"] = max(d["longest_wait_s"], round(self.waited(j), 3))
        for j in self.active:
            if prefill_left(j) > 0:
                d = seat(j.seat)
                d["prefilling"] += 1
                d["prefill_left"] += prefill_left(j)
        return out

    def charge(self, job, tokens: int) -> None:
        """Account decoded tokens to the job's seat (its share of the model's time)."""
        self.vtime[job.seat] = self._seat_vtime(job.seat) + tokens / job.weight
        # Keep virtual times small: only differences matter.
        floor = min(self.vtime.values())
        if floor > 1e6:
            for seat in self.vtime:
                self.vtime[seat] -= floor
