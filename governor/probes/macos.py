"""macOS memory pressure: the kernel's own verdict plus psutil's available bytes.

``kern.memorystatus_vm_pressure_level`` is what Activity Monitor's pressure graph shows:
1 normal, 2 warn, 4 critical. It is read through sysctlbyname (no fork four times a
second); the reader is injectable so the parsing is tested on any OS.
"""

from __future__ import annotations

import sys
from typing import Callable

from ..types import CRITICAL, NORMAL, WARN, Level
from .base import MemoryReading

_LEVELS: dict[int, Level] = {1: NORMAL, 2: WARN, 4: CRITICAL}


def parse_pressure_level(text: str) -> Level | None:
    """'1' / '2' / '4' (sysctl -n output) -> level; None for anything else."""
    try:
        return _LEVELS.get(int(text.strip()))
    except ValueError:
        return None


def _sysctl_level() -> str:
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    val = ctypes.c_int(0)
    size = ctypes.c_size_t(ctypes.sizeof(val))
    rc = libc.sysctlbyname(b"kern.memorystatus_vm_pressure_level", ctypes.byref(val), ctypes.byref(size), None, 0)
    if rc != 0:
        raise OSError(ctypes.get_errno(), "sysctlbyname failed")
    return str(val.value)


def _psutil_memory() -> tuple[int, int]:
    import psutil

    vm = psutil.virtual_memory()
    return int(vm.available), int(vm.total)


class MacMemoryProbe:
    def __init__(
        self,
        read_level: Callable[[], str] | None = None,
        read_memory: Callable[[], tuple[int, int]] | None = None,
        platform: str | None = None,
    ):
        self._read_level = read_level or _sysctl_level
        self._read_memory = read_memory or _psutil_memory
        # Without an injected reader, only Darwin has the sysctl.
        self._native = read_level is not None or (platform or sys.platform) == "darwin"

    def read(self) -> MemoryReading:
        if not self._native:
            return MemoryReading(source="macos", available=False, detail="not macOS")
        try:
            level = parse_pressure_level(self._read_level())
        except Exception as e:
            return MemoryReading(source="macos", available=False, detail=f"sysctl error: {e!r}")
        if level is None:
            return MemoryReading(source="macos", available=False, detail="unrecognised pressure level")
        try:
            avail, total = self._read_memory()
        except Exception:
            avail = total = None
        return MemoryReading(
            source="macos",
            available=True,
            level=level,
            available_bytes=avail,
            total_bytes=total,
            detail=f"vm_pressure_level -> {level}" + (f"; available={avail >> 20}MiB" if avail is not None else ""),
        )
