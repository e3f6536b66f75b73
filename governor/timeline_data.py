"""The governor's day as series on one time axis, read from a daemon's JSON log or a trace.

``read_timeline(path_or_lines)`` tells the two apart by their records (a log line has
``event`` and ``timestamp``; a trace record ``kind`` and ``t``) and returns a ``Timeline``:

- from a daemon log (``--log-format json``): decisions are the ``governor.decision`` events
  (the ones logged at info, with their sentence), the depth by batch height follows them, the
  head follows ``head.loaded`` / ``head.evicted`` / ``head.load_failed``, pressure and headroom
  the decisions' and ``stats`` events' inputs, council load the requests in flight (accepted
  until done or error) and throughput each request's tokens spread over its decode;
- from a governor trace (``governor_trace``): the trace replayed through the policy with its
  own config (``replay``, exactly the live decisions), pressure, headroom, head residency and
  queues from every tick's observation, batch height and throughput from the decode cycles.

Lines that are not JSON (a traceback, a console-format line, a cut-off last line) are
skipped and counted in ``notes``; so is a log without a governor decision. Nothing here draws
(timeline_plot.py does).
"""

from __future__ import annotations

import datetime
import itertools
import json
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from .config import GovernorConfig
from .heights import bucket_label
from .replay import replay

PRESSURE_LEVEL = {"normal": 0, "warn": 1, "critical": 2}
SOLO = bucket_label(0)  # "1": the depth a lone stream drafts at
THROUGHPUT_BINS = 200  # at most, over the whole span; never narrower than a second


@dataclass
class Decision:
    t: float
    name: str
    sentence: str
    actions: list[str]
    depth: int  # the solo depth after it


@dataclass
class Lane:
    """One run of decisions: what the daemon did, or what a replay would have done."""

    name: str
    depth: dict[str, list[tuple[float, int]]] = field(default_factory=dict)  # heights -> (t, depth) steps
    head: list[tuple[float, bool]] = field(default_factory=list)  # residency (a replay's: its target)
    head_label: str = "head resident"
    decisions: list[Decision] = field(default_factory=list)

    def step(self, label: str, t: float, depth: int | None) -> None:
        if depth is None:
            return
        series = self.depth.setdefault(label, [])
        if not series or series[-1][1] != depth:
            series.append((t, depth))

    def head_is(self, t: float, resident: bool) -> None:
        if not self.head or self.head[-1][1] != resident:
            self.head.append((t, resident))


@dataclass
class Timeline:
    source: str  # "daemon log" or "governor trace"
    wall: bool  # t is Unix seconds (a log); else seconds on the trace's own clock, from its start
    lanes: list[Lane] = field(default_factory=list)
    head_events: list[tuple[float, str, str]] = field(default_factory=list)  # (t, loaded/evicted/load_failed, detail)
    pressure: list[tuple[float, int]] = field(default_factory=list)  # 0 normal, 1 warn, 2 critical
    available_mib: list[tuple[float, float]] = field(default_factory=list)
    load: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # series name -> points
    throughput: list[tuple[float, float]] = field(default_factory=list)  # (bin start, tok/s)
    notes: list[str] = field(default_factory=list)
    span: tuple[float, float] | None = None
    t0: float = 0.0  # a trace's clock at its first record (its times are counted from there)

    def note(self) -> str:
        return "; ".join(self.notes)


# ---------------------------------------------------------------------- reading lines


def _lines(source: str | Iterable[str]) -> Iterator[str]:
    if isinstance(source, str):  # a path: read line by line (a day's log can be large)
        with open(source, encoding="utf-8", errors="replace") as f:
            yield from f
    else:
        for line in source:
            yield line if line.endswith("\n") else line + "\n"


def _records(source: str | Iterable[str], notes: list[str]) -> Iterator[dict]:
    """JSON objects, one a line; a line with a prefix before its object (journalctl's short
    format) is read from its first brace. What is not an object is counted in ``notes``,
    not raised; a last line without its newline that does not parse was cut off mid-write."""
    bad: list[int] = []
    pending: tuple[int, bool] | None = None  # the last line that did not parse, and whether it ended
    n = 0
    for n, line in enumerate(_lines(source), 1):
        if pending is not None:
            bad.append(pending[0])
            pending = None
        start = line.find("{")
        if start < 0:
            if line.strip():
                bad.append(n)
            continue
        try:
            rec = json.loads(line[start:])
        except ValueError:
            pending = (n, line.endswith("\n"))
            continue
        if isinstance(rec, dict):
            yield rec
        else:
            bad.append(n)
    if pending is not None and pending[1]:
        bad.append(pending[0])
    if bad:
        shown = ", ".join(map(str, bad[:5])) + (", ..." if len(bad) > 5 else "")
        plural = "s" if len(bad) > 1 else ""
        notes.append(f"{len(bad)} line{plural} not JSON, skipped (line{plural} {shown})")
    if pending is not None and not pending[1]:
        notes.append(f"the last line ({n}) was cut off mid-record, skipped")


def _unix(ts: str) -> float | None:
    try:
        return datetime.datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()
    except (ValueError, AttributeError):
        return None


def read_timeline(source: str | Iterable[str], cfg: GovernorConfig | None = None) -> Timeline:
    """A log or a trace, told apart by its first record: a trace's has ``kind`` and ``t``."""
    notes: list[str] = []
    records = _records(source, notes)
    first = next(records, None)
    head = [] if first is None else [first]
    if first is not None and "kind" in first and "t" in first and "event" not in first:
        return _from_trace([*head, *records], cfg, notes)
    # A log keeps only the events the picture draws: a day of request lines stays small.
    return _from_log((r for r in itertools.chain(head, records) if r.get("event") in LOG_EVENTS), notes)


# ---------------------------------------------------------------------- a daemon log

HEAD_EVENTS = {"head.loaded": "loaded", "head.evicted": "evicted", "head.load_failed": "load_failed"}
LOG_EVENTS = {"governor.decision", "stats", "request.accepted", "request.done", "request.error", *HEAD_EVENTS}


def _from_log(recs: Iterable[dict], notes: list[str]) -> Timeline:
    tl = Timeline(source="daemon log", wall=True, notes=notes)
    did = Lane("what it did")
    tl.lanes.append(did)
    in_flight: dict[str, str] = {}  # request id -> seat
    flights: list[tuple[float, float]] = []
    seats_busy: list[tuple[float, float]] = []
    decodes: list[tuple[float, float, int]] = []  # (start, end, tokens)
    times = []
    for r in recs:
        t = _unix(r.get("timestamp", ""))
        event = r.get("event")
        if t is None or not isinstance(event, str):
            continue
        times.append(t)
        if event == "governor.decision":
            depth = r.get("depth")
            did.decisions.append(Decision(t, str(r.get("decision", "?")), str(r.get("sentence", "")),
                                          [str(a) for a in r.get("actions") or []], depth if isinstance(depth, int) else -1))
            did.step(SOLO, t, depth if isinstance(depth, int) else None)
            if r.get("heights") not in (None, SOLO) and isinstance(r.get("depth_to"), int):
                did.step(str(r["heights"]), t, r["depth_to"])
            _pressure(tl, t, r.get("pressure"), r.get("available_bytes"))
        elif event in HEAD_EVENTS:
            kind = HEAD_EVENTS[event]
            detail = ", ".join(f"{k}={r[k]}" for k in ("reason", "bytes", "freed_bytes", "ms", "requests_going_serial",
                                                       "source", "error") if k in r)
            tl.head_events.append((t, kind, detail))
            if kind != "load_failed":
                did.head_is(t, kind == "loaded")
        elif event == "stats":
            _pressure(tl, t, r.get("pressure"), None)
        elif event == "request.accepted" and r.get("request_id"):
            in_flight[r["request_id"]] = str(r.get("seat", "?"))
            flights.append((t, len(in_flight)))
            seats_busy.append((t, len(set(in_flight.values()))))
        elif event in ("request.done", "request.error") and r.get("request_id") in in_flight:
            del in_flight[r["request_id"]]
            flights.append((t, len(in_flight)))
            seats_busy.append((t, len(set(in_flight.values()))))
            tokens, rate = r.get("completion_tokens") or 0, r.get("tokens_per_s") or 0
            if tokens and rate:
                decodes.append((t - tokens / rate, t, tokens))
    if times:
        tl.span = (min(times), max(times))
    tl.load = {"requests in flight": flights, "seats with work": seats_busy}
    tl.throughput = _throughput(decodes, tl.span)
    if not did.decisions:
        notes.append("no governor.decision events in this log (governor disabled, log level above info, "
                     "or not a councild JSON log): depth and decisions are empty")
    return tl


def _step(series: list, t: float, v) -> None:
    """A step series keeps only its changes: a day of ticks four a second stays small."""
    if not series or series[-1][1] != v:
        series.append((t, v))


def _pressure(tl: Timeline, t: float, level, available) -> None:
    if level in PRESSURE_LEVEL:
        _step(tl.pressure, t, PRESSURE_LEVEL[level])
    if isinstance(available, (int, float)):
        mib = available / (1 << 20)
        # Headroom moves a little every tick: keep a point when it moved by 1% or more.
        if not tl.available_mib or abs(mib - tl.available_mib[-1][1]) >= 0.01 * max(1.0, tl.available_mib[-1][1]):
            tl.available_mib.append((t, mib))


def _throughput(decodes: list[tuple[float, float, int]], span: tuple[float, float] | None) -> list[tuple[float, float]]:
    """Tokens per second in bins over the span: each request's tokens spread evenly over its
    decode (from its rate and its end)."""
    if not decodes or span is None:
        return []
    lo, hi = min(span[0], min(s for s, _, _ in decodes)), span[1]
    width = max(1.0, (hi - lo) / THROUGHPUT_BINS)
    n = int((hi - lo) / width) + 1
    bins = [0.0] * n
    for start, end, tokens in decodes:
        dur = max(end - start, 1e-6)
        b0, b1 = int((start - lo) / width), int((end - lo) / width)
        for b in range(b0, min(b1, n - 1) + 1):
            a, z = lo + b * width, lo + (b + 1) * width
            overlap = min(z, end) - max(a, start)
            if overlap > 0:
                bins[b] += tokens * overlap / dur
    return [(lo + i * width, v / width) for i, v in enumerate(bins)]


# ---------------------------------------------------------------------- a governor trace


def trace_lane(recs: list[dict], cfg: GovernorConfig | None, name: str, *, simulate_head: bool | None = None,
               without_overrides: bool = False) -> Lane:
    """The trace's ticks through the policy: every tick (all_ticks) for the depth series,
    the ticks that decided something for the markers."""
    lines = [json.dumps(r) for r in recs if not (without_overrides and r.get("kind") == "override")]
    lane = Lane(name, head_label="head wanted in")
    for row in replay(lines, cfg, all_ticks=True, simulate_head=simulate_head):
        t = row["t"]
        lane.step(SOLO, t, row["depth"])
        for b, k in enumerate(row.get("heights") or [], start=1):
            lane.step(bucket_label(b), t, k)
        lane.head_is(t, bool(row["head"]))
        for d in row["decisions"]:
            if d["decision"] not in ("hold", "probe_step", "height_probe_step"):
                lane.decisions.append(Decision(t, d["decision"], d.get("sentence", ""), row["actions"], row["depth"]))
    return lane


def _from_trace(recs: list[dict], cfg: GovernorConfig | None, notes: list[str]) -> Timeline:
    tl = Timeline(source="governor trace", wall=False, notes=notes)
    recs = [r for r in recs if isinstance(r.get("t"), (int, float)) and isinstance(r.get("kind"), str)]
    if not recs:
        notes.append("no trace records")
        return tl
    t0 = tl.t0 = min(r["t"] for r in recs)
    recs = [{**r, "t": r["t"] - t0} for r in recs]
    tl.span = (0.0, max(r["t"] for r in recs))
    try:
        tl.lanes.append(trace_lane(recs, cfg, "what it did"))
    except (ValueError, TypeError, KeyError) as exc:
        notes.append(f"the trace could not be replayed ({exc}): decisions are empty")
    queued: list[tuple[float, float]] = []
    cycles: list[tuple[float, int, int]] = []
    resident = None
    for r in recs:
        t = r["t"]
        if r["kind"] == "obs" and isinstance(r.get("obs"), dict):
            o = r["obs"]
            _pressure(tl, t, o.get("pressure"), o.get("available_bytes"))
            _step(queued, t, o.get("queued") or 0)
            now = o.get("head_resident")
            if resident is not None and now is not None and now != resident:
                tl.head_events.append((t, "loaded" if now else "evicted", "seen by the governor's probe"))
            resident = now if now is not None else resident
        elif r["kind"] == "cycle" and isinstance(r.get("cycle"), dict):
            c = r["cycle"]
            cycles.append((t, c.get("emitted") or 0, c.get("batch") or 1))
        elif r["kind"] == "override":
            tl.head_events.append((t, "override", f"{r.get('action')} {r.get('depth') or ''}".strip()))
    tl.throughput, heights = _cycle_bins(cycles, tl.span)
    tl.load = {"queued": queued, "batch height (most rows in a cycle)": heights}
    if tl.lanes and not tl.lanes[0].decisions:
        notes.append("the governor decided nothing in this trace beyond holding")
    return tl


def _cycle_bins(cycles: list[tuple[float, int, int]], span: tuple[float, float]) -> tuple[list, list]:
    """Per bin of the span: tokens per second the cycles emitted, and the most rows one carried."""
    if not cycles:
        return [], []
    width = max(1.0, (span[1] - span[0]) / THROUGHPUT_BINS)
    n = int((span[1] - span[0]) / width) + 1
    tokens, rows = [0.0] * n, [0] * n
    for t, emitted, batch in cycles:
        b = min(n - 1, int((t - span[0]) / width))
        tokens[b] += emitted
        rows[b] = max(rows[b], batch)
    return ([(span[0] + i * width, v / width) for i, v in enumerate(tokens)],
            [(span[0] + i * width, float(v)) for i, v in enumerate(rows)])
