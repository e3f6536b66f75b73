"""Signal probes: memory pressure (Linux, macOS), MLX memory, council load."""

from __future__ import annotations

import sys

from ..config import GovernorConfig
from .base import LoadProbe, LoadReading, MemoryProbe, MemoryReading, MlxProbe, MlxReading
from .linux import LinuxMemoryProbe
from .load import LoadTracker
from .macos import MacMemoryProbe
from .mlx import MlxMemoryProbe


def default_memory_probes(cfg: GovernorConfig, platform: str | None = None) -> list[MemoryProbe]:
    """The memory probes that apply to this OS (the others would only say unavailable)."""
    platform = platform or sys.platform
    if platform == "darwin":
        return [MacMemoryProbe()]
    if platform.startswith("linux"):
        return [LinuxMemoryProbe(cfg.linux)]
    return []


__all__ = [
    "LinuxMemoryProbe",
    "LoadProbe",
    "LoadReading",
    "LoadTracker",
    "MacMemoryProbe",
    "MemoryProbe",
    "MemoryReading",
    "MlxMemoryProbe",
    "MlxProbe",
    "MlxReading",
    "default_memory_probes",
]
