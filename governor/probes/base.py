"""Probe readings and interfaces. A probe never raises: where its signal does not exist on
this OS (or its source is unreadable or malformed), it returns ``available=False``."""

from __future__ import annotations

from typing import Protocol

from msgspec import Struct

from ..types import NORMAL, Level


class MemoryReading(Struct, frozen=True, kw_only=True):
    source: str
    available: bool
    level: Level = NORMAL
    # Bytes that can be allocated before this source reports trouble; None when unknown.
    available_bytes: int | None = None
    total_bytes: int | None = None
    # One human fragment per sub-signal, e.g. "psi some avg10=12.0 -> warn".
    detail: str = ""


class MlxReading(Struct, frozen=True, kw_only=True):
    available: bool
    active_bytes: int | None = None
    cache_bytes: int | None = None
    peak_bytes: int | None = None
    recommended_bytes: int | None = None

    def headroom_bytes(self) -> int | None:
        """Room under MLX's recommended working set. The buffer cache counts as free: it is
        released on ClearCache (and reused by MLX before it allocates anew)."""
        if self.recommended_bytes is None or self.active_bytes is None:
            return None
        return self.recommended_bytes - self.active_bytes


class LoadReading(Struct, frozen=True, kw_only=True):
    active_streams: int = 0
    queued: int = 0
    queued_by_seat: dict[str, int] = {}
    arrival_rate: float = 0.0
    # 1-minute load average per core (1.0 = every core busy); None when unknown.
    cpu_load: float | None = None


class MemoryProbe(Protocol):
    def read(self) -> MemoryReading: ...


class MlxProbe(Protocol):
    def read(self) -> MlxReading: ...


class LoadProbe(Protocol):
    def read(self, now: float) -> LoadReading: ...
