"""Prefill before/after on a GPU (MLX on CUDA): token-by-token vs chunked GatedDeltaNet.

``python bench/gpu_prefill.py --out DIR [--shape 27b|tiny] [--dtypes bf16,4bit] [--lengths 256,1024,2048]``

1. The recurrence alone, at the model's GatedDeltaNet shape (random normalized q/k, gates
   from mlx-lm's compute_g): mlx-lm's ``gated_delta_ops`` vs ``chunk_gated_delta`` at each
   length, synced, alternating, median of ``--reps``; max abs difference of outputs and final
   state (relative to the largest magnitude).
2. The model (gpu_bench.build_model: random, decisive weights of the real shape), per dtype:
   ``daemon.measure.prefill_bench.run_prefill_ab`` (prefill + first token, token loop vs
   chunked, interleaved ABAB/BABA, one warm-up round), with the greedy continuation after
   each arm's prefill compared.
Writes DIR/gpu_prefill.json and DIR/gpu_prefill.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from bench.gpu_bench import QWEN35_27B, TINY, build_model, log, quantize_4bit  # noqa: E402
from daemon.engine.kernels import chunked_prefill as cp  # noqa: E402
from daemon.measure.prefill_bench import format_prefill_ab, run_prefill_ab  # noqa: E402


def recurrence_ab(cfg: dict, lengths, reps: int) -> dict:
    from mlx_lm.models.gated_delta import compute_g, gated_delta_ops, normalize_qk

    Hk, Hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    Dk, Dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    out = {}
    for T in lengths:
        mx.random.seed(T)
        bf = mx.bfloat16
        q, k = normalize_qk(mx.random.normal((1, T, Hk, Dk)).astype(bf), mx.random.normal((1, T, Hk, Dk)).astype(bf),
                            inv_scale=Dk**-0.5, eps=1e-6)
        v = mx.random.normal((1, T, Hv, Dv)).astype(bf)
        a, b = mx.random.normal((1, T, Hv)).astype(bf), mx.random.normal((1, T, Hv)).astype(bf)
        A_log, dt_bias = mx.log(mx.random.uniform(1, 16, (Hv,))), mx.ones(Hv).astype(bf)
        g = compute_g(A_log, a, dt_bias)
        log_g = -mx.exp(A_log) * nn.softplus(a + dt_bias)
        beta = mx.sigmoid(b)
        s0 = 0.1 * mx.random.normal((1, Hv, Dv, Dk))
        mx.eval(q, k, v, g, log_g, beta, s0)
        arms = {"token loop": lambda: gated_delta_ops(q, k, v, g, beta, s0),
                "chunked": lambda: cp.chunk_gated_delta(q, k, v, log_g, beta, s0)}
        res = {name: f() for name, f in arms.items()}
        mx.eval(res)
        (y0, s_0), (y1, s_1) = res["token loop"], res["chunked"]
        times = {name: [] for name in arms}
        for i in range(reps):
            for name in (arms if i % 2 == 0 else reversed(list(arms))):
                t = time.perf_counter()
                mx.eval(arms[name]())
                times[name].append(time.perf_counter() - t)
        med = {n: statistics.median(ts) for n, ts in times.items()}
        out[T] = {"token_loop_ms": 1e3 * med["token loop"], "chunked_ms": 1e3 * med["chunked"],
                  "speedup": med["token loop"] / med["chunked"],
                  "y_max_abs_diff": mx.abs(y0.astype(mx.float32) - y1.astype(mx.float32)).max().item(),
                  "y_max_abs": mx.abs(y0.astype(mx.float32)).max().item(),
                  "state_max_abs_diff": mx.abs(s_0 - s_1).max().item(), "state_max_abs": mx.abs(s_0).max().item(),
                  "y_bf16_elements_differing": (y0 != y1).astype(mx.float32).mean().item()}
        log(f"recurrence T={T}: {out[T]}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/out/gpu")
    ap.add_argument("--shape", choices=("27b", "tiny"), default="27b")
    ap.add_argument("--dtypes", default="bf16,4bit", help="comma list, or none (the recurrence alone)")
    ap.add_argument("--lengths", default="256,1024,2048")
    ap.add_argument("--recurrence-lengths", default="64,128,256,1024,2048")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--continuation", type=int, default=16)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = QWEN35_27B if args.shape == "27b" else TINY
    lengths = [int(x) for x in args.lengths.split(",")]
    import os

    res: dict = {"MLX_ENABLE_TF32": os.environ.get("MLX_ENABLE_TF32", "unset (1: float32 matmuls in TF32 on CUDA)"),
                 "command": "python bench/gpu_prefill.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                 "machine": {"platform": platform.platform(), "device": str(mx.default_device()), "mlx": mx.__version__},
                 "shape": args.shape, "chunk": cp.CHUNK, "min_t": cp.MIN_T}
    md = [f"# Prefill on {res['machine']['device']}, {args.shape} shape (mlx {mx.__version__})", ""]

    def save():
        (out / "gpu_prefill.json").write_text(json.dumps(res, indent=2, default=str))
        (out / "gpu_prefill.md").write_text("\n".join(md) + "\n")

    res["recurrence"] = recurrence_ab(cfg, [int(x) for x in args.recurrence_lengths.split(",")], args.reps)
    md += ["## The recurrence alone (one GatedDeltaNet layer's shape, bf16 in, float32 state)", "",
           "| T | token loop ms | chunked ms | speedup | max abs diff y (max abs y) | max abs diff state (max abs) |",
           "|---|---|---|---|---|---|"]
    for T, r in res["recurrence"].items():
        md.append(f"| {T} | {r['token_loop_ms']:.1f} | {r['chunked_ms']:.1f} | {r['speedup']:.1f}x | "
                  f"{r['y_max_abs_diff']:.2g} ({r['y_max_abs']:.2g}) | {r['state_max_abs_diff']:.2g} ({r['state_max_abs']:.2g}) |")
    md.append("")
    save()
    if args.dtypes == "none":
        print("\n".join(md))
        return 0
    log("building the model")
    lm, head, _ = build_model(cfg)  # the head only rides along (quantize_4bit quantizes it like the base)
    lm.chunked_prefill = True
    for dtype in args.dtypes.split(","):
        if dtype == "4bit":
            quantize_4bit(lm, head)
        r = run_prefill_ab(lm, lengths, args.rounds, args.continuation, log=log)
        res[dtype] = r
        md += [format_prefill_ab(r, f"model prefill, {args.shape} {dtype}"), ""]
        save()
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
