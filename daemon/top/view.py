"""What `councild top` shows, from the status replies it has read: pure, no terminal.

``TopView`` is fed one status reply a second (``update``; the reply as plain data, as
``councild status --json`` prints it) or a failure (``unreachable``), and keeps the little
history a live view needs: memory and pressure for the sparklines, each seat's token total
over the last minute for its share. Everything else is read from the latest reply; nothing
here talks to the daemon or draws (panels.py draws, app.py runs the screen).
"""

from __future__ import annotations

import datetime
import json
from collections import deque
from dataclasses import dataclass

HISTORY = 60  # samples kept for the sparklines (a minute at the default interval)
SHARE_WINDOW_S = 60.0
SPARK = "▁▂▃▄▅▆▇█"
PRESSURE_LEVEL = {"normal": 0, "warn": 1, "critical": 2}
SORTS = ("seat", "active", "tok/s", "ttft", "share")


def sparkline(values, width: int = 30) -> str:
    """The last ``width`` values as block characters, scaled between their min and max;
    a gap (None) is a blank."""
    vals = list(values)[-width:]
    known = [v for v in vals if v is not None]
    if not known:
        return ""
    lo, hi = min(known), max(known)
    span = hi - lo
    out = []
    for v in vals:
        if v is None:
            out.append(" ")
        else:
            out.append(SPARK[0 if span == 0 else min(len(SPARK) - 1, int((v - lo) / span * len(SPARK)))])
    return "".join(out)


def mb(nbytes) -> str:
    return "?" if nbytes is None else f"{nbytes / 1e6:.1f} MB"


def clock_time(unix: float | None) -> str:
    if unix is None:
        return "--:--:--"
    return datetime.datetime.fromtimestamp(unix).strftime("%H:%M:%S")


@dataclass
class SeatRow:
    seat: str
    active: int
    queued: int
    decoding: int  # active requests past their prefill
    tokens_per_s: float | None
    ttft_s: float | None
    share: float | None  # of the tokens of the last minute (of the last 10 s with one sample)
    tokens: int
    requests: list[dict]  # this seat's active requests, as the reply lists them
    outcomes: dict  # finish reason or error code -> requests ended


@dataclass
class DecisionRow:
    at: float | None  # unix seconds
    decision: str
    actions: list[str]
    sentence: str
    detail: dict


class TopView:
    def __init__(self, history: int = HISTORY):
        self.reply: dict | None = None
        self.error: str | None = None
        self.unreachable_since: float | None = None
        self.memory = deque(maxlen=history)  # MLX active bytes
        self.available = deque(maxlen=history)  # the governor's headroom, bytes
        self.pressure = deque(maxlen=history)  # 0 normal, 1 warn, 2 critical
        self.throughput = deque(maxlen=history)  # tok/s, the daemon's last 10 s
        self._seat_totals: deque[tuple[float, dict[str, int]]] = deque()
        self.sort = SORTS[0]
        self.paused = False

    # ------------------------------------------------------------------ input
    def update(self, reply: dict, now: float) -> None:
        """A status reply (StatusReply as builtins) read at ``now`` (the reader's clock)."""
        self.reply, self.error, self.unreachable_since = reply, None, None
        d = reply.get("detail") or {}
        gov = d.get("governor") or {}
        self.memory.append((d.get("memory") or {}).get("active_bytes"))
        self.available.append(gov.get("available_bytes"))
        self.pressure.append(PRESSURE_LEVEL.get(gov.get("pressure")))
        self.throughput.append(d.get("recent_tokens_per_s"))
        self._seat_totals.append((now, {s: v.get("tokens", 0) for s, v in (d.get("seats") or {}).items()}))
        while self._seat_totals and now - self._seat_totals[0][0] > SHARE_WINDOW_S:
            self._seat_totals.popleft()

    def unreachable(self, error: str, now_unix: float) -> None:
        """No reply: the last one stays on screen, marked stale, until the daemon answers."""
        self.error = error
        if self.unreachable_since is None:
            self.unreachable_since = now_unix
        for series in (self.memory, self.available, self.pressure, self.throughput):
            series.append(None)

    def next_sort(self) -> str:
        self.sort = SORTS[(SORTS.index(self.sort) + 1) % len(SORTS)]
        return self.sort

    # ------------------------------------------------------------------ reading
    @property
    def detail(self) -> dict:
        return (self.reply or {}).get("detail") or {}

    def _shares(self) -> dict[str, float]:
        if len(self._seat_totals) >= 2:
            (_, first), (_, last) = self._seat_totals[0], self._seat_totals[-1]
            # A seat that left and came back restarts its total: count what it has now.
            made = {s: (n - first.get(s, 0)) if n >= first.get(s, 0) else n for s, n in last.items()}
        else:
            made = {s: v.get("tokens_per_s") or 0.0 for s, v in (self.detail.get("seats") or {}).items()}
        total = sum(made.values())
        return {s: n / total for s, n in made.items()} if total > 0 else {}

    def seats(self) -> list[SeatRow]:
        d = self.detail
        shares = self._shares()
        outcomes = ((d.get("stats") or {}).get("requests")) or {}
        active = d.get("active_requests") or []
        rows = []
        for seat, s in (d.get("seats") or {}).items():
            mine = [a for a in active if a.get("seat") == seat]
            rows.append(SeatRow(seat=seat, active=s.get("active", 0), queued=s.get("queued", 0),
                                decoding=sum(1 for a in mine if not a.get("prefill")),
                                tokens_per_s=s.get("tokens_per_s"), ttft_s=s.get("ttft_s"),
                                share=shares.get(seat), tokens=s.get("tokens", 0), requests=mine,
                                outcomes=outcomes.get(seat, {})))
        key = {"seat": lambda r: (r.seat,), "active": lambda r: (-r.active, -r.queued, r.seat),
               "tok/s": lambda r: (-(r.tokens_per_s or 0), r.seat), "ttft": lambda r: (-(r.ttft_s or 0), r.seat),
               "share": lambda r: (-(r.share or 0), r.seat)}[self.sort]
        return sorted(rows, key=key)

    def decisions(self) -> list[DecisionRow]:
        """The governor's recent decisions, newest first, placed on the wall clock by the
        reply's own time (age_s is measured by the daemon)."""
        d = self.detail
        now_unix = (d.get("time") or {}).get("now_unix")
        rows = []
        for r in reversed((d.get("governor") or {}).get("recent_decisions") or []):
            at = None if now_unix is None or r.get("age_s") is None else now_unix - r["age_s"]
            rows.append(DecisionRow(at=at, decision=r.get("decision", "?"), actions=list(r.get("actions") or []),
                                    sentence=r.get("sentence", ""), detail=r))
        return rows

    def batch(self) -> dict:
        """Rows decoding together now and the governor's depth at each bucket of heights."""
        d = self.detail
        active = d.get("active_requests") or []
        batched = [a for a in active if a.get("batched")]
        return {"height": len(batched), "decoding": sum(1 for a in active if not a.get("prefill")),
                "prefilling": sum(1 for a in active if a.get("prefill")),
                "depth": d.get("depth", 0),
                "by_height": (d.get("governor") or {}).get("depth_by_height") or []}

    def head(self) -> dict:
        d = self.detail
        g = (d.get("governor") or {}).get("head") or {}
        return {"resident": d.get("head_resident", False), "bytes": d.get("head_bytes", 0),
                "loading": g.get("head_loading", False), "available": g.get("head_available", True),
                "target": g.get("target"), "override": (d.get("governor") or {}).get("override")}


def seat_detail(row: SeatRow) -> str:
    """An expanded seat: its requests in flight and how its ended requests ended."""
    lines = [f"seat {row.seat}: {row.active} active, {row.queued} queued, {row.tokens} tokens since it appeared"]
    for a in row.requests:
        where = (f"prefill {a['prefill']['done']}/{a['prefill']['total']} tokens" if a.get("prefill")
                 else f"decoding, {a.get('tokens', 0)} tokens out")
        batch = f", batched at depth {a.get('depth')}" if a.get("batched") else ""
        lines.append(f"  {a.get('request_id', '?')} [{a.get('priority', '?')}] {where}{batch}")
    if row.outcomes:
        lines.append("  ended: " + ", ".join(f"{k} {v}" for k, v in sorted(row.outcomes.items())))
    return "\n".join(lines)


def decision_detail(row: DecisionRow) -> str:
    """An expanded decision: its sentence, then every input it was logged with."""
    inputs = {k: v for k, v in row.detail.items() if k not in ("sentence", "age_s")}
    return f"{clock_time(row.at)} {row.decision}: {row.sentence}\n" + json.dumps(inputs, indent=1, default=str)
