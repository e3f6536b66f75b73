"""A shortened run of tools/loadtest.py: client processes, a real daemon, mixed seats,
priorities, lengths and random cancels; every invariant checked from the clients' side.
The full run (8 clients x 1000 requests) is the slow-marked test below and the command in
bench/results/loadtest_*.json."""

from __future__ import annotations

import sys

import pytest

from e2e_harness import REPO

sys.path.insert(0, str(REPO / "tools"))
import loadtest  # noqa: E402


def _run(argv: list[str]) -> dict:
    args = loadtest.build_parser().parse_args(argv)
    args.argv = argv
    report = loadtest.run(args)
    loadtest.print_report(report["summary"], report["rss"], args, report["wall_s"])
    return report


def _check(report: dict, requests: int) -> None:
    s = report["summary"]
    assert s["violations"] == [], s["violations"]
    assert s["requests"] == requests
    assert s["terminal_lost"] == 0 and s["terminal_duplicated"] == 0 and s["after_terminal"] == 0
    assert s["seq_violations"] == 0
    assert s["daemon_alive"] and report["daemon_exit"] == 0
    assert s["cancels_acted"] > 0 and s["cancel_latency_ms"]["median"] is not None
    rss = report["rss"]
    assert rss["before_mib"] > 0 and rss["peak_mib"] >= rss["before_mib"]


def test_load_short(e2e_model):
    report = _run(["--clients", "4", "--requests", "100", "--seed", "7", "--model", str(e2e_model),
                   "--cancel-rate", "0.3", "--timeout", "120"])
    _check(report, 100)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_load_full(e2e_model):
    report = _run(["--clients", "8", "--requests", "1000", "--seed", "1", "--model", str(e2e_model)])
    _check(report, 1000)


def test_load_with_a_flooding_client_and_a_full_log_disk(e2e_model):
    """The short run again, with one more client flooding 3,000 Generates without reading,
    and the daemon's log on a 32 KiB disk that fills early (tools/loadtest.py --flood,
    --log-disk-bytes): every invariant holds, the flood's included."""
    report = _run(["--clients", "4", "--requests", "40", "--seed", "3", "--model", str(e2e_model),
                   "--cancel-rate", "0.3", "--timeout", "120", "--flood", "3000", "--log-disk-bytes", "32768"])
    _check(report, 40)
    s = report["summary"]
    assert s["flood"]["requests"] == 3000 and s["flood"]["slow_consumer"] > 0, s["flood"]
    assert s["log_disk"]["lines_dropped"] > 0, s["log_disk"]
