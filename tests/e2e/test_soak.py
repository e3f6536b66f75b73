"""A 3-minute run of tools/soak.py (the 30-minute run's report is under bench/results/):
ZeroMQ seats and HTTP clients at once, cancels, deadlines, SIGHUP reloads, a memory-pressure
wave, a daemon SIGKILL + restart and a front restart; every invariant checked."""

from __future__ import annotations

import sys

import pytest

from e2e_harness import REPO

sys.path.insert(0, str(REPO / "tools"))
import soak  # noqa: E402


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_soak_three_minutes():
    argv = ["--duration-s", "180", "--zmq-clients", "3", "--http-clients", "3", "--seed", "5", "--waves", "1"]
    args = soak.build_parser().parse_args(argv)
    args.argv = argv
    report = soak.run(args)
    soak.print_report(report)
    s = report["summary"]
    assert s["violations"] == [], s["violations"]
    assert s["lost"] == 0 and s["duplicated"] == 0 and s["mixed"] == 0
    assert s["greedy_checked"] > 0 and s["prefix_cache_hit_requests"] > 0
    whats = [e["what"] for e in report["timeline"]]
    assert {"sighup", "daemon_killed", "daemon_started", "front_stopped", "front_started"} <= set(whats), whats
    killed = [d for d in s["daemon_side"] if d["killed"]]
    assert len(killed) == 1 and s["daemon_side"][-1]["exit_code"] == 0
