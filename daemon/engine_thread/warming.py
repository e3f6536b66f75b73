"""Serve first, improve after: the start-up checks that run once the daemon is ready.

A daemon answers as soon as its weights and head are loaded and one plain eager step has
run (startup.py). What made a start slow then runs here, on the engine thread, a piece at a
time, while no request is waiting (worker.py calls ``step`` when idle; under load that never
idles, a piece now and then, within a share of the engine's time): the compiled
step's self-checks, the exactness probes (verify, batch, the prefix cache's chunk splits),
the cost probes (prefill_together, mixed_steps) and the warm-up of each shape (warmup.py).
Each is a ``WarmPart``: ``check`` (run piecewise, engine/pieces.py) returns an ``Outcome``,
whose ``apply`` switches the faster path in. Until it has, requests take the safe path:
eager steps; exact greedy requests decode serially and alone; prompts prefill in whole
chunks, each alone; the prefix cache snapshots on the chunk grid only.

The parts run the compiled step first (the other probes' verdicts are keyed by the decode
path it decides), from the same functions with the same verdicts file (probe_verdicts.py)
as a start that waits for them, so a path switched in here is the path that start would
have chosen. Each part ends with one ``engine.warm`` event (switched in or not,
and why); ``engine.warmed`` follows the last. ``debug_fail_warm`` (a test hook) names parts
whose check is taken as failed: the path stays out and the event says so.

Started in a tensor-parallel group, or with ``warm_in_background = false``, the parts run to
their end before ready (``run_all``): a group's ranks must run the same forwards in lockstep.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..engine.pieces import PiecewiseRun
from ..logs import get_logger

log = get_logger("councild.engine")


@dataclass
class Outcome:
    """What a part's check found: ``switch`` whether its faster path goes in, ``reason`` why
    (or why not), ``apply`` what sets it (also when ``switch`` is False: the verdict itself,
    e.g. what status says exact requests get), ``fields`` for the event."""

    switch: bool
    reason: str
    apply: Callable[[], None] | None = None
    fields: dict = field(default_factory=dict)


@dataclass
class WarmPart:
    name: str
    check: Callable[[], Outcome]
    # Called with the reason when the check raised or was forced to fail: what the safe
    # path's status should say now that the part is over (e.g. the decode path's "eager: why").
    refused: Callable[[str], None] | None = None
    # Who waits for its verdict, which sets its share of a busy engine (worker.py):
    # "every" request (the compiled step, the shapes' warm-up); "exact" greedy requests only
    # (verify, batch, splits: fast ones speculate, batch and reuse snapshots anywhere without
    # them); "none" (the cost probes prefill_together and mixed_steps: each decides an
    # optional speed-up, and the path every request takes meanwhile is the one they test);
    # "idle": runs only while the engine idles (prefill_lengths: a warm-up that serving does
    # as it goes; under a council's load it would only take the council's time).
    waited_by: str = "every"


class Warming:
    """The parts still to run, one piece per ``step``; the status snapshot's ``warming``."""

    def __init__(self, parts: list[WarmPart], publish: Callable[[dict], None], forced_failures=()):
        self.parts = list(parts)
        self.publish = publish
        self.forced = set(forced_failures)
        self.started = time.monotonic()
        self.results: dict[str, dict] = {}
        self._run: PiecewiseRun | None = None
        self._finished_logged = False
        self._publish()

    @property
    def pending(self) -> list[str]:
        return [p.name for p in self.parts]

    @property
    def waited_by(self) -> str:
        """Who waits for the part under way (WarmPart.waited_by); "none" when none is left."""
        return self.parts[0].waited_by if self.parts else "none"

    def step(self) -> bool:
        """Run one piece of the current part; False when nothing is left."""
        if not self.parts:
            return False
        part = self.parts[0]
        if self._run is None:
            self._run = PiecewiseRun(part.check)
            self._publish()
        if self._run.step():
            self._finish(part, self._run)
            self._run = None
            self.parts.pop(0)
            self._publish()
            if not self.parts:
                self._log_done()
        return True

    def run_all(self) -> None:
        while self.step():
            pass

    def abandon(self) -> None:
        """The daemon stops mid-way: the part running is torn down (nothing switched in)."""
        if self._run is not None:
            self._run.abandon()
            self._run = None

    def _finish(self, part: WarmPart, run: PiecewiseRun) -> None:
        outcome: Outcome | None = run.result if run.error is None else None
        if run.error is not None or part.name in self.forced:
            switched = False
            reason = (f"the check raised {type(run.error).__name__}: {str(run.error)[:300]}" if run.error is not None
                      else "check forced to fail (debug_fail_warm): the path stays out")
            if part.refused is not None:
                part.refused(reason)
        else:
            switched, reason = outcome.switch, outcome.reason
            if outcome.apply is not None:
                outcome.apply()
        seconds = round(time.monotonic() - self.started, 3)
        self.results[part.name] = {"switched_in": switched, "reason": reason, "at_s": seconds}
        log.info("engine.warm", part=part.name, switched_in=switched, reason=reason, at_s=seconds,
                 busy_ms=round(run.busy_s * 1000, 1), pieces=run.pieces,
                 longest_piece_ms=round(run.longest_s * 1000, 1), **(outcome.fields if outcome is not None else {}))

    def _log_done(self) -> None:
        if not self._finished_logged:
            self._finished_logged = True
            log.info("engine.warmed", seconds=round(time.monotonic() - self.started, 3),
                     switched_in=[n for n, r in self.results.items() if r["switched_in"]],
                     left_out=[n for n, r in self.results.items() if not r["switched_in"]])

    def _publish(self) -> None:
        self.publish({"pending": self.pending, "running": self.parts[0].name if self._run is not None else None,
                      "parts": dict(self.results)})


class BusyShare:
    """How much of a busy engine's time the parts may take: each second it serves earns
    ``share / (1 - share)`` seconds of credit (up to ``burst_s``); pieces run while the credit
    is positive and are charged their length, so a piece longer than the credit leaves a debt
    that serving repays first. Pieces (10-300 ms) are short next to a prompt's prefill step (a
    256-token chunk, ~0.6 s on this CPU): a piece a step gave the parts a small part of their
    share, and verdicts that speed round 0 up came in round 1. ``clock`` is injected for tests."""

    def __init__(self, share: float, burst_s: float, clock: Callable[[], float] = time.monotonic):
        self.set_share(share)
        self.burst_s = burst_s
        self.clock = clock
        self.credit = 0.0
        self._mark: float | None = None  # the end of the last piece (or of the last look)

    def set_share(self, share: float) -> None:
        """Earn at this share from now on."""
        self.rate = share / (1 - share)

    def earn(self) -> float:
        """Credit for the serving since the last piece ended; the credit now."""
        now = self.clock()
        if self._mark is not None:
            self.credit = min(self.burst_s, self.credit + (now - self._mark) * self.rate)
        self._mark = now
        return self.credit

    def charge(self, seconds: float) -> None:
        self.credit -= seconds
        self._mark = self.clock()

    def idle(self) -> None:
        """The engine idled and ran a piece freely: nothing earned or owed."""
        self.credit, self._mark = 0.0, None
