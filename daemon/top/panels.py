"""`councild top`'s panels as rich renderables, from a ``TopView``.

The live screen (app.py) shows them in its widgets; ``frame`` stacks them into the one plain
frame printed when stdout is not a terminal (or with ``--once``). Seat and decision rows are
cells (``seat_cells``, ``decision_cells``) so the live screen's tables and the plain frame's
show the same columns.
"""

from __future__ import annotations

from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from ..cli import _prefill_row, _uptime
from .view import SeatRow, DecisionRow, TopView, clock_time, mb, sparkline

SEAT_COLUMNS = ("seat", "active", "queued", "decoding", "tok/s", "TTFT", "share 1m", "tokens")
DECISION_COLUMNS = ("time", "decision", "actions", "why")
PRESSURE_NAMES = {0: "normal", 1: "warn", 2: "critical"}


def seat_cells(r: SeatRow) -> tuple[str, ...]:
    return (r.seat, str(r.active), str(r.queued), str(r.decoding),
            "-" if r.tokens_per_s is None else f"{r.tokens_per_s:.1f}",
            "-" if r.ttft_s is None else f"{r.ttft_s * 1000:.0f} ms",
            "-" if r.share is None else f"{r.share:.0%}", str(r.tokens))


def decision_cells(r: DecisionRow) -> tuple[str, ...]:
    return (clock_time(r.at), r.decision, ", ".join(r.actions) or "-", r.sentence)


def header(view: TopView) -> Text:
    reply = view.reply or {}
    d = view.detail
    t = Text()
    t.append("councild top", style="bold")
    if reply:
        t.append(f"  {reply.get('model', '?')}  {d.get('state', '?')}  up {_uptime(reply.get('uptime_s', 0))}"
                 f"  pid {d.get('pid', '?')}  {reply.get('active', 0)} active, {reply.get('queued', 0)} queued"
                 f"  {d.get('recent_tokens_per_s', 0):.1f} tok/s ")
        t.append(sparkline(view.throughput, 20), style="cyan")
    if view.error is not None:
        t.append(f"\nunreachable since {clock_time(view.unreachable_since)}: {view.error} (retrying; "
                 "last known state below)", style="bold red")
    if view.paused:
        t.append("  PAUSED (p resumes)", style="bold yellow")
    t.append(f"  sort: {view.sort}", style="dim")
    return t


def seats_table(view: TopView) -> Table:
    table = Table(title="seats", title_justify="left", expand=True, box=None, pad_edge=False)
    for i, c in enumerate(SEAT_COLUMNS):
        table.add_column(c, justify="left" if i == 0 else "right", no_wrap=True)
    for r in view.seats():
        table.add_row(*seat_cells(r), style="bold" if r.decoding else None)
    return table


def decisions_table(view: TopView, limit: int | None = None) -> Table:
    table = Table(title="governor decisions (newest first)", title_justify="left", expand=True, box=None,
                  pad_edge=False)
    for c in DECISION_COLUMNS:
        table.add_column(c, no_wrap=c != "why", overflow="fold")
    for r in view.decisions()[:limit]:
        table.add_row(*decision_cells(r))
    return table


def batch_panel(view: TopView) -> Panel:
    b = view.batch()
    lines = Text(f"height {b['height']} (rows in one forward), {b['decoding']} decoding, {b['prefilling']} prefilling\n"
                 "depth by height: ")
    # * not measured yet (it drafts at the nearest measured height's depth), ? probing a neighbour
    lines.append("  ".join(f"{r['heights']}: {r['depth']}" + ("*" if r.get("chosen") is None else "")
                           + ("?" if r.get("probing") else "") for r in b["by_height"]))
    if b["by_height"]:
        lines.append("   (* not measured, ? probing)", style="dim")
    return Panel(lines, title="batch", title_align="left")


def head_panel(view: TopView) -> Panel:
    h = view.head()
    if not h["available"]:
        text = "absent: the model has no MTP head (serial only)"
    else:
        text = (f"resident, {mb(h['bytes'])}" if h["resident"] else "not resident") + (" (loading)" if h["loading"] else "")
        if h["target"] is not None:
            text += f"; the governor wants it {'in' if h['target'] else 'out'}"
        if h["override"] not in (None, "auto"):
            text += f"; operator override: {h['override']}"
    return Panel(Text(text), title="MTP head", title_align="left")


def memory_panel(view: TopView) -> Panel:
    d = view.detail
    gov = d.get("governor") or {}
    mem = d.get("memory") or {}
    pressure = gov.get("pressure") or "unknown"
    t = Text()
    t.append(f"pressure {pressure}", style={"warn": "yellow", "critical": "bold red"}.get(pressure, "green"))
    if gov.get("shedding"):
        t.append("  SHEDDING new requests", style="bold red")
    t.append(f"  {mb(gov.get('available_bytes'))} available\n")
    t.append(f"MLX active {mb(mem.get('active_bytes'))}, cache {mb(mem.get('cache_bytes'))}, "
             f"peak {mb(mem.get('peak_bytes'))}\n")
    width = 40
    t.append(f"active    {sparkline(view.memory, width)}\n", style="cyan")
    t.append(f"available {sparkline(view.available, width)}\n", style="cyan")
    pressure_line = "".join(" " if p is None else "._!"[p] for p in list(view.pressure)[-width:])
    t.append(f"pressure  {pressure_line}  (. normal, _ warn, ! critical)")
    return Panel(t, title="memory", title_align="left")


def step_panel(view: TopView) -> Panel:
    step = view.detail.get("step") or {}
    if not step.get("steps"):
        return Panel(Text("no engine step yet"), title="step", title_align="left")
    last = step.get("last") or {}
    queue = step.get("prefill_queue") or []
    decode, prefill = step.get("decode_tokens", 0), step.get("prefill_tokens", 0)
    split = f"{decode / (decode + prefill):.0%} decode" if decode + prefill else "-"
    t = Text(f"budget {step.get('budget')} tokens; last: {last.get('decode_tokens', 0)} decode + "
             f"{last.get('prefill_tokens', 0)} prefill; since start {split} of {decode + prefill} tokens "
             f"({step.get('steps_with_prefill', 0)} of {step['steps']} steps prefilled)\n"
             f"prefill queue {len(queue)} ({sum(q.get('left', 0) for q in queue)} tokens left)\n")
    t.append(_prefill_row(step.get("pacing") or {}, step.get("together") or {}, step.get("mixed") or {}))
    return Panel(t, title="step", title_align="left")


def frame(view: TopView, decisions: int = 12) -> Group:
    """The whole screen as one renderable: the plain frame."""
    return Group(header(view), Text(""), seats_table(view), Text(""), batch_panel(view), head_panel(view),
                 memory_panel(view), step_panel(view), decisions_table(view, decisions))
