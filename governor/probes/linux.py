"""Linux memory pressure: PSI, cgroup v2 and MemAvailable.

Parsers are pure functions of a file's text and return None for text they do not
understand; the reader takes a root directory (tests point it at a temp dir holding
recorded files) and turns any missing or malformed source into "unavailable".
The classifier combines whatever is available; the worst signal wins.
"""

from __future__ import annotations

import os
from typing import Literal

from msgspec import Struct

from ..config import LinuxThresholds
from ..types import CRITICAL, NORMAL, WARN, Level, worst
from .base import MemoryReading


class PsiLine(Struct, frozen=True):
    avg10: float
    avg60: float
    avg300: float
    total: int


class Psi(Struct, frozen=True):
    some: PsiLine
    # Absent on kernels before 5.x for the system file; always there for cgroups.
    full: PsiLine | None = None


class Cgroup(Struct, frozen=True, kw_only=True):
    current: int
    high: int | Literal["max"] = "max"
    max: int | Literal["max"] = "max"
    pressure: Psi | None = None

    def limit(self) -> int | None:
        """The effective limit (the lower of high and max); None when unlimited."""
        lims = [v for v in (self.high, self.max) if v != "max"]
        return min(lims) if lims else None


# ---------------------------------------------------------------- parsers


def parse_psi(text: str) -> Psi | None:
    """'some avg10=0.12 avg60=.. avg300=.. total=..' and an optional 'full ...' line."""
    lines: dict[str, PsiLine] = {}
    try:
        for raw in text.splitlines():
            parts = raw.split()
            if not parts:
                continue
            kind, fields = parts[0], dict(p.split("=", 1) for p in parts[1:])
            if kind not in ("some", "full"):
                return None
            lines[kind] = PsiLine(
                float(fields["avg10"]), float(fields["avg60"]), float(fields["avg300"]), int(fields["total"])
            )
    except (ValueError, KeyError):
        return None
    if "some" not in lines:
        return None
    return Psi(lines["some"], lines.get("full"))


def parse_meminfo(text: str) -> dict[str, int] | None:
    """'/proc/meminfo' -> {key: bytes}; None unless MemTotal and MemAvailable are there."""
    out: dict[str, int] = {}
    for raw in text.splitlines():
        key, sep, rest = raw.partition(":")
        parts = rest.split()
        if not sep or not parts:
            continue
        try:
            n = int(parts[0])
        except ValueError:
            continue
        out[key.strip()] = n * 1024 if parts[1:] == ["kB"] else n
    if "MemTotal" not in out or "MemAvailable" not in out:
        return None
    return out


def parse_own_cgroup(text: str) -> str | None:
    """The cgroup v2 path of this process: the '0::/path' line of /proc/self/cgroup."""
    for raw in text.splitlines():
        hier, _, rest = raw.partition(":")
        ctrl, _, path = rest.partition(":")
        if hier == "0" and ctrl == "" and path.startswith("/"):
            return path
    return None


def parse_cgroup_bytes(text: str) -> int | Literal["max"] | None:
    """memory.current / memory.high / memory.max: an integer, or 'max' for unlimited."""
    s = text.strip()
    if s == "max":
        return "max"
    try:
        n = int(s)
    except ValueError:
        return None
    return n if n >= 0 else None


# ---------------------------------------------------------------- classifier


def _psi_level(psi: Psi, th: LinuxThresholds) -> Level:
    some, full = psi.some.avg10, psi.full.avg10 if psi.full else 0.0
    if some >= th.psi_some_critical or full >= th.psi_full_critical:
        return CRITICAL
    if some >= th.psi_some_warn or full >= th.psi_full_warn:
        return WARN
    return NORMAL


def _below(avail: int, warn_at: float, crit_at: float) -> Level:
    return CRITICAL if avail < crit_at else WARN if avail < warn_at else NORMAL


def classify(
    th: LinuxThresholds,
    psi: Psi | None = None,
    meminfo: dict[str, int] | None = None,
    cgroup: Cgroup | None = None,
) -> MemoryReading:
    """Combine the Linux signals into one reading; unavailable when none is there."""
    levels: list[Level] = []
    notes: list[str] = []
    avail: list[int] = []
    total: int | None = None
    if psi is not None:
        lv = _psi_level(psi, th)
        full = psi.full.avg10 if psi.full else 0.0
        levels.append(lv)
        notes.append(f"psi some={psi.some.avg10:.1f} full={full:.1f} -> {lv}")
    if meminfo is not None:
        total, free = meminfo["MemTotal"], meminfo["MemAvailable"]
        warn_at = th.memavail_warn_bytes if th.memavail_warn_bytes is not None else th.memavail_warn_frac * total
        crit_at = (
            th.memavail_critical_bytes if th.memavail_critical_bytes is not None else th.memavail_critical_frac * total
        )
        lv = _below(free, warn_at, crit_at)
        levels.append(lv)
        avail.append(free)
        notes.append(f"memavail={free >> 20}MiB (warn<{int(warn_at) >> 20} crit<{int(crit_at) >> 20}) -> {lv}")
    if cgroup is not None:
        limit = cgroup.limit()
        if limit is not None:
            room = limit - cgroup.current
            lv = _below(room, th.cgroup_warn_frac * limit, th.cgroup_critical_frac * limit)
            levels.append(lv)
            avail.append(room)
            total = limit if total is None else min(total, limit)
            notes.append(f"cgroup room={room >> 20}MiB of {limit >> 20}MiB -> {lv}")
        if cgroup.pressure is not None:
            lv = _psi_level(cgroup.pressure, th)
            levels.append(lv)
            notes.append(f"cgroup psi some={cgroup.pressure.some.avg10:.1f} -> {lv}")
    if not levels:
        return MemoryReading(source="linux", available=False, detail="no linux memory signal")
    return MemoryReading(
        source="linux",
        available=True,
        level=worst(levels),
        available_bytes=min(avail) if avail else None,
        total_bytes=total,
        detail="; ".join(notes),
    )


# ---------------------------------------------------------------- reader


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:
        return None


class LinuxMemoryProbe:
    """Reads /proc and /sys/fs/cgroup under ``root`` (``/`` in production)."""

    def __init__(self, thresholds: LinuxThresholds | None = None, root: str = "/"):
        self.th = thresholds or LinuxThresholds()
        self.root = root

    def _p(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def read_cgroup(self) -> Cgroup | None:
        text = _read(self._p("proc", "self", "cgroup"))
        rel = parse_own_cgroup(text) if text is not None else None
        if rel is None:
            return None
        base = self._p("sys", "fs", "cgroup", rel.lstrip("/"))
        vals = {}
        for name in ("current", "high", "max"):
            t = _read(os.path.join(base, f"memory.{name}"))
            vals[name] = parse_cgroup_bytes(t) if t is not None else ("max" if name != "current" else None)
        cur = vals["current"]
        if not isinstance(cur, int) or vals["high"] is None or vals["max"] is None:
            return None  # cgroup v1, or malformed: no cgroup signal
        pt = _read(os.path.join(base, "memory.pressure"))
        return Cgroup(current=cur, high=vals["high"], max=vals["max"], pressure=parse_psi(pt) if pt else None)

    def read(self) -> MemoryReading:
        try:
            psi_t = _read(self._p("proc", "pressure", "memory"))
            mem_t = _read(self._p("proc", "meminfo"))
            return classify(
                self.th,
                psi=parse_psi(psi_t) if psi_t is not None else None,
                meminfo=parse_meminfo(mem_t) if mem_t is not None else None,
                cgroup=self.read_cgroup(),
            )
        except Exception as e:  # never let a probe take the governor down
            return MemoryReading(source="linux", available=False, detail=f"probe error: {e!r}")
