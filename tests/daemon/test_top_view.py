"""`councild top`'s view and plain frame from status replies made here (no daemon, no
terminal); the live screen against a real daemon is tests/e2e/test_ops_views.py."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from daemon.top.panels import frame
from daemon.top.view import TopView, decision_detail, seat_detail, sparkline

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)


def reply(tokens: dict[str, int], *, pressure="normal", available=8 << 30, decisions=(), now_unix=1_000.0) -> dict:
    seats = {s: {"active": 1 if n else 0, "queued": 1 if s == "critic" else 0, "tokens": n,
                 "tokens_per_s": n / 10, "ttft_s": 0.05 * (i + 1)} for i, (s, n) in enumerate(tokens.items())}
    active = [{"request_id": f"r-{s}", "seat": s, "priority": "normal", "tokens": n, "batched": True, "depth": 0}
              for s, n in tokens.items() if n]
    active.append({"request_id": "r-long", "seat": "critic", "priority": "normal", "tokens": 0,
                   "prefill": {"done": 256, "total": 3000}})
    return {"server": "councild 0.1.0", "model": "tiny", "uptime_s": 75.0, "active": len(active), "queued": 1,
            "detail": {"state": "serving", "pid": 1, "seats": seats, "active_requests": active,
                       "recent_tokens_per_s": sum(tokens.values()) / 10, "memory": {"active_bytes": 20_000_000},
                       "time": {"now_unix": now_unix}, "depth": 1, "head_resident": True, "head_bytes": 2_000_000,
                       "stats": {"requests": {"planner": {"length": 3}}},
                       "governor": {"pressure": pressure, "available_bytes": available,
                                    "depth_by_height": [{"heights": "1", "chosen": 1, "depth": 1},
                                                        {"heights": "2", "chosen": None, "depth": 1, "probing": False}],
                                    "recent_decisions": list(decisions)}}}


def test_seats_share_of_the_last_minute_and_sorting():
    v = TopView()
    v.update(reply({"planner": 100, "coder": 100, "critic": 0}), now=0.0)
    v.update(reply({"planner": 400, "coder": 200, "critic": 0}), now=30.0)
    rows = {r.seat: r for r in v.seats()}
    assert rows["planner"].share == pytest.approx(0.75) and rows["coder"].share == pytest.approx(0.25)
    assert rows["planner"].decoding == 1 and rows["critic"].decoding == 0 and rows["critic"].queued == 1
    assert [r.seat for r in v.seats()] == ["coder", "critic", "planner"]  # by name first
    assert v.next_sort() == "active" and [r.seat for r in v.seats()] == ["coder", "planner", "critic"]
    v.next_sort()
    assert v.sort == "tok/s" and v.seats()[0].seat == "planner"
    v.update(reply({"planner": 400, "coder": 900, "critic": 0}), now=85.0)  # the first sample left the minute
    rows = {r.seat: r for r in v.seats()}
    assert rows["coder"].share == pytest.approx(1.0) and rows["planner"].share == 0
    assert "r-planner" in seat_detail(rows["planner"]) and "length 3" in seat_detail(rows["planner"])
    assert "prefill 256/3000" in seat_detail(rows["critic"])


def test_decisions_newest_first_on_the_wall_clock_and_unreachable_keeps_the_last_state():
    ds = [{"age_s": 30.0, "decision": "depth", "sentence": "depth 2 pays", "actions": ["SetDepth(2)"]},
          {"age_s": 5.0, "decision": "evict_head", "sentence": "critical pressure", "actions": ["EvictHead"]}]
    v = TopView()
    v.update(reply({"planner": 10}, decisions=ds, now_unix=2_000.0), now=0.0)
    rows = v.decisions()
    assert [(r.decision, r.at) for r in rows] == [("evict_head", 1_995.0), ("depth", 1_970.0)]
    assert "critical pressure" in decision_detail(rows[0]) and '"EvictHead"' in decision_detail(rows[0])
    v.unreachable("no reply within 2.0 s", now_unix=2_001.0)
    v.unreachable("no reply within 2.0 s", now_unix=2_003.0)
    assert v.unreachable_since == 2_001.0 and v.seats()[0].seat == "planner"  # the last known state stays
    assert list(v.memory)[-2:] == [None, None]  # a gap in the history, not a made-up value
    v.update(reply({"planner": 20}), now=5.0)
    assert v.error is None and v.unreachable_since is None


def test_sparkline_scales_between_min_and_max_and_leaves_gaps():
    assert sparkline([]) == "" and sparkline([None, None]) == ""
    assert sparkline([1, 1, 1]) == "▁▁▁"
    assert sparkline([0, None, 10, 5]) == "▁ █▅"
    assert len(sparkline(range(100), width=30)) == 30


def test_the_plain_frame_shows_every_panel():
    v = TopView()
    ds = [{"age_s": 1.0, "decision": "evict_head", "sentence": "warn sustained 30 s", "actions": ["EvictHead"]}]
    v.update(reply({"planner": 100, "coder": 50}, pressure="warn", available=3 << 30, decisions=ds), now=0.0)
    out = io.StringIO()
    Console(file=out, width=120, color_system=None).print(frame(v))
    text = out.getvalue()
    for needle in ("seats", "planner", "coder", "batch", "height 2", "depth by height: 1: 1  2: 1*", "MTP head",
                   "resident, 2.0 MB", "pressure warn", "3221.2 MB available", "step", "no engine step yet",
                   "governor decisions", "evict_head", "warn sustained 30 s"):
        assert needle in text, (needle, text)
