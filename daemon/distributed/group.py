"""Joining the group, and what each rank reports about itself.

``open_group`` initialises ``mx.distributed`` with the configured backend, the way
``mlx.launch`` (or MLX_RANK + MLX_HOSTFILE, or the backend's own environment) describes
the group. Memory: each rank reads its own pressure probes (the governor's, governor/probes)
and MLX's counters and sends them back to rank 0 with every exchange; rank 0's governor
reads them through ``PeerMemoryProbe`` and so acts on the worst rank.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from governor.probes import MemoryReading
from governor.probes import MlxMemoryProbe, default_memory_probes  # noqa: I001
from governor.types import worst

from ..exits import EXIT_CONFIG, EXIT_SOFTWARE
from .channel import Report

# A report older than this says nothing (a rank that stopped reporting is the watchdog's).
STALE_S = 10.0


class GroupRefused(RuntimeError):
    """The group cannot be formed: ``exit_code`` 70 when the peers could not be reached (a
    restart may find them up), 78 when nothing describes a group (a restart will not help)."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


# Set by mlx.launch (every backend but MPI) or by hand, and by MPI launchers.
_RANK_VARS = ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def open_group(backend: str, env: dict | None = None) -> Any:
    import mlx.core as mx

    env = os.environ if env is None else env
    if not any(v in env for v in _RANK_VARS):
        raise GroupRefused("distributed.enabled is set but nothing describes a group here (no MLX_RANK): start "
                           "every rank with mlx.launch, or set MLX_RANK and MLX_HOSTFILE (docs/OPERATIONS.md, "
                           "Several machines)", EXIT_CONFIG)
    try:
        group = mx.distributed.init(strict=True, backend=backend)
    except (RuntimeError, ValueError) as exc:
        # The ring backend gives up after ~30 s without its neighbours ("Couldn't connect"):
        # the ranks must start within that of each other, or be restarted until they do.
        raise GroupRefused(f"cannot join an mx.distributed group with backend {backend!r}: {exc} (are the other "
                           f"ranks starting? every rank needs MLX_RANK and MLX_HOSTFILE, or mlx.launch)",
                           EXIT_SOFTWARE) from None
    if group.size() < 2:
        raise GroupRefused(f"distributed.enabled is set but the {backend!r} group has one rank: start the ranks "
                           f"with mlx.launch (or MLX_RANK and MLX_HOSTFILE), or turn distributed off", EXIT_CONFIG)
    return group


def backend_name(group: Any, configured: str) -> str:
    if configured != "any":
        return configured
    for name in ("ring", "jaccl", "nccl", "mpi"):
        try:
            import mlx.core as mx

            if mx.distributed.is_available(name):
                return name
        except TypeError:  # an MLX without per-backend availability
            break
    return "any"


class RankProbe:
    """This rank's memory, read at most every ``every_s`` (a report rides every exchange)."""

    def __init__(self, rank: int, governor_table: dict, every_s: float = 0.5):
        from governor import load_config

        self.rank = rank
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.probes = default_memory_probes(load_config(governor_table))
        self.every_s = every_s
        self._at = 0.0
        self._last: Report | None = None

    def report(self) -> Report:
        now = time.monotonic()
        if self._last is not None and now - self._at < self.every_s:
            return self._last
        import mlx.core as mx

        readings = []
        for p in self.probes:
            try:
                r = p.read()
            except Exception as exc:  # a probe must not raise; one that does says nothing
                r = MemoryReading(source=type(p).__name__, available=False, detail=repr(exc))
            if r.available:
                readings.append(r)
        try:
            recommended = mx.device_info().get("max_recommended_working_set_size")
        except Exception:
            recommended = None
        mlx = MlxMemoryProbe(mx.get_active_memory, mx.get_cache_memory, mx.get_peak_memory,
                             lambda: recommended).read()
        avail = [r.available_bytes for r in readings if r.available_bytes is not None]
        room = mlx.headroom_bytes() if mlx.available else None
        if room is not None:
            avail.append(room)
        total = next((r.total_bytes for r in readings if r.total_bytes), None)
        self._last = Report(rank=self.rank, host=self.host, pid=self.pid,
                            level=worst(r.level for r in readings), available_bytes=min(avail) if avail else None,
                            detail="; ".join(f"{r.source}: {r.detail}" for r in readings),
                            active_bytes=mx.get_active_memory(), cache_bytes=mx.get_cache_memory(),
                            peak_bytes=mx.get_peak_memory(), total_bytes=total)
        self._at = now
        return self._last


class PeerMemoryProbe:
    """A governor memory probe (governor/probes/base.py) that reads another rank's latest
    report: the governor takes the worst level and the least room over all its probes."""

    def __init__(self, rank: int, reports: dict[int, tuple[float, Report]], clock=time.monotonic):
        self.rank = rank
        self.reports = reports
        self.clock = clock

    def read(self) -> MemoryReading:
        got = self.reports.get(self.rank)
        source = f"rank{self.rank}"
        if got is None or self.clock() - got[0] > STALE_S:
            return MemoryReading(source=source, available=False, detail="no recent report")
        r = got[1]
        return MemoryReading(source=source, available=True, level=r.level, available_bytes=r.available_bytes,
                             total_bytes=r.total_bytes, detail=f"{r.host}: {r.detail or 'no pressure probe'}")


def describe(report: Report) -> dict:
    """One rank in `status` (detail.group.ranks)."""
    return {"rank": report.rank, "host": report.host, "pid": report.pid,
            "memory": {"active_bytes": report.active_bytes, "cache_bytes": report.cache_bytes,
                       "peak_bytes": report.peak_bytes, "available_bytes": report.available_bytes,
                       "total_bytes": report.total_bytes, "pressure": report.level}}


__all__ = ["GroupRefused", "PeerMemoryProbe", "RankProbe", "backend_name", "describe", "open_group"]
