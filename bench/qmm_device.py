"""The tensor-core quantized matmul (daemon/engine/kernels/quant_mma.py) on the device, in one call.

    PYTHONPATH=/tmp/site:$PWD python3 bench/qmm_device.py --out $OUT [--budget 540] [--skip-steps]

Sections run in order of what the next decision needs, each guarded (an error is printed
whole, with the kernel source when it is a compile error; the next section runs), the JSON
(DIR/qmm_device.json) rewritten after each, and a section that would start past the time
budget is skipped and says so:

1. env: device, MLX, copy bandwidth (the weight-read bound's denominator).
2. correctness: against the dequantized weight's float32 product computed on the GPU in plain
   elementwise ops (no TF32, no tensor cores), bits 4/8, groups 32/64/128, bf16 (and fp16),
   M across the tile edges; ||y - ref|| / ||ref|| beside MLX's quantized_matmul's.
3. invariance: row r's bits at every M in 1..40 equal the M = 40 forward's, and [B, T, K] equals
   the flat call; MLX's quantized_matmul's classes for the record.
4. sweep: warps per block S (the split of K: fixed per shape) x chunks in flight U at every
   27B linear shape, M = 1, 16, 32; the best S per shape (sum of the three times) and U per
   row-tile count, written as the table quant_mma.SPLITS / UNROLL_BY_TILES take.
5. timing: per 27B shape, 4- and 8-bit, M = 1..32: the kernel at the chosen launch against
   mx.quantized_matmul and the bytes-read bound; the issue's goals (M = 1 at >= 60% of the
   bound, M = 16 <= 1.25x M = 1, M = 32 <= 2x M = 1).
6. steps (27B-shaped random qwen3_5, 4-bit group 64, 256-token cache): one forward of B rows x
   T positions, B x T in (1,1) (1,2) (1,4) (4,1) (4,2) (8,1), kernels "mlx" (MLX's everywhere),
   "qmm" (the quantized linears on this kernel) and "invariant" (the whole fixed-order set), arms
   alternated; then decoders' tokens/s (bench/gpu_batch_spec.py's arms: batch d0 and oracle
   speculation d1/d2 at B = 1 and 4), mlx vs qmm alternated by round.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import mlx.core as mx  # noqa: E402

from daemon.engine.kernels import invariant, invariant_quant, quant_mma  # noqa: E402
from quant_kernel_check import SHAPES_27B, bound_s, log, quantized, timed  # noqa: E402

T0 = time.perf_counter()
RESULTS: dict = {"argv": sys.argv[1:], "errors": [], "skipped": []}
OUT: Path | None = None
BUDGET = 540.0


def save() -> None:
    if OUT is not None:
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "qmm_device.json").write_text(json.dumps(RESULTS, indent=1, default=str))


def section(name: str, needs_s: float):
    def wrap(fn):
        def run(*a, **kw):
            left = BUDGET - (time.perf_counter() - T0)
            if left < needs_s:
                log(f"== {name}: skipped ({left:.0f} s of budget left, needs ~{needs_s:.0f})")
                RESULTS["skipped"].append(name)
                save()
                return
            log(f"== {name}")
            try:
                out = fn(*a, **kw)
                if out is not None:
                    RESULTS[name] = out
            except Exception as exc:  # noqa: BLE001 - every failure is reported and the next section runs
                text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
                print(f"\n===== ERROR in {name} =====\n{text}", flush=True)
                if "compile" in text.lower() or "nvrtc" in text.lower():
                    src = quant_mma.kernel_source()
                    print("\n".join(f"{i + 1:4d} {ln}" for i, ln in enumerate(src.splitlines())), flush=True)
                RESULTS["errors"].append({"where": name, "error": f"{type(exc).__name__}: {exc}"[:2000]})
            save()

        return run

    return wrap


def mma(x, q, s, b, gs, bits, **launch):
    return quant_mma.quantized_matmul_mma(x, q, s, b, gs, bits, **launch)


def mlx_qmm(x, q, s, b, gs, bits):
    return mx.quantized_matmul(x, q, s, b, transpose=True, group_size=gs, bits=bits)


def gpu_reference(x, q, s, b, gs, bits) -> mx.array:
    """float32 products summed in plain ops on the GPU (no matmul unit, so no TF32)."""
    return invariant_quant.reference_quantized_matmul(x.astype(mx.float32), q, s, b, gs, bits)


def rel_err(y, ref) -> float:
    d = (y.astype(mx.float32) - ref)
    return (mx.sqrt((d * d).sum()) / mx.sqrt((ref * ref).sum())).item()


@section("env", 5)
def env() -> dict:
    from gpu_bench import copy_bandwidth

    bw = copy_bandwidth(gib=2.0)
    info = {"mlx": mx.__version__, "device": str(mx.default_device()), "backend": invariant.backend(),
            "kernel": quant_mma._NAME, "copy_bandwidth": bw}
    try:
        info["device_info"] = dict(mx.device_info())
    except Exception as exc:  # noqa: BLE001
        info["device_info"] = f"unavailable: {exc}"
    log(f"backend {info['backend']}, mlx {mx.__version__}, copy {bw['bytes_per_s'] / 1e12:.2f} TB/s")
    return info


def bandwidth() -> float:
    return ((RESULTS.get("env") or {}).get("copy_bandwidth") or {}).get("bytes_per_s") or 3.0e12


@section("correctness", 20)
def correctness() -> dict:
    cases = []
    for bits in (4, 8):
        for gs in (32, 64, 128):
            cases.append((bits, gs, 1024, 768, mx.bfloat16))
        cases += [(bits, 64, 17408, 5120, mx.bfloat16), (bits, 64, 5120, 17408, mx.bfloat16),
                  (bits, 64, 48, 5120, mx.bfloat16), (bits, 64, 1024, 768, mx.float16)]
    out, worst = {}, 0.0
    for bits, gs, N, K, dt in cases:
        q, s, b = quantized(N, K, gs, bits, dtype=dt, seed=N + K + bits)
        x = mx.random.normal((40, K), key=mx.random.key(K + gs)).astype(dt)
        ref = gpu_reference(x, q, s, b, gs, bits)
        mx.eval(ref)
        row = {}
        for M in (1, 2, 8, 9, 16, 17, 33, 40):
            y = mma(x[:M], q, s, b, gs, bits)
            poison_ok = not mx.any(mx.isnan(y)).item()
            e = rel_err(y, ref[:M])
            em = rel_err(mlx_qmm(x[:M], q, s, b, gs, bits), ref[:M])
            row[M] = {"rel_err": e, "mlx_rel_err": em, "finite": poison_ok}
            worst = max(worst, e if poison_ok else 1.0)
        key = f"b{bits}_g{gs}_{N}x{K}_{'bf16' if dt == mx.bfloat16 else 'fp16'}"
        out[key] = row
        log(f"{key}: rel err max {max(v['rel_err'] for v in row.values()):.2e} "
            f"(mlx {max(v['mlx_rel_err'] for v in row.values()):.2e})")
    out["worst_rel_err"] = worst
    out["ok"] = worst < 1e-2
    return out


def invariance_of(fn, K: int, dtype=mx.bfloat16, Mmax: int = 40) -> dict:
    x = mx.random.normal((Mmax, K), key=mx.random.key(11)).astype(dtype)
    full = fn(x)
    mx.eval(full)
    differs = [M for M in range(1, Mmax) if not mx.array_equal(fn(x[:M]), full[:M]).item()]
    bt = fn(x[:18].reshape(2, 9, K))
    same_bt = mx.array_equal(bt.reshape(18, -1), full[:18]).item()
    return {"invariant": not differs and same_bt, "differs_at_M": differs[:20], "bt_layout_equal": same_bt}


@section("invariance", 20)
def invariance() -> dict:
    out = {}
    for bits in (4, 8):
        for N, K in ((17408, 5120), (5120, 17408), (1024, 768)):
            q, s, b = quantized(N, K, 64, bits, seed=N)
            k = invariance_of(lambda x: invariant_quant.quantized_matmul(x, q, s, b, 64, bits, "cuda"), K)
            m = invariance_of(lambda x: mlx_qmm(x, q, s, b, 64, bits), K)
            out[f"b{bits}_{N}x{K}"] = {"kernel": k, "mlx": m}
            log(f"b{bits} {N}x{K}: kernel invariant {k['invariant']}; mlx differs at M {m['differs_at_M'][:8]}")
    out["all_invariant"] = all(v["kernel"]["invariant"] for v in out.values())
    return out


def distinct_shapes() -> list[tuple[str, int, int, int]]:
    seen, out = set(), []
    for name, (N, K, count) in SHAPES_27B.items():
        if (N, K) not in seen:
            seen.add((N, K))
            out.append((name, N, K, count))
    return out


@section("sweep", 90)
def sweep() -> dict:
    rows, splits, unrolls = [], {}, {}
    for bits in (4, 8):
        for name, N, K, _ in distinct_shapes():
            if quant_mma.mma_refusal(mx.bfloat16, N, K, 64, bits) is not None:
                continue
            q, s, b = quantized(N, K, 64, bits, seed=N)
            xs = {M: mx.random.normal((M, K)).astype(mx.bfloat16) for M in (1, 16, 32)}
            mx.eval(*xs.values())
            best = None
            for S in (1, 2, 4, 8, 16):
                if (K // quant_mma.chunk_inputs(bits)) < S:
                    continue
                for U in ((1, 2, 4) if bits == 4 else (2,)):
                    t = {M: timed(lambda: mma(xs[M], q, s, b, 64, bits, split=S, unroll=U), reps=10, trials=5)
                         ["batched_s"] * 1e6 for M in xs}
                    rows.append({"bits": bits, "shape": name, "N": N, "K": K, "S": S, "U": U, "us": t})
                    score = t[1] + t[16] + t[32]
                    if best is None or score < best[0]:
                        best = (score, S, U, t)
            splits[f"{N},{K},{bits}"] = best[1]
            log(f"b{bits} {name}: best S={best[1]} U={best[2]}: " + ", ".join(f"M{m} {v:.1f}us" for m, v in best[3].items()))
            del q, s, b
    # U by tiles: the U with the lowest summed time at the split each shape chose, per M
    for M, tiles in ((1, 1), (16, 2), (32, 4)):
        totals: dict[int, float] = {}
        for r in rows:
            if r["bits"] == 4 and splits.get(f"{r['N']},{r['K']},4") == r["S"]:
                totals[r["U"]] = totals.get(r["U"], 0.0) + r["us"][M]
        if totals:
            unrolls[tiles] = min(totals, key=totals.get)
    return {"rows": rows, "splits": splits, "unroll_by_tiles": unrolls}


def apply_sweep() -> None:
    sw = RESULTS.get("sweep") or {}
    for key, S in (sw.get("splits") or {}).items():
        N, K, bits = (int(v) for v in key.split(","))
        quant_mma.SPLITS[(N, K, bits)] = S
    for tiles, U in (sw.get("unroll_by_tiles") or {}).items():
        quant_mma.UNROLL_BY_TILES[int(tiles)] = U
    if sw.get("unroll_by_tiles", {}).get(4) is not None:
        quant_mma.UNROLL_BY_TILES[3] = sw["unroll_by_tiles"][4]
    quant_mma.forget_launches()


@section("timing", 45)
def timing(bit_widths=(4, 8)) -> dict:
    apply_sweep()
    bw = bandwidth()
    rows = []
    for bits in bit_widths:
        for name, (N, K, count) in SHAPES_27B.items():
            q, s, b = quantized(N, K, 64, bits, seed=N)
            for M in (1, 2, 4, 8, 16, 32):
                x = mx.random.normal((M, K)).astype(mx.bfloat16)
                mx.eval(x)
                r = {"bits": bits, "shape": name, "N": N, "K": K, "M": M, "count_in_27b": count,
                     "bound_us": bound_s(N, K, M, bits, 64, bw) * 1e6}
                r["mlx_us"] = timed(lambda: mlx_qmm(x, q, s, b, 64, bits), reps=10, trials=5)["batched_s"] * 1e6
                r["kernel_us"] = timed(lambda: invariant_quant.quantized_matmul(x, q, s, b, 64, bits, "cuda"),
                                       reps=10, trials=5)["batched_s"] * 1e6
                rows.append(r)
            sel = [r for r in rows if r["shape"] == name and r["bits"] == bits]
            log(f"b{bits} {name}: " + ", ".join(f"M{r['M']} {r['kernel_us']:.1f}/{r['mlx_us']:.1f}" for r in sel)
                + f" us (kernel/mlx; bound M1 {sel[0]['bound_us']:.1f})")
            del q, s, b
            mx.clear_cache()
    goals = {}
    for bits in bit_widths:
        for name, (N, K, _) in SHAPES_27B.items():
            by = {r["M"]: r for r in rows if r["bits"] == bits and r["shape"] == name}
            goals[f"b{bits} {name}"] = {"m1_bound_frac": by[1]["bound_us"] / by[1]["kernel_us"],
                                        "m16_over_m1": by[16]["kernel_us"] / by[1]["kernel_us"],
                                        "m32_over_m1": by[32]["kernel_us"] / by[1]["kernel_us"],
                                        "mlx_m1_over_kernel": by[1]["mlx_us"] / by[1]["kernel_us"]}
    per_step = {}
    for bits in bit_widths:
        for M in (1, 2, 4, 8, 16, 32):
            sel = [r for r in rows if r["bits"] == bits and r["M"] == M]
            per_step[f"b{bits}_M{M}"] = {k: sum(r[k] * r["count_in_27b"] for r in sel) / 1e3
                                        for k in ("kernel_us", "mlx_us", "bound_us")}
    return {"rows": rows, "goals": goals, "per_27b_step_ms": per_step}


def set_kernels(lm, arm: str) -> None:
    invariant.uninstall(lm.text_module)
    if arm == "qmm":
        invariant.install(lm.text_module, max_rows=72, quantized_only=True)
    elif arm == "invariant":
        invariant.install(lm.text_module, max_rows=72)


def forward_costs(lm, arms, shapes, context: int, rounds: int) -> dict:
    from mlx_lm.models.cache import make_prompt_cache

    text = lm.text_module
    V = text.args.vocab_size
    res = {f"{arm} B{B}T{T}": [] for arm in arms for B, T in shapes}
    for B, T in shapes:
        for r in range(rounds):
            for arm in arms:
                set_kernels(lm, arm)
                cache = make_prompt_cache(text)
                prompt = mx.random.randint(0, V, (B, context))
                mx.eval(text(prompt, cache=cache))
                toks = mx.random.randint(0, V, (B, T))
                mx.eval(text(toks, cache=cache))  # the shape's first call: compiles, plans
                ts = []
                for _ in range(8):
                    toks = mx.random.randint(0, V, (B, T))
                    mx.eval(toks)
                    mx.synchronize()
                    t = time.perf_counter()
                    mx.eval(text(toks, cache=cache))
                    mx.synchronize()
                    ts.append(time.perf_counter() - t)
                res[f"{arm} B{B}T{T}"].append(statistics.median(ts) * 1e3)
                del cache
                mx.clear_cache()
    out = {}
    for arm in arms:
        base = statistics.median(res[f"{arm} B1T1"])
        for B, T in shapes:
            v = res[f"{arm} B{B}T{T}"]
            out[f"{arm} B{B}T{T}"] = {"ms": v, "median_ms": statistics.median(v),
                                      "over_own_B1T1": statistics.median(v) / base}
        log(f"{arm}: " + ", ".join(f"B{B}T{T} {out[f'{arm} B{B}T{T}']['median_ms']:.1f}ms" for B, T in shapes))
    return out


@section("steps", 150)
def steps(skip_decoders: bool, arms=("mlx", "qmm", "invariant"),
          shapes=((1, 1), (1, 2), (1, 4), (4, 1), (4, 2), (8, 1))) -> dict:
    from gpu_batch_spec import BatchOracleHead, run_arm
    from gpu_bench import PROFILES, QWEN35_27B, build_model, quantize_4bit

    apply_sweep()
    t = time.perf_counter()
    lm, head, inv = build_model(QWEN35_27B)
    quantize_4bit(lm, head)
    mx.clear_cache()
    log(f"27B 4-bit built in {time.perf_counter() - t:.0f}s, active {mx.get_active_memory() / 1e9:.1f} GB")
    out = {"forward": forward_costs(lm, list(arms), list(shapes), context=256, rounds=2)}
    RESULTS["steps"] = out
    save()
    if skip_decoders or BUDGET - (time.perf_counter() - T0) < 60:
        out["decoders"] = "skipped (budget)"
        return out
    oracle = BatchOracleHead(head, inv, PROFILES["seed_0.83"], QWEN35_27B["vocab_size"])
    rng = random.Random(5)
    dec = {}
    for B in (1, 4):
        for rnd in range(2):
            prompts = [[rng.randrange(QWEN35_27B["vocab_size"]) for _ in range(200 + 17 * rnd)] for _ in range(B)]
            for arm in ("mlx", "qmm"):
                set_kernels(lm, arm)
                for d in ("batch d0", "spec d1", "spec d2"):
                    if rnd == 0:
                        run_arm(lm, oracle, d, prompts, 3)  # compiles the shapes
                    rate, per = run_arm(lm, oracle, d, prompts, 24)
                    dec.setdefault(f"{arm} B{B} {d}", []).append({"tok_s": rate, "tokens_per_row_step": per})
                    log(f"{arm} B={B} {d} round {rnd}: {rate:.1f} tok/s ({per:.2f}/row/step)")
            if BUDGET - (time.perf_counter() - T0) < 20:
                break
    out["decoders"] = {k: {"tok_s": [r["tok_s"] for r in v], "median_tok_s": statistics.median(r["tok_s"] for r in v),
                           "tokens_per_row_step": statistics.median(r["tokens_per_row_step"] for r in v)}
                       for k, v in dec.items()}
    return out


def main(argv=None) -> int:
    global OUT, BUDGET
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/out/qmm")
    ap.add_argument("--budget", type=float, default=540.0, help="seconds; a section that would start past it is skipped")
    ap.add_argument("--skip-steps", action="store_true")
    ap.add_argument("--skip-decoders", action="store_true")
    args = ap.parse_args(argv)
    OUT, BUDGET = Path(args.out), args.budget
    if invariant.backend() != "cuda":
        print("qmm_device.py needs MLX on CUDA (the tensor-core kernel is CUDA-only)", file=sys.stderr)
        return 2
    env()
    correctness()
    invariance()
    sweep()
    timing()
    if not args.skip_steps:
        steps(args.skip_decoders)
    g = (RESULTS.get("timing") or {}).get("goals") or {}
    if g:
        print("\n| shape | M=1 at bound | M16/M1 | M32/M1 | MLX M1 / kernel M1 |\n|---|---|---|---|---|")
        for k, v in g.items():
            print(f"| {k} | {v['m1_bound_frac']:.0%} | {v['m16_over_m1']:.2f} | {v['m32_over_m1']:.2f} | "
                  f"{v['mlx_m1_over_kernel']:.2f}x |")
    save()
    log(f"done; errors: {len(RESULTS['errors'])}, skipped: {RESULTS['skipped']}")
    return 1 if RESULTS["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
