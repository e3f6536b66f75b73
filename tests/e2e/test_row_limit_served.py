"""How many requests decode at once, on a real daemon over ZeroMQ (the bundled model): with
scheduler.max_active = "auto" and a ceiling of 5, a council of 7 concurrent requests makes
the governor decide the limit (one more row into the never-measured heights 5-8: a probe),
logged as a governor.decision with its inputs and a sentence, and `status` says the limit,
who sets it and why; every request ends with its tokens."""

from __future__ import annotations

import threading
import time

import pytest
from e2e_harness import start_daemon

from daemon.paths import BUNDLED_MODEL
from protocol.client import Client



CONFIG = """
[speculation]
mode = "off"
[scheduler]
max_active = "auto"
max_active_ceiling = 5
"""


@pytest.fixture(scope="module")
def rows_daemon(tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("rows"), BUNDLED_MODEL, config=CONFIG)
    yield d
    assert d.stop() == 0


def _council(endpoint: str, n: int, tokens: list[int]) -> None:
    with Client(endpoint, seat="council", timeout_s=120) as c:
        streams = [c.generate(f"def f{i}(x):", max_tokens=64, temperature=0.0) for i in range(n)]
        tokens.extend(s.result().usage.completion_tokens for s in streams)


def test_a_council_above_the_start_height_gets_a_row_limit_decision_and_status_says_it(rows_daemon):
    with Client(rows_daemon.endpoint, seat="obs", timeout_s=60) as c:
        rows = c.status().detail["rows"]
        assert rows["mode"] == "auto" and rows["ceiling"] == 5 and rows["limit"] == 4 and rows["why"]
        seen_limits, seen_rows = set(), None
        for _ in range(4):  # rounds: a round may end before a governor tick sees its queue
            tokens: list[int] = []
            council = threading.Thread(target=_council, args=(rows_daemon.endpoint, 7, tokens))
            council.start()
            while council.is_alive():
                rows = c.status().detail["rows"]
                seen_limits.add(rows["limit"])
                assert rows["limit"] <= 5 and rows["active"] <= 5
                if rows["decision"]:
                    seen_rows = rows
                time.sleep(0.05)
            council.join()
            assert len(tokens) == 7 and all(n > 0 for n in tokens)  # every request ended with its tokens
            if 5 in seen_limits:
                break
    decisions = [e for e in rows_daemon.events() if e.get("event") == "governor.decision"
                 and str(e.get("decision", "")).startswith("rows_")]
    assert decisions, "no row-limit decision was logged"
    # (A hold may come first: four rows' heights not measured yet when the queue was seen.)
    assert {d["decision"] for d in decisions[:1]} <= {"rows_probe", "rows_hold"}
    first = next(d for d in decisions if d["decision"] == "rows_probe")
    assert first["rows_from"] == 4 and first["rows_to"] == 5
    assert first["ceiling"] == 5 and first["rows_waiting"] > 0 and first["sentence"].startswith("rows at once:")
    assert first["row_cache_bytes"] > 0 and [h["heights"] for h in first["by_height"]] == ["1", "2", "3-4", "5-8", "9+"]
    assert all(d["rows_to"] <= 5 for d in decisions)
    # Status said the governor's decision and why while it held.
    assert seen_rows is not None and seen_rows["decision"].startswith("rows_") and seen_rows["why"]
    assert 5 in seen_limits
