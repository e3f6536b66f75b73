"""Start-up cost of building the batch at max_active_ceiling (max_active = "auto", the
default: ceiling 8) against the old fixed max_active = 4: the batch probe, the prompts-
together and mixed-step cost probes and the warm-up all run at the batch's height.

    .venv/bin/python bench/probes/row_ceiling_startup.py --rounds 2 --json bench/results/row_ceiling_startup_cpu.json

Each start is `councild serve` on the bundled model, timed from the process start to the
first answered status, with an empty cache folder ("cold": every probe runs) or one a
start of the same config filled ("cached": verdicts read back). Arms interleaved ABAB per
round. Prints a markdown table; the JSON holds every sample.
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

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "e2e")]

from daemon.paths import BUNDLED_MODEL  # noqa: E402
from e2e_harness import start_daemon, wait_ready  # noqa: E402

CONFIGS = {"auto-ceiling-8": "[scheduler]\nmax_active = \"auto\"\nmax_active_ceiling = 8\n",
           "pinned-4": "[scheduler]\nmax_active = 4\n"}
EVENTS = ("speculation.exactness", "batch.ready", "prefill_together.ready", "mixed_steps.ready", "warmup.done")


def one_start(work: Path, cache: Path, config: str) -> dict:
    work.mkdir(parents=True)
    t0 = time.perf_counter()
    d = start_daemon(work, BUNDLED_MODEL, config=config, env={"COUNCILD_CACHE_DIR": str(cache)}, wait=False)
    wait_ready(d, timeout_s=600)  # a shared, loaded box: the harness's 90 s is not enough there
    ready = time.perf_counter() - t0
    code = d.stop()
    ev = {e["event"]: e for e in d.events() if e["event"] in EVENTS}
    return {"ready_s": ready, "exit": code, "loadavg": os.getloadavg()[0],
            "batch_rows": ev.get("batch.ready", {}).get("rows"),
            **{f"{k}_ms": (e.get("probe_ms") if k != "warmup.done" else round(1000 * e.get("seconds", 0), 1))
               for k, e in ev.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    arms = {f"{c} {w}": [] for c in CONFIGS for w in ("cold", "cached")}
    with tempfile.TemporaryDirectory(prefix="row-ceiling-startup-") as tmp:
        tmp = Path(tmp)
        warm = {c: tmp / f"warm-{c}" for c in CONFIGS}
        for c in CONFIGS:  # fill each config's cache (and the OS page cache)
            one_start(tmp / f"fill-{c}", warm[c], CONFIGS[c])
        for r in range(args.rounds):
            names = list(arms) if r % 2 == 0 else list(reversed(arms))
            for arm in names:
                c, w = arm.split(" ")
                cache = warm[c] if w == "cached" else tmp / f"cold-{c}-{r}"
                print(f"[start {r + 1}/{args.rounds}] {arm}", file=sys.stderr, flush=True)
                arms[arm].append(one_start(tmp / f"{c}-{w}-{r}", cache, CONFIGS[c]))
    res = {"rounds": args.rounds, "model": str(BUNDLED_MODEL), "platform": platform.platform(),
           "command": " ".join(["bench/probes/row_ceiling_startup.py", *(argv or sys.argv[1:])]), "arms": arms}
    cols = [f"{k}_ms" for k in EVENTS[1:]]
    lines = ["| arm | batch rows | start to ready, s: median (min-max) | " + " | ".join(f"{k} ms (median)" for k in EVENTS[1:])
             + " |", "|---|---|---|" + "---|" * len(cols)]
    for a, v in arms.items():
        xs = [s["ready_s"] for s in v]
        med = [statistics.median((s.get(c) or 0) for s in v) for c in cols]
        lines.append(f"| {a} | {v[0]['batch_rows']} | {statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f}) | "
                     + " | ".join(f"{m:.0f}" for m in med) + " |")
    for w in ("cold", "cached"):
        pairs = [x["ready_s"] / y["ready_s"] for x, y in zip(arms[f"auto-ceiling-8 {w}"], arms[f"pinned-4 {w}"])]
        lines.append(f"\n{w}: auto (ceiling 8) / pinned 4, paired per round: median {statistics.median(pairs):.3f} "
                     f"({min(pairs):.3f}-{max(pairs):.3f})")
    loads = [s["loadavg"] for v in arms.values() for s in v]
    lines.append(f"load average {min(loads):.1f}-{max(loads):.1f}")
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0 if all(s["exit"] == 0 for v in arms.values() for s in v) else 1


if __name__ == "__main__":
    sys.exit(main())
