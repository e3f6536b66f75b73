"""Device check of the fixed-order quantized matmul (daemon/engine/kernels/invariant_quant.py).

    PYTHONPATH=/tmp/site:$PWD python3 bench/quant_kernel_check.py --out $OUT [--quick] [--parts]
        [--parts-only] [--layers 8] [--context 256]

Run on a GPU (MLX on CUDA, or Metal); on the CPU it runs the same sections through the
reference ops, which only checks the script. One process, each section guarded (an error is
printed whole, with the kernel source when it is a compile error, and recorded; the next
section runs), the JSON rewritten after every section (DIR/quant_kernel_check.json):

1. env: backend, device, mlx version; copy bandwidth (a + 1 over 2 GiB of bf16).
2. compile: one small call per bits (4, 8) x group (32, 64, 128) x dtype (bf16, fp16, fp32).
3. correctness: the kernel against the dequantized weight's float32 product computed on the
   device in plain ops (exact float32 reference; on the CPU it took >100 s per 27B shape), bits 4/8, groups 32/64/128, M in 1, 2, 4, 8, 16, 32 (and the
   tile edges 3, 9, 17, 33), shapes incl. the 27B MLP's 5120 -> 17408 and 17408 -> 5120 and an
   N that is not a multiple of the columns per warp. Bound: |err| <= 2^-8 |ref| (one bf16
   rounding of the output; 2^-20 for fp32 outputs) + 1e-5 * sum_k |x w| (float32 order).
   MLX's quantized_matmul's error against the same reference is printed beside it.
4. invariance: row r's bits for every M in 1..33 equal the M = 33 forward's row r, and a
   [B, T, K] call equals the flat one; the same check of mx.quantized_matmul, for the record.
5. sweep: the launch shape (columns per warp, warps per block, row tile) at the two 27B MLP
   shapes, M = 1, 8, 32, 4-bit group 64; every variant is checked for invariance too.
6. timing: per 27B layer shape (q/k/v/o, GDN in_proj_qkv/z/b/a and out_proj, MLP, lm_head),
   4-bit and 8-bit at group 64, M = 1, 2, 4, 8, 16, 32: the kernel (default and best launch
   shape) against mx.quantized_matmul and against the bytes-read bound (weights + scales +
   biases + x + y over the measured copy bandwidth), medians of synced batches of calls.
7. parts (``--parts``; a table of a batched verify's parts at B = 1, 4, 8 and T = 1..4,
   wanted before any kernel is written for them): a 27B-shaped 4-bit stack of ``--layers`` layers (3 GatedDeltaNet
   to 1 attention, as the 27B) over a ``--context``-token cache: per (B, T), the whole forward
   through mlx-lm's path and through the daemon's batched-verify path (capture_hidden over
   ragged merged caches), graph-building time on the host, and one layer of each kind split
   into its matmuls, its core (attention: the fused SDPA; GDN: the rest of the layer) and the
   lm_head; the 64-layer estimate from the per-layer parts. Then the same with the invariant
   kernels installed.
"""

from __future__ import annotations

import argparse
import json
import platform
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

from daemon.engine.kernels import invariant, invariant_quant  # noqa: E402

T0 = time.perf_counter()
RESULTS: dict = {"argv": sys.argv[1:], "errors": []}
OUT: Path | None = None

# Qwen3.5-27B's linear shapes (N outputs, K inputs) and how many of each the model holds.
SHAPES_27B = {
    "mlp.gate/up 5120->17408": (17408, 5120, 128),
    "mlp.down 17408->5120": (5120, 17408, 64),
    "attn.q_proj 5120->12288": (12288, 5120, 16),
    "attn.k/v_proj 5120->1024": (1024, 5120, 32),
    "attn.o_proj 6144->5120": (5120, 6144, 16),
    "gdn.in_proj_qkv 5120->10240": (10240, 5120, 48),
    "gdn.in_proj_z 5120->6144": (6144, 5120, 48),
    "gdn.in_proj_b/a 5120->48": (48, 5120, 96),
    "gdn.out_proj 6144->5120": (5120, 6144, 48),
    "lm_head 5120->248320": (248320, 5120, 1),
}
MS = (1, 2, 4, 8, 16, 32)
DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}


def big(N: int, K: int) -> tuple[int, int]:
    """A shape as given on a GPU; on the CPU (reference ops, elementwise products of M x N x K)
    a small stand-in, so the script can be checked there."""
    if invariant.backend() is not None:
        return N, K
    return min(N, 1024 if N >= K else 256), min(K, 1024 if K > N else 256)


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def save() -> None:
    if OUT is not None:
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "quant_kernel_check.json").write_text(json.dumps(RESULTS, indent=1, default=str))


def report_error(where: str, exc: BaseException) -> None:
    """Print the error whole (an NVRTC/Metal compile log comes in the message) and, for a
    kernel failure, the kernel source with line numbers, so one run tells everything."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    print(f"\n===== ERROR in {where} =====\n{text}", flush=True)
    entry = {"where": where, "error": f"{type(exc).__name__}: {exc}", "traceback": text}
    if "kernel" in text.lower() or "nvrtc" in text.lower() or "compile" in text.lower():
        src = invariant_quant._METAL_QMM if invariant.backend() == "metal" else invariant_quant._CUDA_QMM
        numbered = "\n".join(f"{i + 1:4d} {line}" for i, line in enumerate(src.splitlines()))
        print(f"----- kernel source ({invariant.backend()}) -----\n{numbered}\n-----", flush=True)
    RESULTS["errors"].append(entry)
    save()


def section(name: str):
    def wrap(fn):
        def run(*a, **kw):
            log(f"== {name}")
            try:
                out = fn(*a, **kw)
                if out is not None:
                    RESULTS[name] = out
            except Exception as exc:  # noqa: BLE001 - every failure is reported and the next section runs
                report_error(name, exc)
            save()

        return run

    return wrap


def sync() -> None:
    mx.synchronize()


def timed(fn, reps: int = 20, trials: int = 7) -> dict:
    """Median seconds per call: ``reps`` calls evaluated together, synced (``batched``), and a
    single call evaluated and synced (``single``: with launch and host overhead)."""
    mx.eval(fn())
    sync()
    batched = []
    for _ in range(trials):
        sync()
        t = time.perf_counter()
        outs = [fn() for _ in range(reps)]
        mx.eval(outs)
        sync()
        batched.append((time.perf_counter() - t) / reps)
        del outs
    single = []
    for _ in range(trials * 2):
        sync()
        t = time.perf_counter()
        mx.eval(fn())
        sync()
        single.append(time.perf_counter() - t)
    return {"batched_s": statistics.median(batched), "single_s": statistics.median(single)}


def quantized(N: int, K: int, gs: int, bits: int, dtype=mx.bfloat16, seed: int = 0):
    key = mx.random.key(seed)
    w = (mx.random.normal((N, K), key=key) * K ** -0.5).astype(dtype)
    q, s, b = mx.quantize(w, group_size=gs, bits=bits)
    mx.eval(q, s, b)
    return q, s, b


def kernel(x, q, s, b, gs, bits, **launch):
    return invariant.invariant_quantized_matmul(x, q, s, b, gs, bits, **launch)


def mlx_qmm(x, q, s, b, gs, bits):
    return mx.quantized_matmul(x, q, s, b, transpose=True, group_size=gs, bits=bits)


def cpu_reference(x, q, s, b, gs, bits) -> tuple[mx.array, mx.array]:
    """The exact float32 product (and sum_k |x w|, the scale of float32 order error), on the
    default device: on a GPU in plain elementwise ops and a reduction (invariant_quant's
    reference: no matmul unit, so no TF32), which takes seconds where the CPU took minutes a
    27B shape; the magnitude, only a bound's scale, through a matmul."""
    ref = invariant_quant.reference_quantized_matmul(x.astype(mx.float32), q, s, b, gs, bits)
    wf = mx.dequantize(q, s.astype(mx.float32), b.astype(mx.float32), group_size=gs, bits=bits)
    mag = mx.abs(x.astype(mx.float32)) @ mx.abs(wf).T
    mx.eval(ref, mag)
    return ref, mag


@section("env")
def env() -> dict:
    from gpu_bench import copy_bandwidth

    info = {"backend": invariant.backend() or "cpu (reference ops only: this run checks the script, not a kernel)",
            "mlx": mx.__version__, "device": str(mx.default_device()), "python": platform.python_version(),
            "host": platform.node()}
    try:
        info["device_info"] = {k: v for k, v in mx.device_info().items()} if hasattr(mx, "device_info") else None
    except Exception as exc:  # noqa: BLE001
        info["device_info"] = f"unavailable: {exc}"
    bw = copy_bandwidth(gib=2.0 if invariant.backend() else 0.25)
    info["copy_bandwidth"] = bw
    log(f"backend {info['backend']}, mlx {mx.__version__}, copy bandwidth {bw['bytes_per_s'] / 1e12:.2f} TB/s")
    return info


@section("compile")
def compile_all() -> dict:
    out = {}
    for bits in (4, 8):
        for gs in (32, 64, 128):
            for dname, dt in DTYPES.items():
                key = f"b{bits}_g{gs}_{dname}"
                try:
                    q, s, b = quantized(64, 256, gs, bits, dtype=dt)
                    x = mx.random.normal((2, 256)).astype(dt)
                    y = kernel(x, q, s, b, gs, bits)
                    mx.eval(y)
                    ref, _ = cpu_reference(x, q, s, b, gs, bits)
                    err = mx.abs(y.astype(mx.float32) - ref).max().item()
                    out[key] = {"ok": True, "max_abs_err": err}
                except Exception as exc:  # noqa: BLE001
                    report_error(f"compile {key}", exc)
                    out[key] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    n_ok = sum(v["ok"] for v in out.values())
    log(f"compiled and ran {n_ok}/{len(out)} variants")
    return out


def check_shape(N: int, K: int, gs: int, bits: int, dtype, ms=MS, launch=None) -> dict:
    launch = launch or {}
    q, s, b = quantized(N, K, gs, bits, dtype=dtype, seed=N + K)
    Mmax = max(ms)
    x = mx.random.normal((Mmax, K), key=mx.random.key(K)).astype(dtype)
    mx.eval(x)
    ref, mag = cpu_reference(x, q, s, b, gs, bits)
    rel_out = 2.0 ** -20 if dtype == mx.float32 else (2.0 ** -8 if dtype == mx.bfloat16 else 2.0 ** -11)
    rows = {}
    ok = True
    for M in ms:
        y = kernel(x[:M], q, s, b, gs, bits, **launch).astype(mx.float32)
        m = mlx_qmm(x[:M], q, s, b, gs, bits).astype(mx.float32)
        mx.eval(y, m)
        r, g = ref[:M], mag[:M]
        bound = rel_out * mx.abs(r) + 1e-5 * g + 1e-30
        ratio = (mx.abs(y - r) / bound).max().item()
        rows[M] = {"max_err_over_bound": ratio, "max_abs_err": mx.abs(y - r).max().item(),
                   "mlx_qmm_max_abs_err": mx.abs(m - r).max().item(), "ok": ratio <= 1.0}
        ok = ok and ratio <= 1.0
    return {"ok": ok, "by_M": rows}


@section("correctness")
def correctness(quick: bool) -> dict:
    shapes = [big(17408, 5120), big(5120, 17408), (1001, 384), (96, 512)]
    if quick:
        shapes = [big(17408, 5120), (1001, 384)]
    out, bad = {}, []
    for bits in (4, 8):
        for gs in (32, 64, 128):
            for N, K in shapes:
                key = f"b{bits}_g{gs}_{N}x{K}_bf16"
                res = check_shape(N, K, gs, bits, mx.bfloat16, ms=MS + (3, 9, 17, 33))
                out[key] = res
                worst = max(v["max_err_over_bound"] for v in res["by_M"].values())
                log(f"{key}: {'ok' if res['ok'] else 'FAILED'} (worst err/bound {worst:.3g})")
                if not res["ok"]:
                    bad.append(key)
    for dname in ("float16", "float32"):
        N, K = big(5120, 17408)
        key = f"b4_g64_{N}x{K}_{dname}"
        res = check_shape(N, K, 64, 4, DTYPES[dname])
        out[key] = res
        log(f"{key}: {'ok' if res['ok'] else 'FAILED'}")
        if not res["ok"]:
            bad.append(key)
    out["failed"] = bad
    return out


def invariance_of(fn, K: int, dtype=mx.bfloat16, Mmax: int = 33) -> dict:
    x = mx.random.normal((Mmax, K), key=mx.random.key(7)).astype(dtype)
    full = fn(x)
    mx.eval(full)
    differs = []
    for M in range(1, Mmax):
        y = fn(x[:M])
        mx.eval(y)
        if not mx.array_equal(y, full[:M]).item():
            rows = [r for r in range(M) if not mx.array_equal(y[r], full[r]).item()]
            differs.append({"M": M, "rows": rows[:8]})
    # the model's layout: [B, T, K] with B * T rows
    bt = fn(x[:16].reshape(2, 8, K))
    mx.eval(bt)
    same_bt = mx.array_equal(bt.reshape(16, -1), full[:16]).item()
    return {"invariant": not differs and same_bt, "row0_bits_equal_all_M": not any(0 in d["rows"] for d in differs),
            "differs": differs[:10], "bt_layout_equal": same_bt}


@section("invariance")
def invariance(quick: bool) -> dict:
    out = {}
    shapes = [big(17408, 5120), big(5120, 17408), (1001, 384)]
    for bits in (4, 8):
        for gs in ((64,) if quick else (32, 64, 128)):
            for N, K in shapes:
                q, s, b = quantized(N, K, gs, bits, seed=N)
                key = f"b{bits}_g{gs}_{N}x{K}"
                kres = invariance_of(lambda x: kernel(x, q, s, b, gs, bits), K)
                mres = invariance_of(lambda x: mlx_qmm(x, q, s, b, gs, bits), K)
                out[key] = {"kernel": kres, "mlx_quantized_matmul": mres}
                log(f"{key}: kernel invariant {kres['invariant']}, mlx quantized_matmul invariant {mres['invariant']}"
                    + (f" (differs at M {[d['M'] for d in mres['differs']]})" if mres["differs"] else ""))
    out["kernel_all_invariant"] = all(v["kernel"]["invariant"] for v in out.values() if isinstance(v, dict))
    return out


def bound_s(N: int, K: int, M: int, bits: int, gs: int, bw: float, act_bytes: int = 2) -> float:
    wbytes = N * K * bits // 8 + 2 * (N * K // gs) * 2  # packed weights + bf16 scales and biases
    return (wbytes + M * K * act_bytes + M * N * act_bytes) / bw


def bandwidth() -> float:
    env_ = RESULTS.get("env") or {}
    return (env_.get("copy_bandwidth") or {}).get("bytes_per_s") or 4.8e12


LAUNCHES = ([dict(cols_per_warp=c, warps_per_block=w, row_tile=8) for c in (1, 2, 4, 8) for w in (2, 4, 8)]
            + [dict(cols_per_warp=4, warps_per_block=4, row_tile=t) for t in (4, 16)]
            + [dict(cols_per_warp=2, warps_per_block=4, row_tile=16)])


@section("sweep")
def sweep(quick: bool) -> dict:
    bw = bandwidth()
    launches = LAUNCHES[:4] + LAUNCHES[-3:] if quick else LAUNCHES
    out = {"rows": []}
    shapes = [big(17408, 5120), big(5120, 17408)]
    data = {(N, K): quantized(N, K, 64, 4, seed=N) for N, K in shapes}
    for launch in launches:
        name = "c{cols_per_warp}_w{warps_per_block}_t{row_tile}".format(**launch)
        try:
            q, s, b = data[shapes[0]]
            inv = invariance_of(lambda x: kernel(x, q, s, b, 64, 4, **launch), shapes[0][1], Mmax=17)
            row = {"launch": name, "invariant": inv["invariant"], "times_us": {}, "bound_frac": {}}
            for N, K in shapes:
                q, s, b = data[(N, K)]
                for M in (1, 8, 32):
                    x = mx.random.normal((M, K)).astype(mx.bfloat16)
                    t = timed(lambda: kernel(x, q, s, b, 64, 4, **launch))["batched_s"]
                    row["times_us"][f"{N}x{K}_M{M}"] = t * 1e6
                    row["bound_frac"][f"{N}x{K}_M{M}"] = bound_s(N, K, M, 4, 64, bw) / t
            out["rows"].append(row)
            log(f"{name}: invariant {row['invariant']}, "
                + ", ".join(f"{k} {v:.1f}us" for k, v in row["times_us"].items()))
        except Exception as exc:  # noqa: BLE001
            report_error(f"sweep {name}", exc)
    good = [r for r in out["rows"] if r["invariant"]]
    if good:
        best = min(good, key=lambda r: sum(v for k, v in r["times_us"].items() if k.endswith("_M1"))
                   + 0.5 * sum(v for k, v in r["times_us"].items() if k.endswith("_M8")))
        out["best"] = best["launch"]
        log(f"best launch shape (M=1, then M=8): {best['launch']}")
    return out


def launch_of(name: str) -> dict:
    c, w, t = name.split("_")
    return dict(cols_per_warp=int(c[1:]), warps_per_block=int(w[1:]), row_tile=int(t[1:]))


@section("timing")
def timing(quick: bool) -> dict:
    bw = bandwidth()
    best = (RESULTS.get("sweep") or {}).get("best")
    variants = {"kernel": {}}
    if best and launch_of(best) != dict(cols_per_warp=invariant_quant.COLS_PER_WARP,
                                        warps_per_block=invariant_quant.WARPS_PER_BLOCK,
                                        row_tile=invariant_quant.ROW_TILE):
        variants[f"kernel_{best}"] = launch_of(best)
    rows = []
    shapes = dict(list(SHAPES_27B.items())[:3]) if quick else SHAPES_27B
    for bits in ((4,) if quick else (4, 8)):
        for name, (N, K, count) in shapes.items():
            N, K = big(N, K)
            q, s, b = quantized(N, K, 64, bits, seed=N)
            for M in MS:
                x = mx.random.normal((M, K)).astype(mx.bfloat16)
                mx.eval(x)
                row = {"bits": bits, "shape": name, "N": N, "K": K, "M": M, "count_in_27b": count,
                       "bound_us": bound_s(N, K, M, bits, 64, bw) * 1e6,
                       "bound_4.8TBps_us": bound_s(N, K, M, bits, 64, 4.8e12) * 1e6}
                row["mlx_us"] = timed(lambda: mlx_qmm(x, q, s, b, 64, bits))["batched_s"] * 1e6
                for vname, launch in variants.items():
                    try:
                        row[f"{vname}_us"] = timed(lambda: kernel(x, q, s, b, 64, bits, **launch))["batched_s"] * 1e6
                    except Exception as exc:  # noqa: BLE001
                        report_error(f"timing {vname} {name} M={M}", exc)
                        row[f"{vname}_us"] = None
                k = row.get("kernel_us")
                row["kernel_over_mlx"] = k / row["mlx_us"] if k else None
                row["kernel_bound_frac"] = row["bound_us"] / k if k else None
                rows.append(row)
            log(f"{bits}-bit {name}: " + ", ".join(
                f"M{r['M']} {r.get('kernel_us') or float('nan'):.1f}/{r['mlx_us']:.1f}us"
                for r in rows if r["shape"] == name and r["bits"] == bits) + " (kernel/mlx)")
            del q, s, b
            mx.clear_cache()
    # a whole 27B step's matmuls at each M (count-weighted), kernel vs MLX vs bound
    totals = {}
    for bits in {r["bits"] for r in rows}:
        for M in MS:
            sel = [r for r in rows if r["bits"] == bits and r["M"] == M]
            if not sel or any(r.get("kernel_us") is None for r in sel) or quick:
                continue
            totals[f"{bits}bit_M{M}"] = {key: sum(r[key] * r["count_in_27b"] for r in sel) / 1e3
                                        for key in ("kernel_us", "mlx_us", "bound_us")}
    return {"rows": rows, "variants": list(variants), "per_step_ms": totals}


def print_tables() -> None:
    t = RESULTS.get("timing")
    if t:
        print("\n| bits | shape | M | kernel us | mlx us | kernel/mlx | bound us | kernel at bound |")
        print("|---|---|---|---|---|---|---|---|")
        for r in t["rows"]:
            k = r.get("kernel_us")
            ratio = "-" if not k else "%.2fx" % (k / r["mlx_us"])
            frac = "-" if not k else "%.0f%%" % (100 * r["bound_us"] / k)
            kus = "-" if not k else "%.1f" % k
            print(f"| {r['bits']} | {r['shape']} | {r['M']} | {kus} | {r['mlx_us']:.1f} | {ratio} | "
                  f"{r['bound_us']:.1f} | {frac} |")
        if t["per_step_ms"]:
            print("\n27B step's matmuls (count-weighted), ms: | bits, M | kernel | mlx | bound |")
            for key, v in t["per_step_ms"].items():
                print(f"| {key} | {v['kernel_us']:.2f} | {v['mlx_us']:.2f} | {v['bound_us']:.2f} |")
    p = RESULTS.get("parts")
    if p:
        for kernels, table in p.items():
            if not isinstance(table, list):
                continue
            print(f"\nparts ({kernels}), ms: | B | T | forward (mlx-lm) | forward (daemon verify) | graph build | "
                  "gdn layer | gdn matmuls | attn layer | attn matmuls | sdpa | lm_head | 64-layer est |")
            for r in table:
                print("| " + " | ".join(str(r.get(k)) for k in (
                    "B", "T", "forward_ms", "daemon_verify_ms", "graph_build_ms", "gdn_layer_ms", "gdn_matmuls_ms",
                    "attn_layer_ms", "attn_matmuls_ms", "sdpa_ms", "lm_head_ms", "est_64_layers_ms")) + " |")


def _ms(fn, reps=5, trials=5) -> float:
    if invariant.backend() is None:  # the CPU only checks the script
        reps, trials = 1, 1
    return round(timed(fn, reps=reps, trials=trials)["batched_s"] * 1e3, 3)


def parts_table(lm, text_cfg: dict, context: int, label: str) -> list:
    from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
    from mlx_lm.models.cache import ArraysCache

    from daemon.engine.model.capture import capture_hidden
    from daemon.engine.caches.ragged_cache import RaggedKVCache

    text = lm.text_module
    layers = text.model.layers
    gdn_i = next(i for i, l in enumerate(layers) if l.is_linear)
    att_i = next(i for i, l in enumerate(layers) if not l.is_linear)
    n_layers = text_cfg["num_hidden_layers"]
    V, D = text_cfg["vocab_size"], text_cfg["hidden_size"]
    rows = []
    for B in (1, 4, 8):
        # mlx-lm's batched cache, prefilled to `context`
        cache = lm.make_cache()
        prompt = mx.random.randint(0, V, (B, context)).astype(mx.uint32)
        mx.eval(lm.hidden(prompt, cache))
        mx.eval([c.state for c in cache])
        # the daemon's: per-row prefills of ragged lengths, merged (as exactness.ragged_verify_matches_serial)
        per_row = []
        for r in range(B):
            c = lm.make_cache()
            mx.eval(lm.hidden(prompt[r:r + 1, : context - 5 * r], c))
            mx.eval([x.state for x in c])
            per_row.append(c)
        merged = []
        for layer_caches in zip(*per_row):
            if isinstance(layer_caches[0], ArraysCache):
                m = ArraysCache.merge(list(layer_caches))
                m.left_padding = None
            else:
                m = RaggedKVCache.merge(list(layer_caches))
            merged.append(m)
        for T in (1, 2, 3, 4):
            row: dict = {"kernels": label, "B": B, "T": T, "context": context}
            tok = mx.random.randint(0, V, (B, T)).astype(mx.uint32)
            row["forward_ms"] = _ms(lambda: lm.logits(lm.hidden(tok, cache)))
            try:
                row["daemon_verify_ms"] = _ms(lambda: lm.logits(capture_hidden(lm, tok, merged, [])))
            except Exception as exc:  # noqa: BLE001
                report_error(f"parts daemon verify B={B} T={T}", exc)
            t = time.perf_counter()
            for _ in range(5):
                lm.logits(lm.hidden(tok, cache))  # built, never evaluated
            row["graph_build_ms"] = round((time.perf_counter() - t) / 5 * 1e3, 3)
            mx.eval([c.state for c in cache])
            x = (mx.random.normal((B, T, D)) * 0.1).astype(mx.bfloat16)
            mx.eval(x)
            g = layers[gdn_i]
            mask_att = create_attention_mask(x, cache[att_i])
            row["gdn_layer_ms"] = _ms(lambda: g(x, mask=None, cache=cache[gdn_i]))
            gl = [g.linear_attn.in_proj_qkv, g.linear_attn.in_proj_z, g.linear_attn.in_proj_b,
                  g.linear_attn.in_proj_a, g.mlp.gate_proj, g.mlp.up_proj]
            xv = mx.random.normal((B, T, g.linear_attn.value_dim)).astype(mx.bfloat16)
            xi = mx.random.normal((B, T, text_cfg["intermediate_size"])).astype(mx.bfloat16)
            row["gdn_matmuls_ms"] = _ms(lambda: [m(x) for m in gl] + [g.linear_attn.out_proj(xv), g.mlp.down_proj(xi)])
            a = layers[att_i]
            row["attn_layer_ms"] = _ms(lambda: a(x, mask=mask_att, cache=cache[att_i]))
            sa = a.self_attn
            xo = mx.random.normal((B, T, text_cfg["num_attention_heads"] * text_cfg["head_dim"])).astype(mx.bfloat16)
            al = [sa.q_proj, sa.k_proj, sa.v_proj, a.mlp.gate_proj, a.mlp.up_proj]
            row["attn_matmuls_ms"] = _ms(lambda: [m(x) for m in al] + [sa.o_proj(xo), a.mlp.down_proj(xi)])
            Hq, Hk, hd = text_cfg["num_attention_heads"], text_cfg["num_key_value_heads"], text_cfg["head_dim"]
            L = cache[att_i].offset
            q = mx.random.normal((B, Hq, T, hd)).astype(mx.bfloat16)
            k = mx.random.normal((B, Hk, L, hd)).astype(mx.bfloat16)
            v = mx.random.normal((B, Hk, L, hd)).astype(mx.bfloat16)
            row["sdpa_ms"] = _ms(lambda: scaled_dot_product_attention(q, k, v, cache=None, scale=hd ** -0.5,
                                                                       mask="causal" if T > 1 else None))
            if hasattr(invariant, "invariant_sdpa") and label != "mlx":
                row["sdpa_invariant_ms"] = _ms(lambda: invariant.invariant_sdpa(q, k, v, hd ** -0.5,
                                                                                "causal" if T > 1 else None))
            row["lm_head_ms"] = _ms(lambda: lm.logits(x))
            n_att = n_layers // text_cfg["full_attention_interval"]
            per64 = 48 * row["gdn_layer_ms"] + 16 * row["attn_layer_ms"] + row["lm_head_ms"]
            row["est_64_layers_ms"] = round(per64, 3)
            row["est_stack_ms"] = round((n_layers - n_att) * row["gdn_layer_ms"] + n_att * row["attn_layer_ms"]
                                        + row["lm_head_ms"], 3)
            rows.append(row)
            log(f"parts {label} B={B} T={T}: " + ", ".join(f"{k} {v}" for k, v in row.items()
                                                           if k.endswith("_ms")))
        del cache, merged, per_row
        mx.clear_cache()
    return rows


@section("parts")
def parts(layers: int, context: int, shape: str) -> dict:
    from gpu_bench import QWEN35_27B, TINY, build_model, quantize_4bit

    base = QWEN35_27B if shape == "27b" else TINY
    cfg = dict(base, num_hidden_layers=layers)
    lm, head, _ = build_model(cfg)
    quantize_4bit(lm, head)
    del head
    mx.clear_cache()
    out: dict = {"layers": layers, "context": context, "shape": shape}
    out["mlx"] = parts_table(lm, cfg, context, "mlx")
    save()
    try:
        n = invariant.install(lm.text_module, max_rows=64)
        out["installed_modules"] = n
        out["refused"] = dict(invariant.REFUSED)
        out["invariant"] = parts_table(lm, cfg, context, "invariant")
    except Exception as exc:  # noqa: BLE001
        report_error("parts invariant", exc)
    finally:
        invariant.uninstall(lm.text_module)
    return out


def main(argv=None) -> int:
    global OUT
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--quick", action="store_true", help="fewer shapes and launch shapes")
    ap.add_argument("--parts", action="store_true", help="also time a batched verify's parts (section 7)")
    ap.add_argument("--parts-only", action="store_true")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--shape", choices=["27b", "tiny"], default="27b", help="parts: the model's shape")
    args = ap.parse_args(argv)
    OUT = args.out
    env()
    if not args.parts_only:
        compile_all()
        correctness(args.quick)
        invariance(args.quick)
        sweep(args.quick)
        timing(args.quick)
    if args.parts or args.parts_only:
        parts(args.layers, args.context, args.shape)
    print_tables()
    ok = not RESULTS["errors"] and not (RESULTS.get("correctness") or {}).get("failed") and \
        (RESULTS.get("invariance") or {}).get("kernel_all_invariant", args.parts_only)
    RESULTS["verdict"] = "ok" if ok else "see errors / failed checks"
    save()
    log(f"verdict: {RESULTS['verdict']}; wrote {OUT / 'quant_kernel_check.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
