"""Read the device times of bench/qmm_graph.py's ``--mode probe`` run from an ncu CSV.

    python3 bench/qmm_probe_read.py probe_ncu.csv [--shapes gate/up,down,lm_head] [--ms 1,2,4,8,16,32]
        [--launches S:U:NA,...] [--json out.json]

The probe launches a marker kernel before each group (one shape, M and arm, in the order
qmm_graph.py runs them: shapes in its table order, M ascending, then "mlx", "kernel" and the
``--launches``); ncu (``--csv --metrics gpu__time_duration.sum``) lists every launch in order.
A group's first ``--reps`` launches of its arm's kernel are its calls (the group also holds
the next group's untimed first call and its inputs' generation): MLX's quantized kernels
(qmv / qmm names) for "mlx", the councild kernel for the others. Prints per shape and M the
median device microseconds per arm beside the weight-read bound."""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qmm_graph import GS, MS, SHAPES, bytes_read, launch_name, launch_of  # noqa: E402


def groups_of(path: Path) -> list[list[tuple[str, float]]]:
    groups: list[list[tuple[str, float]]] = []
    for row in csv.reader(path.open()):
        if len(row) < 15 or not row[0].isdigit():
            continue
        name, us = row[4], float(row[14].replace(",", "")) / 1000
        if "councild_probe_marker" in name or "marker" in name:
            groups.append([])
        elif groups:
            groups[-1].append((name, us))
    return groups


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", type=Path)
    ap.add_argument("--shapes", default="")
    ap.add_argument("--ms", default="")
    ap.add_argument("--launches", default="")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--bandwidth", type=float, default=3.4e12)
    ap.add_argument("--old", action="store_true", help="the probe ran with --old-source (arm \"old\")")
    ap.add_argument("--tiled", action="store_true", help="the probe ran with --tiled (arms \"tiled\", \"old tiled\")")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    arms = ["mlx", "kernel"] + ["old"] * args.old + (["tiled"] + ["old tiled"] * args.old) * args.tiled + [launch_name(*launch_of(launch)) for launch in filter(None, args.launches.split(","))]
    ms = [int(m) for m in args.ms.split(",")] if args.ms else list(MS)
    plan = [(name, N, K, M, arm) for name, (N, K) in SHAPES.items()
            if not args.shapes or any(s in name for s in args.shapes.split(","))
            for M in ms for arm in arms]
    groups = groups_of(args.csv)
    rows = []
    for (name, N, K, M, arm), group in zip(plan, groups):
        mine = [us for n, us in group if ("councild" in n) == (arm != "mlx")
                and (arm != "mlx" or "qmv" in n or "qmm" in n)][: args.reps]
        rows.append({"shape": name, "N": N, "K": K, "M": M, "arm": arm, "us": statistics.median(mine) if mine else None,
                     "calls": mine, "bound_us": bytes_read(N, K, M, args.bits) / args.bandwidth * 1e6})
    print(f"{len(groups)} groups in the trace, {len(plan)} planned\n")
    print("| shape | M | bound us | " + " | ".join(arms) + " |\n|---|---|---|" + "---|" * len(arms))
    for name, N, K, M, _ in plan[:: len(arms)]:
        by = {r["arm"]: r for r in rows if r["shape"] == name and r["M"] == M}
        cells = [f"{by[a]['us']:.1f} ({by[a]['bound_us'] / by[a]['us']:.0%})" if by.get(a) and by[a]["us"] else "-"
                 for a in arms]
        print(f"| {name} | {M} | {next(iter(by.values()))['bound_us']:.1f} | " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"group_size": GS, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
