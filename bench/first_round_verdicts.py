"""Which start-up probe a fresh daemon's first council round pays for: each run starts with a
cache folder that holds an earlier start's probe verdicts minus the named ones (those probes
then run in the background during round 0, and their safe paths apply until they answer).

    PYTHONPATH=$PWD .venv/bin/python bench/first_round_verdicts.py [--runs 2]
        [--drop none,all,splits,verify+batch+ragged_verify,mixed_steps_cost+prefill_together_cost]
        [--json OUT.json] [--markdown OUT.md]

A first run with an empty cache folder writes the verdicts (it is also the "all" condition's
first sample). Each condition: `bench/council_http.py` (4 seats, 3 turns, 1,000 system tokens,
32 tokens a turn, exact mode, 2 later rounds), round 0 over the later rounds' median. Conditions
rotate run by run. No prefix snapshots and no learned profile are carried over: only verdicts.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from first_round_ab import finish, ratio_cells, round0_ratios  # noqa: E402

COUNCIL = ["--seats", "4", "--turns", "3", "--system-tokens", "1000", "--max-tokens", "32", "--rounds", "2",
           "--arms", "default"]


def council(cache: Path, out: Path) -> dict:
    subprocess.run([sys.executable, str(REPO / "bench/council_http.py"), *COUNCIL, "--cache-dir", str(cache),
                    "--json", str(out)], cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return round0_ratios(json.loads(out.read_text()), "default")


def seeded(source: Path, dest: Path, drop: list[str]) -> None:
    """dest's cache folder with source's probe verdicts, less the probes in ``drop``."""
    shutil.copytree(source / "councild" / "probe-verdicts", dest / "councild" / "probe-verdicts")
    for f in (dest / "councild" / "probe-verdicts").glob("*.json"):
        data = json.loads(f.read_text())
        for name in drop:
            data["verdicts"].pop(name, None)
        f.write_text(json.dumps(data))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--drop", default="none,all,splits,verify+batch+ragged_verify,mixed_steps_cost+prefill_together_cost")
    ap.add_argument("--json", type=Path, default=Path("bench/out/first_round_verdicts.json"))
    ap.add_argument("--markdown", type=Path)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="first-round-verdicts-"))
    conditions = args.drop.split(",")
    results: dict[str, list[dict]] = {c: [] for c in conditions}
    source = work / "source"
    first = council(source, work / "source.json")  # an empty folder: every probe runs; its verdicts are kept
    if "all" in results:
        results["all"].append(first)
    for i in range(args.runs):
        for c in conditions:
            if c == "all" and len(results["all"]) > i:
                continue
            cache = work / f"{i}-{c}"
            if c != "all":
                seeded(source, cache, [] if c == "none" else c.split("+"))
            results[c].append(council(cache, work / f"{i}-{c}.json"))
            print(f"run {i} {c}: round 0 / later {results[c][-1]['tok_s_ratio']:.2f}x", file=sys.stderr, flush=True)
    lines = [f"`{' '.join([Path(sys.executable).name, *sys.argv])}`", "",
             "| verdicts not cached (probed during round 0) | round 0 / later tok/s | TTFT p50 | TTFT p95 | runs |",
             "|---|---|---|---|---|"]
    for c, rs in results.items():
        lines.append(f"| {c} | {ratio_cells(rs)} |")
    return finish(args, lines, {"results": results})


if __name__ == "__main__":
    sys.exit(main())
