"""bench/daemon_timeline.py's --per-round table, run as an operator runs it, on a log written
here: two rounds of two requests, round 0's whole-chunk prefill slower than round 1's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "daemon_timeline.py"


def _log(tmp_path: Path) -> Path:
    events = []
    for r, (chunk_s, ttfts) in enumerate([(0.050, (0.30, 0.10)), (0.020, (0.12, 0.08))]):
        for seat, ttft in enumerate(ttfts):
            events.append({"event": "request.accepted", "seat": f"s{seat}", "prompt_tokens": 600})
        events += [
            {"event": "engine.slow_iteration", "seconds": chunk_s, "rows": 0, "prefilled": 256},
            {"event": "engine.slow_iteration", "seconds": 0.030, "rows": 0, "prefilled": 88},  # a tail: not a chunk
            {"event": "engine.slow_iteration", "seconds": 0.016 + r / 1000, "rows": 2, "prefilled": 0},
        ]
        for seat, ttft in enumerate(ttfts):
            events.append({"event": "request.done", "seat": f"s{seat}", "ttft_s": ttft, "prompt_tokens": 600,
                           "cached_tokens": 256 * r, "prefill_forwards": 3 - r})
    path = tmp_path / "daemon.log"
    stamp = "2026-12-08T00:00:00Z"
    path.write_text("\n".join(json.dumps(e | {"timestamp": stamp}) for e in events) + "\nnot json\n")
    return path


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_per_round_sets_round_0_beside_the_next_shape_for_shape(tmp_path):
    out = _run(str(_log(tmp_path)), "--per-round", "2")
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| 0 ") or line.startswith("| 1 ")]
    assert rows == ["| 0 | 2 | 200 / 300 / 300 | 1200 | 6 | 1, 50 | 1, 16 |",
                    "| 1 | 2 | 100 / 120 / 120 | 688 | 4 | 1, 20 | 1, 17 |"]
    assert "slow 256-token prefills" in out.stdout


def test_a_round_of_no_requests_is_refused(tmp_path):
    out = _run(str(_log(tmp_path)), "--per-round", "0")
    assert out.returncode == 2 and "positive number of requests" in out.stderr
