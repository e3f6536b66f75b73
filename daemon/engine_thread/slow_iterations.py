"""``engine.slow_iteration``: an engine-loop iteration that held every request for longer than
``log_slow_iteration_s``, with where its time went, so a stall in a log explains itself.

Why: a stall of seconds with every request waiting is a first use the warm-up missed (a
shape's compile on a GPU) or a part's piece that ran long, and nothing else in the log says
which: a fresh H100's council rounds showed 3-4 s gaps between request events and no event in
them (bench/results/h100_2026-12-06g). The iteration's phases are timed (admitting and
starting requests, the decode and prefill step, the warming piece) and the step's shape is
kept (rows, depth, positions, prompt tokens prefilled), and MLX's allocator at the end of it
(memory in use, and freed memory it holds for reuse): a fresh daemon's first council round on an
H100 ran its first 256-token prefill chunks at 55 ms against 21 ms for the same shapes later, with
nothing compiling and nothing warming (bench/results/h100_2026-12-07h); an allocator that has to
go to the device for every buffer is one explanation, and these say whether it was empty."""

from __future__ import annotations

import time

import mlx.core as mx

from ..logs import get_logger

log = get_logger("councild.engine")


class SlowIterationLog:
    """``begin`` at the top of an iteration, ``phase(name)`` after each phase (its time since
    the last mark), ``end(**shape)`` at the bottom: logs the event where the iteration took at
    least ``threshold_s`` (0: never)."""

    def __init__(self, threshold_s: float):
        self.threshold_s = threshold_s
        self._t0 = self._mark = 0.0
        self._phases: dict[str, float] = {}

    def begin(self) -> None:
        self._t0 = self._mark = time.perf_counter()
        self._phases = {}

    def phase(self, name: str) -> None:
        now = time.perf_counter()
        self._phases[name] = now - self._mark
        self._mark = now

    def end(self, **shape) -> None:
        seconds = time.perf_counter() - self._t0
        if self.threshold_s > 0 and seconds >= self.threshold_s:
            log.info("engine.slow_iteration", seconds=round(seconds, 3),
                     phases={k: round(v, 3) for k, v in self._phases.items()}, **shape,
                     active_bytes=mx.get_active_memory(), cache_bytes=mx.get_cache_memory())
