"""How long the background probes' pieces are (engine/pieces.py): what a request arriving
mid-probe waits for at most. Runs the prompts-together check, its cost probe and the mixed
steps' check on the bundled model under PiecewiseRun, as the daemon's warming parts run them
(rows 8: the batch's ceiling; the cost probe at the start height 4; the mixed check with a
256-token chunk), and prints each one's pieces, busy time and longest piece, twice.
``--daemon``: instead, a real ``councild serve`` on a new cache folder, left idle until
``engine.warmed``, and every part's ``engine.warm`` event (pieces, busy, longest piece, verdict).

    PYTHONPATH=$PWD .venv/bin/python bench/probes/warm_piece_lengths.py [--daemon]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from daemon.engine.model.loading import load_model  # noqa: E402
from daemon.engine.pieces import PiecewiseRun  # noqa: E402
from daemon.engine.prefill import batched_prefill as bp  # noqa: E402
from daemon.engine.prefill import mixed_forward as mf  # noqa: E402
from daemon.paths import BUNDLED_MODEL  # noqa: E402


def run(name: str, fn) -> None:
    r, lens = PiecewiseRun(fn), []
    while True:
        t = time.perf_counter()
        done = r.step()
        lens.append((time.perf_counter() - t) * 1e3)
        if done:
            break
    lens.sort()
    print(f"{name}: result {r.result} error {r.error} pieces {len(lens)} busy {sum(lens):.0f} ms "
          f"longest {lens[-1]:.0f} ms, median {statistics.median(lens):.0f} ms", flush=True)


def daemon_parts(timeout_s: float = 120.0) -> None:
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, COUNCILD_CACHE_DIR=f"{d}/cache")
        log = Path(d) / "daemon.log"
        with log.open("w") as err:
            p = subprocess.Popen([sys.executable, "-m", "daemon.cli", "serve", "--endpoint", f"ipc://{d}/s",
                                  "--log-format", "json"], stderr=err, env=env, cwd=REPO)
            end = time.monotonic() + timeout_s
            while time.monotonic() < end and "engine.warmed" not in log.read_text():
                time.sleep(0.5)
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=60)
        for line in log.read_text().splitlines():
            e = json.loads(line) if line.startswith("{") else {}
            if e.get("event") == "engine.warm":
                print(f"{e['part']}: pieces {e.get('pieces')} busy {e.get('busy_ms')} ms longest "
                      f"{e.get('longest_piece_ms')} ms, switched in {e.get('switched_in')}: {e.get('reason')}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--daemon", action="store_true", help="a fresh daemon's engine.warm events instead")
    if ap.parse_args().daemon:
        daemon_parts()
        return
    lm = load_model(BUNDLED_MODEL)
    for _ in range(2):
        lm.__dict__.pop("_prefill_together_matches_solo", None)  # the check caches its verdict
        run("together_matches_solo(8)", lambda: bp.together_matches_solo(lm, 8))
        run("together_cost_ratio(4)", lambda: bp.together_cost_ratio(lm, 4))
        run("mixed_matches_alone(8, (1, 6, 256))", lambda: mf.mixed_matches_alone(lm, 8, (1, 6, 256)))


if __name__ == "__main__":
    main()
