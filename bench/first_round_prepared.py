"""A machine's first council round with and without `councild prepare` run first.

    PYTHONPATH=$PWD .venv/bin/python bench/first_round_prepared.py [--runs 3] [--json OUT.json] [--markdown OUT.md]

Two arms, alternated run by run, each from an empty cache folder (a fresh machine):
- ``fresh``: the daemon starts at once; its start-up probes run in the background during round 0;
- ``prepared``: `councild prepare --model MODEL` runs first into the same empty folder (its
  time is reported apart: what an installer pays), then the daemon starts.
Each run is bench/council_http.py (4 seats, 3 turns, 1,000 system tokens, 32 tokens a turn,
exact mode, 2 later rounds; first_round_verdicts.py's council), round 0 over the later rounds'
median; the prepared arm's ``prepare_s`` is the command's wall time.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from first_round_ab import finish, ratio_cells, spread  # noqa: E402
from first_round_verdicts import council  # noqa: E402

from daemon.paths import BUNDLED_MODEL  # noqa: E402


def prepare(cache: Path, model: str) -> float:
    """`councild prepare` into ``cache`` (council_http.py's daemon folder under it); seconds."""
    env = dict(os.environ, COUNCILD_CACHE_DIR=str(cache / "councild"))
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "daemon.cli", "prepare", "--model", model, "--log-format", "json"],
                   cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", type=Path, default=Path("bench/out/first_round_prepared.json"))
    ap.add_argument("--markdown", type=Path)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="first-round-prepared-"))
    results: dict[str, list[dict]] = {"fresh": [], "prepared": []}
    prepare_s: list[float] = []
    for i in range(args.runs):
        for arm in (("fresh", "prepared") if i % 2 == 0 else ("prepared", "fresh")):
            cache = work / f"{i}-{arm}"
            if arm == "prepared":
                prepare_s.append(prepare(cache, str(BUNDLED_MODEL)))
            results[arm].append(council(cache, work / f"{i}-{arm}.json"))
            print(f"run {i} {arm}: round 0 / later {results[arm][-1]['tok_s_ratio']:.2f}x", file=sys.stderr, flush=True)
    lines = [f"`{' '.join([Path(sys.executable).name, *sys.argv])}`", "",
             "| arm (empty cache folder) | round 0 / later tok/s | TTFT p50 | TTFT p95 | runs |", "|---|---|---|---|---|"]
    for arm, rs in results.items():
        lines.append(f"| {arm} | {ratio_cells(rs)} |")
    lines += ["", f"`councild prepare` took {spread(prepare_s)} s (median, range)."]
    return finish(args, lines, {"results": results, "prepare_s": prepare_s})


if __name__ == "__main__":
    sys.exit(main())
