"""`councild governor timeline` and `governor replay --timeline`: what the picture holds, read
from the figure's data (never its pixels), on logs and traces made here. The picture of a real
daemon's log is tested in tests/e2e/test_ops_views.py."""

from __future__ import annotations

import datetime
import json

import pytest

from governor.replay_cli import main as replay_main, replay_timeline
from governor.timeline import main
from governor.timeline_data import read_timeline
from governor.timeline_plot import figure
from governor.traces import generate

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)

T0 = datetime.datetime(2026, 12, 3, 9, 0, 0, tzinfo=datetime.timezone.utc)


def _line(seconds: float, event: str, **fields) -> str:
    ts = (T0 + datetime.timedelta(seconds=seconds)).isoformat().replace("+00:00", "Z")
    return json.dumps({**fields, "event": event, "level": "info", "timestamp": ts})


def _traces(fig, prefix: str) -> list:
    return [t for t in fig.data if t.name.startswith(prefix) or t.name.endswith(prefix)]


def _council(with_governor: bool = True) -> list[str]:
    lines = [_line(0, "daemon.start"), _line(0.1, "head.loaded", bytes=2_000_000, reason="start-up")]
    for i, seat in enumerate(("planner", "coder", "critic")):
        lines.append(_line(1 + i * 0.1, "request.accepted", request_id=f"r{i}", seat=seat))
    for i, seat in enumerate(("planner", "coder", "critic")):
        lines.append(_line(6 + i, "request.done", request_id=f"r{i}", seat=seat, completion_tokens=100, tokens_per_s=25.0))
    if with_governor:
        lines.insert(3, _line(2.0, "governor.decision", decision="height_adopt", heights="3-4", depth=1, depth_to=0,
                              actions=["SetHeightDepth(3-4: 0)"], sentence="batch heights 3-4: start at depth 0",
                              pressure="normal", active_streams=1))
        lines.insert(5, _line(4.0, "governor.decision", decision="evict_head", depth=0,
                              actions=["SetDepth(0)", "EvictHead"], sentence="operator override: force_evict",
                              pressure="warn", available_bytes=3 << 30))
        lines.insert(6, _line(4.01, "head.evicted", bytes=2_000_000, freed_bytes=2_000_000, ms=3.0))
    return lines


def test_a_log_gives_decisions_head_pressure_load_and_throughput_on_one_axis():
    tl = read_timeline(_council())
    assert tl.wall and tl.notes == []
    fig = figure(tl)
    at = lambda s: T0 + datetime.timedelta(seconds=s)  # noqa: E731
    (evict,) = _traces(fig, "evict_head")
    assert list(evict.x) == [at(4.0)] and "force_evict" in evict.hovertext[0] and evict.customdata[0][0]
    (evicted,) = _traces(fig, "head evicted")
    assert list(evicted.x) == [at(4.01)]
    (resident,) = _traces(fig, "head resident")
    assert list(zip(resident.x, resident.y))[:2] == [(at(0.1), 1.0), (at(4.01), 0.0)]
    (height,) = _traces(fig, "depth at heights 3-4")
    assert (height.x[0], height.y[0]) == (at(2.0), 0)
    (pressure,) = _traces(fig, "pressure")
    assert list(pressure.y[:2]) == [0, 1]  # normal at 2 s, warn at 4 s
    (flight,) = _traces(fig, "requests in flight")
    assert max(flight.y) == 3 and flight.y[-1] == 0
    (rate,) = _traces(fig, "tokens per second")
    # 300 tokens over the three requests' decodes (each 100 tokens at 25 tok/s: 4 s)
    width = (rate.x[1] - rate.x[0]).total_seconds()
    assert sum(rate.y) * width == pytest.approx(300, rel=1e-6)


def test_garbage_a_cut_last_line_and_no_governor_still_draw_with_one_note(tmp_path, capsys):
    lines = _council(with_governor=False)
    lines.insert(2, "Traceback (most recent call last):")
    lines.insert(3, '  File "x.py", line 1, in <module>')
    lines.insert(5, "[1, 2, 3]")
    log = tmp_path / "daemon.log"
    log.write_text("\n".join(lines) + "\n" + _line(9, "request.done")[:40])  # written mid-line
    out = tmp_path / "day.html"
    assert main([str(log), "-o", str(out)]) == 0
    text = out.read_text()
    assert "plotly" in text.lower() and len(text) > 100_000  # plotly.js inside: opens without a network
    std = capsys.readouterr()
    assert std.out.startswith(f"wrote {out}") and "head loaded 1x" in std.out
    note = std.err.strip().splitlines()
    assert len(note) == 1 and note[0].startswith("note: "), std.err
    assert "3 lines not JSON" in note[0] and "cut off" in note[0] and "no governor.decision" in note[0]
    # The picture says it too, and still has the load and the head.
    fig = figure(read_timeline(str(log)))
    assert "cut off" in fig.layout.title.text and _traces(fig, "requests in flight")


def test_an_empty_or_unreadable_source(tmp_path, capsys):
    empty = tmp_path / "empty.log"
    empty.write_text("")
    assert main([str(empty), "-o", str(tmp_path / "e.html")]) == 0
    assert (tmp_path / "e.html").exists() and "no governor.decision" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.log"), "-o", str(tmp_path / "m.html")]) == 1
    assert main([str(empty), "-o", str(tmp_path / "e.png")]) == 2  # HTML only: said, not guessed
    assert "name it .html" in capsys.readouterr().err


def test_a_trace_is_replayed_into_the_live_decisions():
    tl = read_timeline(generate("critical"))
    assert not tl.wall and tl.source == "governor trace"
    fig = figure(tl)
    (evict,) = _traces(fig, "what it did: evict_head")
    assert 30 <= evict.x[0] < 30.5  # the critical spike starts at 30 s
    (load,) = _traces(fig, "what it did: load_head")
    assert load.x[0] > 50 + 60  # restored only after the restore window (60 s) of calm
    (pressure,) = _traces(fig, "pressure")
    assert 2 in pressure.y and pressure.y[-1] == 0
    (evicted,) = _traces(fig, "head evicted")  # residency as the governor's probe saw it
    assert evicted.x[0] >= evict.x[0]


def test_replay_draws_what_auto_would_have_done_beside_what_it_did(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    lines = generate("quiet")
    # An operator forced the head out at 60 s and never gave control back.
    at = next(i for i, line in enumerate(lines) if json.loads(line)["t"] >= 60)
    lines.insert(at, json.dumps({"t": json.loads(lines[at])["t"], "kind": "override", "action": "evict_head",
                                 "depth": None}))
    trace.write_text("\n".join(lines) + "\n")
    out = tmp_path / "what-if.html"
    assert replay_main([str(trace), "--without-overrides", "--timeline", str(out)]) == 0
    assert out.exists() and "replayed without overrides" in capsys.readouterr().out
    fig = figure(replay_timeline(lines, without_overrides=True, simulate_head=True))
    assert [t.x[0] for t in _traces(fig, "what it did: evict_head")] == pytest.approx([60], abs=0.3)
    assert not _traces(fig, "replayed without overrides: evict_head")
    did, auto = _traces(fig, "what it did: head wanted in"), _traces(fig, "replayed without overrides: head wanted in")
    assert did[0].y[-1] == 0 and auto[0].y[-1] == 1  # out at the end, as forced; auto keeps it
