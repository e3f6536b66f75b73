"""Draw a ``Timeline`` (timeline_data.py) with plotly: five rows on one time axis, written as
one self-contained HTML file (plotly.js inside: it opens without a server or a network).

Rows: depth by batch height (each decision a marker whose hover is its sentence), the MTP
head (resident or not, each load and eviction marked), memory (pressure level and headroom),
council load, throughput. A timeline with two lanes (a replay beside what the daemon did)
draws the second lane's depth and head dashed and its decisions as open markers.

Needs the ``timeline`` extra (plotly).
"""

from __future__ import annotations

import datetime

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .timeline_data import Timeline

ROWS = ("depth by batch height", "MTP head", "memory", "council load", "throughput (tok/s)")
HEAD_MARKERS = {"loaded": ("triangle-up", "seagreen"), "evicted": ("triangle-down", "firebrick"),
                "load_failed": ("x", "black"), "override": ("diamond", "darkorange")}
# Each bucket of heights one colour, every lane; decisions by kind from another palette, outlined,
# so a marker is not read as a point of the line it sits on; the head's own decisions in the
# head markers' colours.
HEIGHT_COLOURS = {"1": "#1f77b4", "2": "#ff7f0e", "3-4": "#2ca02c", "5-8": "#9467bd", "9+": "#8c564b"}
DECISION_COLOURS = ("#e7298a", "#66a61e", "#e6ab02", "#a6761d", "#7570b3", "#1b9e77", "#d95f02", "#666666",
                    "#17becf", "#bcbd22")
HEAD_DECISIONS = {"evict_head": "firebrick", "load_head": "seagreen", "head_trial": "seagreen"}
DECISION_SYMBOLS = ("circle", "circle-open")


def _x(tl: Timeline, ts: list[float]) -> list:
    if tl.wall:
        return [datetime.datetime.fromtimestamp(t, datetime.timezone.utc) for t in ts]
    return list(ts)


def _extend(tl: Timeline, points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """A step series held to the end of the span (the last value still held then)."""
    if points and tl.span is not None and tl.span[1] > points[-1][0]:
        return [*points, (tl.span[1], points[-1][1])]
    return points


def _wrap(text: str, width: int = 90) -> str:
    out, line = [], ""
    for word in text.split():
        if line and len(line) + len(word) + 1 > width:
            out.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return "<br>".join([*out, line])


def figure(tl: Timeline, title: str = "") -> go.Figure:
    fig = make_subplots(rows=len(ROWS), cols=1, shared_xaxes=True, vertical_spacing=0.04, subplot_titles=ROWS,
                        row_heights=[0.3, 0.12, 0.2, 0.18, 0.2], specs=[[{}], [{}], [{"secondary_y": True}], [{}], [{}]])
    for i, lane in enumerate(tl.lanes):
        dash = "solid" if i == 0 else "dash"
        for label in sorted(lane.depth, key=lambda s: int(s.split("-")[0].rstrip("+"))):
            pts = _extend(tl, lane.depth[label])
            fig.add_trace(go.Scatter(x=_x(tl, [t for t, _ in pts]), y=[k for _, k in pts], mode="lines",
                                     line={"shape": "hv", "dash": dash, "color": HEIGHT_COLOURS.get(label)},
                                     name=f"{lane.name}: depth at heights {label}", legendgroup=f"depth-{i}"),
                          row=1, col=1)
        kinds: dict[str, list] = {}
        for d in lane.decisions:
            kinds.setdefault(d.name, []).append(d)
        for n, (name, ds) in enumerate(kinds.items()):
            colour = HEAD_DECISIONS.get(name, DECISION_COLOURS[n % len(DECISION_COLOURS)])
            fig.add_trace(go.Scatter(
                x=_x(tl, [d.t for d in ds]), y=[d.depth for d in ds], mode="markers",
                marker={"symbol": DECISION_SYMBOLS[min(i, 1)], "size": 10, "color": colour,
                        "line": {"width": 1, "color": "black" if i == 0 else colour}}, name=f"{lane.name}: {name}",
                legendgroup=f"decisions-{i}", customdata=[[d.sentence, ", ".join(d.actions) or "-"] for d in ds],
                hovertext=[f"<b>{name}</b> (depth {d.depth})<br>{_wrap(d.sentence)}<br>actions: {', '.join(d.actions) or '-'}"
                           for d in ds], hoverinfo="text+x"), row=1, col=1)
        if lane.head:
            pts = _extend(tl, [(t, 1.0 if r else 0.0) for t, r in lane.head])
            fig.add_trace(go.Scatter(x=_x(tl, [t for t, _ in pts]), y=[v for _, v in pts], mode="lines",
                                     line={"shape": "hv", "dash": dash, "color": "#444444"},
                                     name=f"{lane.name}: {lane.head_label}",
                                     legendgroup=f"head-{i}"), row=2, col=1)
    events: dict[str, list] = {}
    for t, kind, detail in tl.head_events:
        events.setdefault(kind, []).append((t, detail))
    for kind, evs in events.items():
        symbol, colour = HEAD_MARKERS.get(kind, ("circle", "grey"))
        fig.add_trace(go.Scatter(x=_x(tl, [t for t, _ in evs]), y=[0.5] * len(evs), mode="markers",
                                 marker={"symbol": symbol, "size": 12, "color": colour},
                                 name=f"head {kind.replace('_', ' ')}", hovertext=[f"head {kind}: {d}" for _, d in evs],
                                 hoverinfo="text+x"), row=2, col=1)
    if tl.pressure:
        pts = _extend(tl, tl.pressure)
        fig.add_trace(go.Scatter(x=_x(tl, [t for t, _ in pts]), y=[v for _, v in pts], mode="lines",
                                 line={"shape": "hv", "color": "firebrick"}, name="pressure (0 normal, 1 warn, 2 critical)"),
                      row=3, col=1)
    if tl.available_mib:
        pts = _extend(tl, tl.available_mib)  # known only when read: held until the next reading, not drawn between
        fig.add_trace(go.Scatter(x=_x(tl, [t for t, _ in pts]), y=[v for _, v in pts],
                                 mode="lines+markers", line={"color": "steelblue", "shape": "hv"}, marker={"size": 4},
                                 name="available (MiB)"),
                      row=3, col=1, secondary_y=True)
    for name, pts in tl.load.items():
        if pts:
            pts = _extend(tl, pts)
            fig.add_trace(go.Scatter(x=_x(tl, [t for t, _ in pts]), y=[v for _, v in pts], mode="lines",
                                     line={"shape": "hv"}, name=name), row=4, col=1)
    if tl.throughput:
        fig.add_trace(go.Scatter(x=_x(tl, [t for t, _ in tl.throughput]), y=[v for _, v in tl.throughput],
                                 mode="lines", line={"shape": "hv", "color": "purple"}, name="tokens per second"),
                      row=5, col=1)
    fig.update_yaxes(title_text="depth", rangemode="tozero", dtick=1, row=1, col=1)
    fig.update_yaxes(tickvals=[0, 1], ticktext=["out", "in"], range=[-0.2, 1.2], row=2, col=1)
    fig.update_yaxes(tickvals=[0, 1, 2], ticktext=["normal", "warn", "critical"], range=[-0.2, 2.2], row=3, col=1,
                     secondary_y=False)
    fig.update_yaxes(title_text="MiB", row=3, col=1, secondary_y=True)
    fig.update_xaxes(title_text="time (UTC)" if tl.wall else "seconds from the trace's start", row=len(ROWS), col=1)
    subtitle = f"from a {tl.source}" + (f"<br><sup>note: {_wrap(tl.note(), 150)}</sup>" if tl.notes else "")
    fig.update_layout(title={"text": f"{title or 'the governor'}: {subtitle}"}, height=1100, hovermode="closest",
                      legend={"groupclick": "toggleitem"})
    return fig


def write(tl: Timeline, path: str, title: str = "") -> go.Figure:
    fig = figure(tl, title)
    fig.write_html(path, include_plotlyjs=True, full_html=True)
    return fig
