"""A fresh daemon's first council round against its later rounds, two source trees alternated.

    PYTHONPATH=$PWD .venv/bin/python bench/first_round_ab.py --trees A_DIR,B_DIR [--pairs 4]
        [--arms default] [--rounds 2] [--max-active A_VALUE,B_VALUE] [--json OUT.json] [--markdown OUT.md]

Each run is `bench/council_http.py` of that tree (so its daemon runs that tree's code) with a new,
empty cache folder: no stored probe verdicts, no prefix snapshots, no learned profile, as on a
fresh machine. council_http's round 0 is the first workload after start-up; its rounds 1..N are
"later" (each round sends new prompts). Per run and arm: round 0's tok/s over the later rounds'
median, and the TTFT p50 and p95 ratios; then per tree the median and range over its runs. The
trees alternate run by run (A B, B A, ...), so drift on a shared machine falls on both.
``--max-active`` gives each tree's daemon a ``scheduler.max_active`` (council_http's
``--max-active``, one value per tree); the two "trees" may then be one folder, so the arms are
two settings of the same code.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def one_run(tree: Path, max_active: str, args, out: Path) -> dict:
    cmd = [sys.executable, str(tree / "bench/council_http.py"), "--seats", str(args.seats), "--turns", str(args.turns),
           "--system-tokens", str(args.system_tokens), "--max-tokens", str(args.max_tokens), "--rounds",
           str(args.rounds), "--arms", args.arms, "--cache-dir", str(out / "cache"), "--json", str(out / "r.json"),
           "--logs", str(out / "logs")]  # each run's daemon and front logs stay in the work folder
    if max_active:
        cmd += ["--max-active", max_active]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=tree, check=True, stdout=subprocess.DEVNULL, stderr=open(out / "stderr.log", "w"))
    r = json.loads((out / "r.json").read_text())
    # council_http names an arm "ARM max_active=V" when given a value: the bare arm here.
    return {"wall_s": round(time.perf_counter() - t0, 1),
            "arms": {f["arm"].split(" max_active=")[0]: round0_ratios(r, f["arm"]) for f in r["first_round"]}}


def round0_ratios(r: dict, arm: str) -> dict:
    """From council_http's JSON: ``arm``'s round 0 over its later rounds' median (tok/s, TTFT)."""
    first = next(f for f in r["first_round"] if f["arm"] == arm)
    later = r["arms"][arm]
    return {"round0_tok_s": first["tok_s"], "later_tok_s": later["tok_s"]["median"],
            "tok_s_ratio": first["tok_s"] / later["tok_s"]["median"],
            "ttft_p50_ratio": first["ttft_p50"] / later["ttft_p50"]["median"],
            "ttft_p95_ratio": first["ttft_p95"] / later["ttft_p95"]["median"]}


def ratio_cells(vals: list[dict]) -> str:
    """The table cells of several runs' ratios: tok/s, TTFT p50, TTFT p95, runs."""
    return " | ".join([spread([v["tok_s_ratio"] for v in vals]), spread([v["ttft_p50_ratio"] for v in vals]),
                       spread([v["ttft_p95_ratio"] for v in vals]), str(len(vals))])


def finish(args, lines: list[str], payload: dict) -> int:
    """Print the table, write it (--markdown) and the runs (--json)."""
    table = "\n".join(lines)
    print(table)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"argv": sys.argv[1:], **payload}, indent=1))
    if args.markdown:
        args.markdown.write_text(table + "\n")
    return 0


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", required=True, help="two source trees, comma-separated (A first)")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--arms", default="default")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seats", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-active", default="",
                    help='one scheduler.max_active per tree, comma-separated ("auto" or ints); default: each '
                         "council_http's own")
    ap.add_argument("--json", type=Path, default=Path("bench/out/first_round_ab.json"))
    ap.add_argument("--markdown", type=Path)
    args = ap.parse_args(argv)
    trees = [Path(t).resolve() for t in args.trees.split(",")]
    if len(trees) != 2:
        ap.error("--trees takes exactly two folders")
    values = args.max_active.split(",") if args.max_active else ["", ""]
    if len(values) != 2:
        ap.error("--max-active takes one value per tree")
    arms = [(t, v, f"{t} max_active={v}" if v else str(t)) for t, v in zip(trees, values)]
    if arms[0][2] == arms[1][2]:
        ap.error("the two arms are the same tree with the same settings")
    runs: dict[str, list[dict]] = {label: [] for _, _, label in arms}
    work = Path(tempfile.mkdtemp(prefix="first-round-ab-"))
    print(f"runs' logs under {work}", file=sys.stderr, flush=True)
    for i in range(args.pairs):
        for k, (tree, value, label) in enumerate(arms if i % 2 == 0 else arms[::-1]):
            out = work / f"{i}-{k}-{tree.name}"
            out.mkdir()
            res = one_run(tree, value, args, out)
            runs[label].append(res)
            print(f"pair {i} {label}: " + ", ".join(f"{a} round 0 / later {v['tok_s_ratio']:.2f}x, TTFT p95 "
                                                      f"{v['ttft_p95_ratio']:.2f}x" for a, v in res["arms"].items())
                  + f" ({res['wall_s']} s)", file=sys.stderr, flush=True)
    lines = [f"`{' '.join([Path(sys.executable).name, *sys.argv])}`", "",
             "| tree | arm | round 0 / later tok/s | TTFT p50 round 0 / later | TTFT p95 round 0 / later | runs |",
             "|---|---|---|---|---|---|"]
    for tree, rs in runs.items():
        for arm in rs[0]["arms"]:
            lines.append(f"| {tree} | {arm} | {ratio_cells([r['arms'][arm] for r in rs])} |")
    return finish(args, lines, {"runs": runs})


if __name__ == "__main__":
    sys.exit(main())
