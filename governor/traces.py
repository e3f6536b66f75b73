"""Synthetic traces: a simulated council and engine driven through a real Governor with
fake probes and a fake clock, recorded exactly as the daemon would record one.

Scenarios (each a function of seconds since start -> the world at that moment):
  quiet     one stream, light load, calm memory: speculation pays, the head stays.
  busy      the council piles in: CPU load climbs, then several streams at once;
            depth falls to 0, the idle head is evicted, and comes back when it calms.
  flapping  memory pressure flips normal <-> warn every 4 s for four minutes: the head goes
            once and does not come back until the restore window has passed calmly.
  critical  a critical spike: depth 0, head out, cache cleared, admissions shed in the
            same tick; released after, the head restored only after the restore window.
  council   batched speculation on a GPU-like machine (extra verify positions nearly free
            in a batch): one stream, then a batch of 4, then the height alternating 2, 3
            every tick, then 8; each bucket of heights finds its own depth (>= 1) and keeps it.
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass
from typing import Callable

from .config import GovernorConfig
from .fakes import FakeClock, FakeLoad, FakeMemoryProbe, SimEngine, gpu_like_batch_cost, seed_like_cost
from .runtime import Governor
from .types import CRITICAL, NORMAL, WARN, Level

GiB = 1 << 30
HEAD_BYTES = 850 << 20


class _Quiet:
    """The generator's governor is a means, not the subject: its log stays silent."""

    def debug(self, *a, **k) -> None:
        pass

    info = debug


@dataclass
class World:
    level: Level = NORMAL
    available_bytes: int = 16 * GiB
    streams: int = 1
    cpu_load: float = 0.1


Scenario = Callable[[float, random.Random], World]


def _quiet(t: float, rng: random.Random) -> World:
    return World(cpu_load=0.1 + 0.05 * rng.random())


def _busy(t: float, rng: random.Random) -> World:
    if t < 60:
        return World(cpu_load=0.2)
    if t < 180:  # load climbs: the wide verify gets dearer
        return World(cpu_load=0.2 + 1.6 * (t - 60) / 120 + 0.1 * rng.random())
    if t < 540:  # several seats at once: batch at depth 0
        return World(streams=3, cpu_load=1.8, available_bytes=10 * GiB)
    return World(cpu_load=0.2)


def _flapping(t: float, rng: random.Random) -> World:
    if 20 <= t < 260:
        warn = int(t // 4) % 2 == 1
        return World(level=WARN if warn else NORMAL, available_bytes=(3 if warn else 5) * GiB)
    return World()


def _critical(t: float, rng: random.Random) -> World:
    if 30 <= t < 50:
        return World(level=CRITICAL, available_bytes=GiB // 4)
    if 50 <= t < 70:
        return World(level=WARN, available_bytes=2 * GiB)
    return World()


def _council(t: float, rng: random.Random) -> World:
    if t < 30:
        return World()
    if t < 120:
        return World(streams=4)
    if t < 240:
        return World(streams=2 + int(t / 0.25) % 2)  # 2, 3, 2, 3 ... tick by tick
    return World(streams=8)


SCENARIOS: dict[str, tuple[Scenario, float]] = {
    "quiet": (_quiet, 120.0),
    "busy": (_busy, 720.0),
    "flapping": (_flapping, 480.0),
    "critical": (_critical, 240.0),
    "council": (_council, 330.0),
}
# Scenarios on a GPU-like machine, where a batched cycle's cost barely grows with its depth
# (the others batch CPU-like: SimEngine's default).
GPU_BATCHES = {"council"}


def generate(name: str, seconds: float | None = None, seed: int = 0, cfg: GovernorConfig | None = None) -> list[str]:
    """Run scenario ``name`` and return its trace as JSON lines (deterministic per seed)."""
    scenario, default_s = SCENARIOS[name]
    seconds = default_s if seconds is None else seconds
    cfg = cfg or GovernorConfig()
    rng = random.Random(seed)
    clock = FakeClock(0.0)
    mem, load = FakeMemoryProbe(), FakeLoad()
    buf = io.StringIO()
    gov = Governor(cfg, clock=clock, memory_probes=[mem], load=load, head_resident=True, head_bytes=HEAD_BYTES,
                   trace=buf, logger=_Quiet())  # fmt: skip
    world = World()

    def sync() -> None:
        nonlocal world
        world = scenario(clock.t, rng)
        mem.level, mem.available_bytes = world.level, world.available_bytes
        load.active, load.cpu_load = world.streams, world.cpu_load

    engine = SimEngine(gov, seed_like_cost(serial_s=0.1), load_fn=lambda: world.cpu_load,
                       streams_fn=lambda: world.streams,
                       batch_cost_fn=gpu_like_batch_cost(0.1) if name in GPU_BATCHES else None)  # fmt: skip
    step = cfg.tick_s
    while clock.t < seconds:
        sync()
        engine.run(step, clock)
    gov.close()
    return buf.getvalue().splitlines()
