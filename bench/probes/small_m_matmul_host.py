"""What a dense bf16 matmul of M = 1, 2, 4, 8 rows costs the host to encode, and the GPU.

Why: on an H100 the bundled model's compiled step encoded in 2.31 ms at one row and 4.60 ms at
two to eight (bench/results/h100_2026-12-07e, step_split round 0), while the step's op graph is
the same size at one row and four (bench/step_ops.py). MLX sends M = 1 to its gemv kernel and
M >= 2 to cuBLASLt (a descriptor, layouts and a heuristic lookup per call): if that is the
difference, a batched step of a bf16 model pays it once per projection, which is why four rows
cost about twice one. Measured apart here, at the bundled model's projection shapes:

  matmul   x [M, K] @ W.T, one call per projection (what the model does);
  gemvs    the M rows each their own gemv, concatenated (M + 1 kernels, no cuBLASLt);
  custom   engine/kernels/invariant_kernels.py's fixed-order matmul (one custom-kernel launch
           at every M: what a small-M dense kernel of our own costs the host);
  gemv_rows engine/kernels/invariant_kernels.py's ``gemv_rows`` (each row as MLX's gemv computes it alone).

First (CUDA), the bit check the daemon runs at start-up (``verify_gemv_rows``: each row of the
kernel against MLX's matmul of that row alone) at the bundled model's shapes, 27B-shaped ones,
K that make MLX's gemv take 2 or 1 elements a lane, in bf16, fp16 and fp32.

For each M: CHAIN independent projections (the shapes in turn) built and handed to
``mx.async_eval`` (host: until it returns, the encode), then ``mx.synchronize`` (total); the
first round apart (cuBLASLt's first lookup of a size), the median of the later ones. Per
projection, us.

    PYTHONPATH=$PWD python3 bench/probes/small_m_matmul_host.py --json $OUT/small_m.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from daemon.engine.kernels.invariant_kernels import backend, gemv_rows, invariant_matmul, verify_gemv_rows  # noqa: E402
from daemon.paths import BUNDLED_MODEL  # noqa: E402


def shapes() -> list[tuple[int, int]]:
    """(N, K) of the bundled model's projections: merged MLP gate+up, down, the head."""
    cfg = json.loads((Path(BUNDLED_MODEL) / "config.json").read_text())
    c = cfg.get("text_config", cfg)
    h, i = c["hidden_size"], c["intermediate_size"]
    return [(2 * i, h), (h, i), (4 * h, h), (h, 2 * h)]


def run(arm: str, m: int, weights: list[mx.array], chain: int) -> tuple[float, float]:
    xs = [mx.random.normal((m, w.shape[1])).astype(mx.bfloat16) for w in weights]
    mx.eval(xs)
    mx.synchronize()
    t0 = time.perf_counter()
    outs = []
    for j in range(chain):
        w, x = weights[j % len(weights)], xs[j % len(weights)]
        if arm == "matmul":
            outs.append(x @ w.T)
        elif arm == "custom":
            outs.append(invariant_matmul(x, w))
        elif arm == "gemv_rows":
            outs.append(gemv_rows(x, w))
        else:
            outs.append(mx.concatenate([x[r : r + 1] @ w.T for r in range(m)], axis=0))
    mx.async_eval(outs)
    host = time.perf_counter() - t0
    mx.synchronize()
    total = time.perf_counter() - t0
    return host * 1e6 / chain, total * 1e6 / chain


CHECK_SHAPES = [(17408, 5120), (5120, 17408), (64, 192), (64, 100)]


def bit_check() -> dict:
    """verify_gemv_rows at the bundled shapes and CHECK_SHAPES, three dtypes: shape -> None or why."""
    out = {}
    for dtype in (mx.bfloat16, mx.float16, mx.float32):
        ws = [(mx.random.normal((n, k)) * 0.02).astype(dtype) for n, k in shapes() + CHECK_SHAPES]
        t = time.perf_counter()
        got = verify_gemv_rows(ws)
        print(f"bit check {dtype}: {time.perf_counter() - t:.2f} s", flush=True)
        for k, why in got.items():
            out[f"{k[0]}x{k[1]} {k[2]}"] = why
            print(f"  {k[0]}x{k[1]} {k[2]}: {'same bits as MLX gemv' if why is None else why}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--chain", type=int, default=120)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    check = bit_check() if backend() == "cuda" else {}
    weights = [(mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16) for n, k in shapes()]
    mx.eval(weights)
    results = []
    print("| arm | M | host us / projection, first round | host us (later, median) | total us (later, median) |")
    print("|---|---|---|---|---|")
    for m in [int(r) for r in args.rows.split(",")]:
        for arm in ("matmul", "custom", "gemv_rows", "gemvs"):
            if (arm == "gemvs" and m == 1) or (arm == "gemv_rows" and backend() != "cuda"):
                continue
            rounds = [run(arm, m, weights, args.chain) for _ in range(args.rounds)]
            later = rounds[1:]
            row = {"arm": arm, "m": m, "first_host_us": rounds[0][0], "first_total_us": rounds[0][1],
                   "host_us": statistics.median(r[0] for r in later), "total_us": statistics.median(r[1] for r in later),
                   "host_range_us": [min(r[0] for r in later), max(r[0] for r in later)]}
            results.append(row)
            print(f"| {arm} | {m} | {row['first_host_us']:.1f} | {row['host_us']:.1f} "
                  f"({row['host_range_us'][0]:.1f}-{row['host_range_us'][1]:.1f}) | {row['total_us']:.1f} |", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"command": " ".join(sys.argv), "device": str(mx.default_device()),
                                         "shapes": shapes(), "bit_check": check, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
