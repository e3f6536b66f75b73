"""A second start with the invariant kernels: what the kernel swap's compiled-step check costs it.

    PYTHONPATH=$PWD .venv/bin/python bench/restart_kernel_swap.py --old OLD_TREE [--rounds 3] [--json OUT.json]

Two source trees (``--old``, e.g. a `git worktree` of an earlier commit, and this one)
alternate; each round, each tree starts the daemon twice on the bundled model with
`kernels = "invariant"` and one empty cache folder (a machine's first start, then its second),
waits for it to answer, and stops it. From the daemon's log: ``kernels_s``, engine.first_step
to engine.kernels (the kernel choice: its probes and the swap's compiled-step check), and
``ready_s``, daemon.loading to daemon.start. On a GPU the swap is what `kernels = "auto"`
does where MLX's kernels fail the probes (the H200); here it is forced. Prints a table,
writes JSON.
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
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from protocol.readiness import wait_until_answering  # noqa: E402


def start_once(tree: Path, cache: Path, home: Path) -> dict:
    run = home / "run"
    run.mkdir(parents=True, mode=0o700)
    cfg = home / "councild.toml"
    cfg.write_text('kernels = "invariant"\n')
    endpoint = f"ipc://{run / 'councild.sock'}"
    env = dict(os.environ, COUNCILD_CACHE_DIR=str(cache), COUNCILD_RUNTIME_DIR=str(run), PYTHONPATH=str(tree))
    log = home / "daemon.log"
    proc = subprocess.Popen([sys.executable, "-m", "daemon.cli", "serve", "--endpoint", endpoint, "--config", str(cfg),
                             "--log-format", "json"], cwd=tree, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    wait_until_answering(endpoint, proc, timeout_s=300, log_path=log)
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
    first: dict[str, float] = {}
    for line in log.read_text().splitlines():
        if line.startswith("{"):
            e = json.loads(line)
            first.setdefault(e["event"], datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp())
    return {"kernels_s": first["engine.kernels"] - first["engine.first_step"],
            "ready_s": first["daemon.start"] - first["daemon.loading"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", type=Path, required=True, help="the other source tree")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=Path("bench/out/restart_kernel_swap.json"))
    args = ap.parse_args(argv)
    trees = {"old": args.old.resolve(), "new": REPO}
    runs: dict[str, dict[str, list[dict]]] = {t: {"first": [], "second": []} for t in trees}
    for rnd in range(args.rounds):
        for name in (("old", "new") if rnd % 2 == 0 else ("new", "old")):
            base = Path(tempfile.mkdtemp(prefix="restart-kernel-swap-"))
            for start in ("first", "second"):
                runs[name][start].append(start_once(trees[name], base / "cache", base / start))
            print(f"round {rnd} {name}: " + ", ".join(f"{s} {runs[name][s][-1]['kernels_s']:.2f} s kernels, "
                                                      f"{runs[name][s][-1]['ready_s']:.2f} s to ready"
                                                      for s in ("first", "second")), file=sys.stderr, flush=True)
    lines = [f"`{' '.join([Path(sys.executable).name, *sys.argv])}`", "",
             "| tree | start | kernel choice s, median (range) | daemon.loading to ready s, median (range) |",
             "|---|---|---|---|"]
    for name in trees:
        for start in ("first", "second"):
            cells = []
            for key in ("kernels_s", "ready_s"):
                xs = [r[key] for r in runs[name][start]]
                cells.append(f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})")
            lines.append(f"| {name} | {start} | {' | '.join(cells)} |")
    print("\n".join(lines))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"argv": sys.argv[1:], "trees": {k: str(v) for k, v in trees.items()}, "runs": runs},
                                    indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
