"""front/metrics.py and `councild status`: how many requests decode at once, from the
status detail's ``rows``."""

from __future__ import annotations

import pytest

from daemon.cli import format_status
from front.metrics import DaemonCollector
from protocol import StatusReply

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)

AUTO = {"limit": 5, "mode": "auto", "ceiling": 8, "active": 5, "waiting": 2, "decision": "rows_keep",
        "why": "probed 5 rows: 130.0 tok/s vs 100.0 tok/s at 4 (margin 6% (noise 2.8%)): another row pays, kept"}


def _families(detail: dict) -> dict:
    c = DaemonCollector()
    c.status = StatusReply(server="councild", model="m", uptime_s=1.0, active=0, queued=0, detail=detail)
    return {f.name: f for f in c.collect()}


def test_the_gauges_say_the_limit_who_sets_it_and_the_ceiling():
    fam = _families({"rows": AUTO})
    (sample,) = fam["councild_max_active"].samples
    assert sample.value == 5.0 and sample.labels == {"mode": "auto", "decision": "rows_keep"}
    assert fam["councild_max_active_ceiling"].samples[0].value == 8.0
    fam = _families({"rows": {"limit": 4, "mode": "pinned", "ceiling": None, "decision": None}})
    assert fam["councild_max_active"].samples[0].labels == {"mode": "pinned", "decision": ""}
    assert "councild_max_active_ceiling" not in fam
    assert "councild_max_active" not in _families({})  # an older daemon: no series rather than a wrong one


def test_status_has_a_rows_at_once_row():
    text = format_status(StatusReply(server="councild", model="m", uptime_s=1.0, active=5, queued=2,
                                     detail={"rows": AUTO}))
    line = next(ln for ln in text.splitlines() if ln.startswith("rows at once"))
    assert line.split("  ", 1)[1].strip() == f"5 of 8 (auto; 5 active, 2 waiting): {AUTO['why']}"
    pinned = {"limit": 4, "mode": "pinned", "active": 1, "waiting": 0, "why": "pinned by scheduler.max_active = 4"}
    text = format_status(StatusReply(server="councild", model="m", uptime_s=1.0, active=1, queued=0,
                                     detail={"rows": pinned}))
    assert "4 (pinned; 1 active, 0 waiting): pinned by scheduler.max_active = 4" in text
