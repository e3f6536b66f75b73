"""Make the samples docs/ shows of `councild top` and `councild governor timeline`.

Starts the daemon on the bundled model (its own runtime and cache folders under --work),
runs a council of four seats for --seconds, each sending completions of 24-96 tokens with
pauses between them, and as an operator forces the head out at 35% of the run, hands control
back at 45%, pins depth 2 at 75% and releases it at 85%. The governor's reload windows are
shortened (restore_window_s 10, min_reload_gap_s 30) so a short run shows a reload. It writes:

- docs/top-frame.txt: `councild top --once` a little after the eviction;
- docs/governor-timeline.html: `councild governor timeline` of the daemon's log.

    PYTHONPATH=$PWD .venv/bin/python tools/ops_views_sample.py --seconds 150
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "e2e"))

from e2e_harness import start_daemon  # noqa: E402

from daemon.paths import BUNDLED_MODEL  # noqa: E402
from protocol.client import Client  # noqa: E402

SEATS = {"planner": "def fibonacci(n):\n", "coder": "class Stack:\n    def __init__(self):\n",
         "critic": "import os\n\n\ndef walk(path):\n", "scout": "def parse_args(argv):\n"}
CONFIG = """\
stats_interval_s = 10
[governor]
restore_window_s = 10.0
min_reload_gap_s = 30.0
"""


def member(endpoint: str, seat: str, prompt: str, stop: threading.Event, seed: int) -> None:
    rng = random.Random(seed)
    with Client(endpoint, seat=seat, timeout_s=120) as c:
        while not stop.is_set():
            c.complete(prompt, max_tokens=rng.randint(24, 96))
            stop.wait(rng.uniform(0.0, 2.0))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=150.0)
    ap.add_argument("--work", help="folder for the daemon's files (default: a temporary one)")
    ap.add_argument("--out", default=str(REPO / "docs"))
    args = ap.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="councild-ops-sample-"))
    work.mkdir(parents=True, exist_ok=True)
    d = start_daemon(work, BUNDLED_MODEL, config=CONFIG)
    stop = threading.Event()
    threads = [threading.Thread(target=member, args=(d.endpoint, s, p, stop, i)) for i, (s, p) in enumerate(SEATS.items())]
    start = time.monotonic()
    for t in threads:
        t.start()
    plan = [(0.35, "evict_head", None), (0.45, "auto", None), (0.75, "pin_depth", 2), (0.85, "auto", None)]
    frame_at = 0.40
    out = Path(args.out)
    with Client(d.endpoint, seat="operator", timeout_s=30) as op:
        while plan or frame_at is not None:
            elapsed = (time.monotonic() - start) / args.seconds
            if plan and elapsed >= plan[0][0]:
                _, action, depth = plan.pop(0)
                print(f"{time.monotonic() - start:6.1f} s  {action}: {op.governor(action, depth).message}", flush=True)
            if frame_at is not None and elapsed >= frame_at:
                frame = subprocess.run([sys.executable, "-m", "daemon.cli", "top", "--once", "--endpoint", d.endpoint],
                                       cwd=REPO, capture_output=True, text=True, env=dict(os.environ, COLUMNS="110"),
                                       check=True)
                (out / "top-frame.txt").write_text(frame.stdout)
                frame_at = None
            time.sleep(0.2)
    time.sleep(max(0.0, args.seconds - (time.monotonic() - start)))
    stop.set()
    for t in threads:
        t.join()
    code = d.stop()
    print(f"daemon exit {code}; log {d.log_path}", flush=True)
    return subprocess.run([sys.executable, "-m", "daemon.cli", "governor", "timeline", str(d.log_path),
                           "-o", str(out / "governor-timeline.html"), "--title", "a council of four on the bundled model"],
                          cwd=REPO).returncode


if __name__ == "__main__":
    sys.exit(main())
