"""Fakes for the probes and the clock, and a tiny simulated engine, for tests and the
synthetic traces. Plain mutable objects: a test sets a field, ticks, and looks."""

from __future__ import annotations

from typing import Callable

from .heights import N_BUCKETS, depth_at
from .probes.base import LoadReading, MemoryReading, MlxReading
from .types import NORMAL, Action, CycleTelemetry, EvictHead, Level, LoadHead, SetDepth, SetHeightDepth


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> float:
        self.t += dt
        return self.t


class FakeMemoryProbe:
    def __init__(self, level: Level = NORMAL, available_bytes: int | None = 16 << 30, available: bool = True):
        self.level, self.available_bytes, self.available = level, available_bytes, available

    def read(self) -> MemoryReading:
        if not self.available:
            return MemoryReading(source="fake", available=False)
        return MemoryReading(source="fake", available=True, level=self.level, available_bytes=self.available_bytes,
                             detail=f"fake -> {self.level}")  # fmt: skip


class RaisingProbe:
    """A badly behaved probe: the governor must survive it."""

    def read(self):
        raise RuntimeError("probe exploded")


class FakeMlxProbe:
    def __init__(self, active: int | None = 0, recommended: int | None = None):
        self.active, self.recommended = active, recommended

    def read(self) -> MlxReading:
        return MlxReading(available=True, active_bytes=self.active, cache_bytes=0, peak_bytes=self.active,
                          recommended_bytes=self.recommended)  # fmt: skip


class FakeLoad:
    def __init__(self, active: int = 1, queued: int = 0, arrival_rate: float = 0.0, cpu_load: float | None = 0.1):
        self.active, self.queued, self.arrival_rate, self.cpu_load = active, queued, arrival_rate, cpu_load

    def read(self, now: float) -> LoadReading:
        return LoadReading(active_streams=self.active, queued=self.queued, arrival_rate=self.arrival_rate,
                           cpu_load=self.cpu_load)  # fmt: skip


# A depth-k cycle's cost in seconds, given the council's CPU load.
CostFn = Callable[[int, float], float]


def seed_like_cost(serial_s: float = 0.05, verify_per_depth: float = 0.3, load_penalty: float = 1.0) -> CostFn:
    """Serial step ``serial_s``; each drafted position adds ``verify_per_depth`` steps, and
    council load makes the wide verify dearer (the seed: +23% quiet, -16% under load)."""

    def cost(k: int, load: float) -> float:
        return serial_s * (1.0 + load) * (1.0 + k * verify_per_depth * (1.0 + load_penalty * load))

    return cost


def gpu_like_batch_cost(serial_s: float = 0.05) -> Callable[[int, int], float]:
    """A batched cycle on a memory-bound GPU: each row adds 0.2 step, each drafted position
    0.05 of the batch's cost (the H200's 27B-shape rows: 4 x 2 positions cost 1.19x 4 x 1),
    so speculation pays in a batch."""

    def cost(n: int, k: int) -> float:
        return serial_s * (1.0 + 0.2 * (n - 1)) * (1.0 + 0.05 * k)

    return cost


class SimEngine:
    """Applies a governor's actions the way the step loop would (at once) and produces
    deterministic cycle telemetry: acceptance a per position, cost from ``cost_fn``."""

    def __init__(
        self,
        gov,
        cost_fn: CostFn,
        acceptance: float = 0.85,
        load_fn: Callable[[], float] = lambda: 0.1,
        streams_fn: Callable[[], int] = lambda: 1,
        batch_cost_fn: Callable[[int, int], float] | None = None,
    ):
        self.gov, self.cost_fn, self.acceptance, self.load_fn = gov, cost_fn, acceptance, load_fn
        self.streams_fn = streams_fn
        # A batched cycle's cost in seconds by (rows, depth); None: the CPU-like default below.
        self.batch_cost_fn = batch_cost_fn
        self.depth = gov.depth
        # The batch heights' depths (SetHeightDepth), index bucket - 1; None: the solo depth.
        # As the daemon does, it starts from the governor's table (a learned profile sets it).
        table = [h.depth for h in gov.state.heights]
        self.heights: list[int | None] = table + [None] * (N_BUCKETS - 1 - len(table))
        self.resident = bool(gov._head["head_resident"])
        self.history: list[tuple[float, Action]] = []
        self._phase = 0.0

    def apply(self, actions: list[Action]) -> None:
        for a in actions:
            self.history.append((self.gov.clock(), a))
            if isinstance(a, SetDepth):
                self.depth = a.depth
            elif isinstance(a, SetHeightDepth):
                self.heights[a.bucket - 1] = a.depth
            elif isinstance(a, EvictHead):
                self.resident = False
                self.gov.note_head(resident=False)
            elif isinstance(a, LoadHead):
                self.resident = True
                self.gov.note_head(resident=True)

    def cycle(self) -> CycleTelemetry:
        """One cycle at the current depth; acceptance is a deterministic low-discrepancy
        sequence (no RNG), so the long-run accepted fraction per position is ``acceptance``.
        Several streams are one batched cycle at the height's depth, costed by
        ``batch_cost_fn``, else CPU-like (compute-bound): a batch of n rows costs
        1 + 0.1(n-1) steps, and each drafted position 0.9 of that again, so speculation
        does not pay in a batch."""
        n = self.streams_fn()
        if n > 1:
            k = depth_at(tuple(self.heights), self.depth, n) if self.resident else 0
            rows = tuple(self._accepted(k) for _ in range(n))
            if self.batch_cost_fn is not None:
                c = self.batch_cost_fn(n, k)
            else:
                c = self.cost_fn(0, self.load_fn()) * (1.0 + 0.1 * (n - 1)) * (1.0 + 0.9 * k)
            t = CycleTelemetry(depth=k, cycle_s=c, drafted=n * k, accepted=sum(rows), emitted=n + sum(rows), batch=n,
                               row_accepted=rows if k else None)  # fmt: skip
            self.gov.record_cycle(t)
            return t
        k = self.depth if self.resident else 0
        accepted = self._accepted(k)
        c = self.cost_fn(k, self.load_fn())
        t = CycleTelemetry(depth=k, cycle_s=c, drafted=k, accepted=accepted, emitted=1 + accepted)
        self.gov.record_cycle(t)
        return t

    def _accepted(self, k: int) -> int:
        accepted = 0
        for _ in range(k):
            self._phase = (self._phase + 0.6180339887498949) % 1.0
            if self._phase >= self.acceptance:
                break
            accepted += 1
        return accepted

    def run(self, seconds: float, clock) -> None:
        """Run cycles and ticks for ``seconds`` of fake time (ticks every cfg.tick_s)."""
        end = clock.t + seconds
        tick_s = self.gov.cfg.tick_s
        next_tick = clock.t
        while clock.t < end:
            if clock.t >= next_tick:
                self.apply(self.gov.tick())
                next_tick += tick_s
            if self.streams_fn() == 0:  # nobody asking: the step loop sleeps until the tick
                clock.t = max(clock.t, next_tick)
                continue
            t = self.cycle()
            clock.advance(t.cycle_s)


class RecordingLogger:
    """Stands in for the structlog logger: keeps (level, event, fields) for assertions."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict]] = []

    def debug(self, event: str, **kw) -> None:
        self.events.append(("debug", event, kw))

    def info(self, event: str, **kw) -> None:
        self.events.append(("info", event, kw))


def make_estimates(scores, stale=False, samples: int = 50, cost_rse: float | None = None) -> tuple:
    """DepthEstimates with the given scores (tokens/s per depth, None = unknown), as if a
    cycle cost 1/score seconds per token; ``stale`` is one flag or one per depth;
    ``cost_rse`` the costs' relative standard error (None: noise unknown, the fixed
    depth_margin applies)."""
    from .types import DepthEstimate

    flags = stale if isinstance(stale, (list, tuple)) else [stale] * len(scores)
    return tuple(
        DepthEstimate(depth=k, expected_tokens=1.0, cost_s=None if sc is None else 1.0 / sc, score=sc,
                      samples=samples, source="measured", stale=flags[k], cost_rse=cost_rse)  # fmt: skip
        for k, sc in enumerate(scores)
    )
