"""Pick the tensor-core matmul's split (warps per block along K) per layer shape from a device sweep.

    python3 bench/qmm_split_pick.py $OUT/sweep_device_us.json --json $OUT/splits.json

The split is part of each output's summation order, so it is chosen per (N, K, bits), never per
M: one value must serve every row count the step runs (one row serial, four rows batched, up to
16 rows verifying drafts). Input: bench/qmm_probe_read.py's JSON (ncu device time per shape, M
and arm); the arms that count are the table's launch ("kernel", at ``default_split``) and the
sweep's "S<s> U0 NA0" ones at the table's P (the P written in the arm's name must be the one the
table gives, or the arm is another feed, not another split). Per shape, each split's score is
its mean over M of (its time / the best split's time at that M): a split 10% slower at one row
and 10% faster at 16 rows scores even. Prints a table and writes
``{"bits": B, "splits": [[N, K, S], ...], "default": {...}, "scores": {...}}``, which
bench/step_split.py's "tbl" token installs (``COUNCILD_QMM_SPLITS``).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from daemon.engine.kernels import quant_mma  # noqa: E402

_ARM = re.compile(r"^S(\d+) U0 NA0(?: P(\d+))?$")


def split_of(arm: str, N: int, K: int, bits: int, stages: int) -> int | None:
    """The split an arm ran at, or None when the arm is not the table's launch at some split."""
    if arm == "kernel":
        return quant_mma.default_split(N, K, bits)
    m = _ARM.match(arm)
    if not m or int(m.group(1)) == 0:
        return None
    return int(m.group(1)) if m.group(2) is None or int(m.group(2)) == stages else None


def pick(rows: list[dict], bits: int, stages: int) -> dict:
    """Per (N, K): {"times": {S: {M: us}}, "scores": {S: score}, "best": S, "default": S}."""
    times: dict = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        S = split_of(r["arm"], r["N"], r["K"], bits, stages)
        if S is None or r.get("us") is None:
            continue
        times[(r["N"], r["K"])][S].setdefault(r["M"], r["us"])
    out = {}
    for (N, K), by_split in times.items():
        ms = sorted(set.intersection(*(set(v) for v in by_split.values())))
        if not ms:
            continue
        best_at = {M: min(v[M] for v in by_split.values()) for M in ms}
        scores = {S: statistics.mean(v[M] / best_at[M] for M in ms) for S, v in by_split.items()}
        out[(N, K)] = {"times": {S: {M: v[M] for M in ms} for S, v in by_split.items()}, "scores": scores,
                       "best": min(scores, key=lambda S: (scores[S], S)),
                       "default": quant_mma.default_split(N, K, bits)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep", type=Path, help="bench/qmm_probe_read.py's --json")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--stages", type=int, default=quant_mma.STAGES_BY_TILES.get(1, 0),
                    help="the P the table gives (arms at another P are not counted)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    rows = json.loads(args.sweep.read_text())["rows"]
    got = pick(rows, args.bits, args.stages)
    if not got:
        print(f"{args.sweep}: no shape has the table's launch and a split arm at every M", file=sys.stderr)
        return 1
    print("| N x K | default S | best S | best's time per M (us) vs default's | scores by S |\n|---|---|---|---|---|")
    for (N, K), v in got.items():
        b, d = v["times"][v["best"]], v["times"][v["default"]]
        per_m = ", ".join(f"M{M} {b[M]:.1f} vs {d[M]:.1f}" for M in b)
        scores = " ".join(f"S{S} {sc:.3f}" for S, sc in sorted(v["scores"].items()))
        print(f"| {N} x {K} | {v['default']} | {v['best']} | {per_m} | {scores} |")
    if args.json:
        args.json.write_text(json.dumps({
            "bits": args.bits, "stages": args.stages,
            "splits": [[N, K, v["best"]] for (N, K), v in got.items()],
            "default": {f"{N}x{K}": v["default"] for (N, K), v in got.items()},
            "scores": {f"{N}x{K}": {str(S): sc for S, sc in v["scores"].items()} for (N, K), v in got.items()},
            "times_us": {f"{N}x{K}": {str(S): t for S, t in v["times"].items()} for (N, K), v in got.items()}},
            indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
