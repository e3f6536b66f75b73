"""What a new attention shape costs, by MLX process setting, and whether a long run trips
MLX's plan-cache "thrashing" error (engine/jit/backend_env.py sets the switches it chose).

Each arm is a fresh process, since MLX reads its switches once per process:
  mlx-default  MLX's own defaults: cuDNN for query lengths > 1, thrashing check on
  daemon       what the daemon sets by default (backend_env.configure(False, ...)):
               cuDNN attention off, thrashing check off
  daemon-cudnn what `cudnn_attention = true` sets: cuDNN on, 1,024 plans, check off
Cases, at the bundled model's attention shape (4 query heads, 2 key heads, dim 64, bf16;
--heads/--kv-heads/--dim for others), keys sliced from a buffer grown in steps of 256 as
mlx-lm's KVCache does (so strides are the daemon's):
  step          B=1, T=1 (a decode step)
  feed2         B=1, T=2, causal (the head's feed of a depth-1 cycle; a verify of depth 1)
  verify4       B=1, T=4, causal
  batch2/batch4 B=4, T=2 / 4, boolean mask [B, 1, T, L] (a batched verify's rows)
  chunk256      B=1, T=256, causal (a prompt chunk)
  rem100        B=1, T=100, causal (a prompt's remainder)
For each: --new calls at key lengths never seen before (first use: median ms, synced),
then the same lengths again (warm). In the daemon arm the invariant kernel
(engine/kernels/invariant.py) is timed on the small cases too. Last, --thrash calls at T=2 with
distinct key lengths: the call at which an error came, if one did.

    PYTHONPATH=$PWD python3 bench/probes/attention_first_use.py --json $OUT/attention_first_use.json

Result on the H200: bench/results/h200_2026-12-02b/attention_first_use.*"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.probe_child import parse_or_answer, run_child  # noqa: E402

CASES = {  # name: (B, T, mask kind)
    "step": (1, 1, None),
    "feed2": (1, 2, "causal"),
    "verify4": (1, 4, "causal"),
    "batch2": (4, 2, "array"),
    "batch4": (4, 4, "array"),
    "chunk256": (1, 256, "causal"),
    "rem100": (1, 100, "causal"),
}
SMALL = ("feed2", "verify4", "batch2", "batch4")


def _child(args) -> dict:
    import mlx.core as mx

    from daemon.engine.kernels import invariant

    def qkv(B, T, L):
        cap = -(-L // 256) * 256
        q = mx.random.normal((B, args.heads, T, args.dim)).astype(mx.bfloat16)
        kb = mx.random.normal((B, args.kv_heads, cap, args.dim)).astype(mx.bfloat16)
        vb = mx.random.normal((B, args.kv_heads, cap, args.dim)).astype(mx.bfloat16)
        k, v = kb[..., :L, :], vb[..., :L, :]
        mx.eval(q, k, v)
        return q, k, v

    def mask_for(kind, B, T, L):
        if kind == "array":
            m = mx.arange(L)[None, :] <= mx.arange(L - T, L)[:, None]
            m = mx.broadcast_to(m[None, None], (B, 1, T, L))
            mx.eval(m)
            return m
        return kind

    def timed(fn) -> float:
        mx.synchronize()
        t = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        return (time.perf_counter() - t) * 1e3

    scale = args.dim ** -0.5
    out: dict = {"env": {k: v for k, v in os.environ.items() if k.startswith("MLX_")}, "cases": {}}
    base = 300
    for name, (B, T, kind) in CASES.items():
        lengths = [base + 7 * i + T for i in range(args.new)]
        base += 7 * args.new + 512
        inputs = [(qkv(B, T, L), mask_for(kind, B, T, L)) for L in lengths]
        row: dict = {}
        for label in ("first", "warm"):
            ms = [timed(lambda a=a, m=m: mx.fast.scaled_dot_product_attention(*a, scale=scale, mask=m))
                  for a, m in inputs]
            row[label] = {"median_ms": round(statistics.median(ms), 3), "max_ms": round(max(ms), 3)}
        if name in SMALL and invariant.backend() is not None:
            ms = [timed(lambda a=a, m=m: invariant.invariant_sdpa(*a, scale, m)) for a, m in inputs]
            row["invariant"] = {"median_ms": round(statistics.median(ms), 3), "max_ms": round(max(ms), 3)}
        out["cases"][name] = row
        print(name, json.dumps(row), flush=True)
    thrash = {"calls": args.thrash, "error_at": None, "error": None}
    t0 = time.perf_counter()
    for i in range(args.thrash):
        L = 5000 + i
        q, k, v = qkv(1, 2, L)
        try:
            mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal"))
        except RuntimeError as exc:
            thrash.update(error_at=i, error=str(exc)[:160])
            break
    thrash["seconds"] = round(time.perf_counter() - t0, 2)
    out["thrash"] = thrash
    print("thrash", json.dumps(thrash), flush=True)
    return out


ARMS = ("mlx-default", "daemon", "daemon-cudnn")


def _env(arm: str) -> dict:
    from daemon.engine.jit import backend_env

    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_") or k == backend_env.PTX_CACHE_DIR}
    if arm != "mlx-default":
        backend_env.configure(arm == "daemon-cudnn", None, env)
    return env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--new", type=int, default=20, help="new key lengths per case")
    ap.add_argument("--thrash", type=int, default=1500, help="distinct T=2 shapes in the thrashing run")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=64)
    args = parse_or_answer(ap, _child)
    if args is None:
        return
    results = {}
    for arm in args.arms.split(","):
        argv = ["--new", str(args.new), "--thrash", str(args.thrash), "--heads", str(args.heads),
                "--kv-heads", str(args.kv_heads), "--dim", str(args.dim)]
        r = run_child(__file__, argv, _env(arm))
        if "error" not in r:
            results[arm] = r
    print(f"\n{'case':10} " + " ".join(f"{a + ' first/warm ms':>28}" for a in results) + "   invariant ms")
    for name in CASES:
        cells = []
        for arm, r in results.items():
            c = r.get("cases", {}).get(name)
            cells.append(f"{c['first']['median_ms']:>13.3f} / {c['warm']['median_ms']:<12.3f}" if c else f"{'-':>28}")
        inv = results.get("daemon", {}).get("cases", {}).get(name, {}).get("invariant")
        print(f"{name:10} " + " ".join(f"{x:>28}" for x in cells) + (f"   {inv['median_ms']:.3f}" if inv else ""))
    for arm, r in results.items():
        t = r.get("thrash")
        if t:
            print(f"thrash {arm}: {t['calls']} distinct shapes, error at {t['error_at']} ({t['seconds']} s)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        import mlx.core as mx

        args.json.write_text(json.dumps({"mlx": mx.__version__, "device": str(mx.default_device()),
                                         "args": vars(args) | {"json": str(args.json)}, "arms": results}, indent=1))


if __name__ == "__main__":
    main()
