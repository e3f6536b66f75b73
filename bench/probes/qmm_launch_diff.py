"""Each launch of the tensor-core matmul against a float32 reference and against itself run
again, on the 27B down projection (17408 -> 5120, S = 8) at a few row counts: which launch of
which kernel (the tree's, ``--old-source``'s) gives which error; with ``--kb-source`` and
``--kb-between``, a kernel declared with a cluster of blocks (``__cluster_dims__``) runs before
each measured launch. Written for bench/qmm_graph.py --mode check's "DIFFER" of 2026-12-06:
MLX's CUDA graph cache updates a cached graph's kernel node to another kernel of the same
place in the graph, and a node that changes its cluster shape is not updated correctly
(MLX's own comment in backend/cuda/device.cpp; MLX keys kernel nodes alike unless MLX itself
launched them with a cluster).

    PYTHONPATH=/tmp/site:$PWD python3 bench/probes/qmm_launch_diff.py --old-source old_quant_mma.py \
        [--kb-source kb_quant_mma.py --kb-between 2] [--mlx-compile]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import mlx.core as mx  # noqa: E402

from daemon.engine.kernels import custom_kernel_cache, quant_mma  # noqa: E402
from qmm_graph import GS, load_kernel_module, random_quantized  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old-source")
    ap.add_argument("--ms", default="1,9,17")
    ap.add_argument("--shape", default="5120,17408")
    ap.add_argument("--mlx-compile", action="store_true", help="MLX compiles the kernels (the daemon's disk cache off)")
    ap.add_argument("--kb-source", help="a quant_mma.py whose kernel takes ``kblocks`` (a cluster of KB blocks per "
                    "column tile, declared at compile time: git show ad9ea4d:daemon/engine/kernels/quant_mma.py)")
    ap.add_argument("--kb-between", type=int, default=0,
                    help="with --kb-source: a launch with a cluster of this many blocks before each measured launch")
    args = ap.parse_args()
    kbmod = load_kernel_module(args.kb_source) if args.kb_source else None
    if args.mlx_compile:
        custom_kernel_cache.CACHE.configure(False)
    N, K = (int(v) for v in args.shape.split(","))
    q, s, b = random_quantized(N, K, 4, key=N)
    x = mx.random.normal((40, K), key=mx.random.key(3)).astype(mx.bfloat16)
    w = mx.dequantize(q, s, b, group_size=GS, bits=4).astype(mx.float32)
    mods = {"new": quant_mma}
    if args.old_source:  # another version beside the tree's
        mods["old"] = load_kernel_module(args.old_source)
    S = quant_mma.default_split(N, K, 4)
    launches = [{"columns": 1, "unroll": 1}] + [{"columns": na, "unroll": u} for na in (1, 2, 4) for u in (1, 2)]
    launches += [{"stages": p} for p in (0, 2, 4)] + [{"stages": 2, "columns": 1}, {"split": 4}, {"split": 2}]
    for M in (int(m) for m in args.ms.split(",")):
        ref = x[:M].astype(mx.float32) @ w.T
        for name, mod in mods.items():
            for kw in launches:
                kw = {"split": S} | kw
                if kbmod is not None and args.kb_between > 1:
                    mx.eval(kbmod.quantized_matmul_mma(x[:M], q, s, b, GS, 4, split=S, kblocks=args.kb_between))
                y1 = mod.quantized_matmul_mma(x[:M], q, s, b, GS, 4, **kw)
                mx.eval(y1)
                y2 = mod.quantized_matmul_mma(x[:M], q, s, b, GS, 4, **kw)
                mx.eval(y2)
                err = (mx.abs(y1.astype(mx.float32) - ref).max() / mx.abs(ref).max()).item()
                bad_rows = [i for i in range(M) if (mx.abs(y1[i].astype(mx.float32) - ref[i]).max()
                                                    / mx.abs(ref[i]).max()).item() > 0.05]
                print(f"M{M} {name} {kw}: max rel err {err:.1e}, again {'same' if mx.array_equal(y1, y2).item() else 'DIFFERENT'}"
                      f", bad rows {bad_rows[:12]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
