"""MLX memory, through callables the daemon injects (the governor never imports mlx).

The daemon passes e.g. ``mx.get_active_memory``, ``mx.get_cache_memory``,
``mx.get_peak_memory`` and ``lambda: mx.device_info().get("max_recommended_working_set_size")``.
Each callable may be missing or may raise (CPU backends lack some); that field is then
None, and the reading is unavailable only when every field is.
"""

from __future__ import annotations

from typing import Callable

from .base import MlxReading

Getter = Callable[[], int] | None


def _call(fn: Getter) -> int | None:
    if fn is None:
        return None
    try:
        v = fn()
        return int(v) if v is not None else None
    except Exception:
        return None


class MlxMemoryProbe:
    def __init__(self, active: Getter = None, cache: Getter = None, peak: Getter = None, recommended: Getter = None):
        self._fns = (active, cache, peak, recommended)

    def read(self) -> MlxReading:
        active, cache, peak, rec = (_call(f) for f in self._fns)
        ok = any(v is not None for v in (active, cache, peak, rec))
        return MlxReading(available=ok, active_bytes=active, cache_bytes=cache, peak_bytes=peak, recommended_bytes=rec)
