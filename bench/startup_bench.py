"""Daemon start to ready: the start-up probes run (an empty cache folder) vs their verdicts
read back (daemon/engine_thread/probe_verdicts.py), interleaved ABAB over rounds.

    .venv/bin/python bench/startup_bench.py --rounds 4 --json bench/results/startup_cpu.json

Each start is `councild serve` on the bundled model (the test suite's daemon), timed from
the process start to the first answered status; the daemon's own `speculation.exactness`,
`batch.ready` and `prefix_cache.ready` (the chunk-split probe) events give the probes' share
(`probe_ms`). Prints a markdown table; the JSON
holds every sample and the load average at each.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "e2e")]

from daemon.paths import BUNDLED_MODEL  # noqa: E402
from e2e_harness import start_daemon  # noqa: E402


def one_start(work: Path, cache: Path) -> dict:
    work.mkdir(parents=True)
    t0 = time.perf_counter()
    d = start_daemon(work, BUNDLED_MODEL, env={"COUNCILD_CACHE_DIR": str(cache)})
    ready = time.perf_counter() - t0
    code = d.stop()
    events = {e["event"]: e for e in d.events()
              if e["event"] in ("speculation.exactness", "batch.ready", "prefix_cache.ready")}
    return {"ready_s": ready, "exit": code, "loadavg": os.getloadavg()[0],
            **{f"{k}_probe_ms": e.get("probe_ms") for k, e in events.items()},
            **{f"{k}_verdict": e.get("verdict") for k, e in events.items()}}


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    arms = {"probed": [], "cached": []}
    with tempfile.TemporaryDirectory(prefix="startup-bench-") as tmp:
        tmp = Path(tmp)
        warm = tmp / "warm-cache"
        one_start(tmp / "warm-up", warm)  # fills the warm cache (and the OS page cache)
        for r in range(args.rounds):
            order = ("probed", "cached") if r % 2 == 0 else ("cached", "probed")
            for arm in order:
                cache = warm if arm == "cached" else tmp / f"cold-{r}"
                print(f"[startup {r + 1}/{args.rounds}] {arm}", file=sys.stderr, flush=True)
                arms[arm].append(one_start(tmp / f"{arm}-{r}", cache))
    ratio = [c["ready_s"] / p["ready_s"] for p, c in zip(arms["probed"], arms["cached"])]
    res = {"rounds": args.rounds, "model": str(BUNDLED_MODEL), "platform": platform.platform(),
           "arms": {a: {"ready_s": spread([s["ready_s"] for s in v]), "samples": v} for a, v in arms.items()},
           "cached_over_probed": spread(ratio), "command": " ".join(["bench/startup_bench.py", *(argv or sys.argv[1:])])}
    lines = ["| arm | start to ready, s: median (min-max) | exactness probe ms (median) | batch probe ms (median) "
             "| chunk-split probe ms (median) |", "|---|---|---|---|---|"]
    for a, v in arms.items():
        r = res["arms"][a]["ready_s"]
        ex = statistics.median(s.get("speculation.exactness_probe_ms") or 0 for s in v)
        ba = statistics.median(s.get("batch.ready_probe_ms") or 0 for s in v)
        sp = statistics.median(s.get("prefix_cache.ready_probe_ms") or 0 for s in v)
        lines.append(f"| {a} | {r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f}) | {ex:.0f} | {ba:.0f} | {sp:.0f} |")
    c = res["cached_over_probed"]
    lines += ["", f"cached / probed, paired per round: {c['median']:.3f} ({c['min']:.3f}-{c['max']:.3f}); "
              f"load average {min(s['loadavg'] for v in arms.values() for s in v):.1f}-"
              f"{max(s['loadavg'] for v in arms.values() for s in v):.1f}"]
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0 if all(s["exit"] == 0 for v in arms.values() for s in v) else 1


if __name__ == "__main__":
    sys.exit(main())
