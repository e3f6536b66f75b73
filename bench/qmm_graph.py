"""Where a 27B-shaped 4-bit step's time goes on CUDA: the quantized matmul's device time apart
from the host's, by launch, and a forward's graph building apart from its evaluation.

    PYTHONPATH=/tmp/site:$PWD python3 bench/qmm_graph.py --mode matmul --json $OUT/matmul.json
    PYTHONPATH=/tmp/site:$PWD python3 bench/qmm_graph.py --mode forward --layers 16 --json $OUT/forward.json
    PYTHONPATH=/tmp/site:$PWD python3 bench/qmm_graph.py --mode host --json $OUT/host.json
    nsys profile -o $OUT/p python3 bench/qmm_graph.py --mode probe --json $OUT/plan.json   (then bench/qmm_probe_read.py)

``--mode matmul``: per 27B linear shape and M = 1..32, L distinct weight copies (so no copy is
served from the 50 MB L2) multiplied by the same x, all L evaluated at once; the time per matmul
is the total over L. MLX builds a CUDA graph of up to ``MLX_MAX_OPS_PER_BUFFER`` ops before it
launches one, so run it with ``MLX_MAX_OPS_PER_BUFFER=1`` to let the host encode op i + 1 while
the device runs op i: the time per matmul is then the device's wherever the device is slower than
the host (the host's time alone is reported beside it: the same calls on a 16-column weight).
Arms: MLX's ``quantized_matmul`` and engine/kernels/quant_mma.py's kernel at splits S (the default and
twice it) x column tiles per warp NA (1, 2, 4), U from its table, and at each split the
shared-memory feed with P = 2 and 4 stages. First, the kernel's launches
are checked against each other (NA and U change nothing: the same bits) and against MLX's.
Weights are random bits with random scales and biases (no quantize on a fresh device: MLX's
kernels compile on first use).

``--mode check``: that check alone (the launches' bits against each other, and against MLX's).

``--mode forward``: a 27B-shaped 4-bit stack of ``--layers`` layers (3 GatedDeltaNet : 1
attention, the real lm_head), a 256-token cache; per B x T, the Python graph building and the
evaluation of one forward timed apart, arms "mlx" and "qmm" (the quantized linears on the
kernel) alternated. Run it under different MLX_MAX_OPS_PER_BUFFER / MLX_USE_CUDA_GRAPHS
settings in separate processes to see what the host's graph encoding costs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import mlx.core as mx  # noqa: E402

from daemon.engine.kernels import invariant, quant_mma  # noqa: E402

T0 = time.perf_counter()
SHAPES = {  # name: (N, K), the 27B's linears that carry most of its bytes, and its lm_head
    "mlp.gate/up 5120->17408": (17408, 5120),
    "mlp.down 17408->5120": (5120, 17408),
    "attn.q_proj 5120->12288": (12288, 5120),
    "gdn.out_proj 6144->5120": (5120, 6144),
    "lm_head 5120->248320": (248320, 5120),
    # as the daemon's step runs them: each group of projections of one input merged into one
    # matmul (engine/kernels/merged_linears.py): 64 of the first a step, 48 of the second, 16 of the third
    "mlp.gate+up merged 5120->34816": (34816, 5120),
    "gdn.in_proj merged 5120->16480": (16480, 5120),
    "attn.qkv merged 5120->14336": (14336, 5120),
    # the down projection's K at 264 and 396 column tiles (2 and 3 blocks on each of 132 SMs),
    # beside its own 320 (2.42): does the time follow the bytes or the fullest SM's blocks?
    "balance.264 17408->4224": (4224, 17408),
    "balance.396 17408->6336": (6336, 17408),
}
MS = (1, 2, 4, 8, 16, 32)
GS = 64


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def env_settings() -> dict:
    return {k: os.environ.get(k) for k in ("MLX_MAX_OPS_PER_BUFFER", "MLX_MAX_MB_PER_BUFFER", "MLX_USE_CUDA_GRAPHS",
                                            "MLX_CUDA_USE_CUDNN_SDPA")}


def random_quantized(N: int, K: int, bits: int, key: int):
    k1, k2, k3 = mx.random.split(mx.random.key(key), 3)
    q = mx.random.randint(-2 ** 31, 2 ** 31 - 1, (N, K * bits // 32), dtype=mx.int32, key=k1).view(mx.uint32)
    s = (mx.random.uniform(0.5, 1.5, (N, K // GS), key=k2) * (2.0 / (2 ** bits) * K ** -0.5)).astype(mx.bfloat16)
    b = (mx.random.uniform(-1.0, 1.0, (N, K // GS), key=k3) * K ** -0.5).astype(mx.bfloat16)
    return q, s, b


def bytes_read(N: int, K: int, M: int, bits: int) -> int:
    return N * K * bits // 8 + 2 * N * (K // GS) * 2 + M * K * 2 + M * N * 2


def per_call(fn, x, weights, trials: int = 5) -> dict:
    """Seconds per matmul: all of ``weights`` evaluated together, synced; and the host's part
    (building the list) alone."""
    mx.eval([fn(x, *w) for w in weights])
    mx.synchronize()
    total, build = [], []
    for _ in range(trials):
        mx.synchronize()
        t = time.perf_counter()
        outs = [fn(x, *w) for w in weights]
        tb = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        total.append((time.perf_counter() - t) / len(weights))
        build.append((tb - t) / len(weights))
        del outs
    return {"s": statistics.median(total), "spread": [min(total), max(total)], "build_s": statistics.median(build)}


def mlx_arm(x, q, s, b, bits=4):
    return mx.quantized_matmul(x, q, s, b, transpose=True, group_size=GS, bits=bits)


def kernel_arm(S: int, NA: int | None, bits: int = 4, P: int | None = None):
    return lambda x, q, s, b: quant_mma.quantized_matmul_mma(x, q, s, b, GS, bits, split=S, columns=NA, stages=P)


def splits_for(N: int, K: int, bits: int) -> list[int]:
    d = quant_mma.default_split(N, K, bits)
    chunks = K // quant_mma.chunk_inputs(bits)
    return [S for S in dict.fromkeys((d, 2 * d)) if S <= 16 and chunks >= S]


def rel_err(y, ref) -> float:
    d = y.astype(mx.float32) - ref.astype(mx.float32)
    return (mx.sqrt((d * d).sum()) / mx.sqrt((ref.astype(mx.float32) ** 2).sum())).item()


def load_kernel_module(path: str):
    """Another version of engine/kernels/quant_mma.py (``git show REV:daemon/engine/kernels/quant_mma.py
    > FILE``) as a module of its own: its kernel's name carries its source's hash, so both
    versions live in one process, for a check that an edit kept the bits and a speed A/B."""
    spec = importlib.util.spec_from_file_location("councild_quant_mma_other", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if mod._NAME == quant_mma._NAME:
        raise SystemExit(f"{path}: the same kernel source as the tree's")
    return mod


def old_module(args):
    """``--old-source``'s module, or None."""
    return load_kernel_module(args.old_source) if args.old_source else None


CHECK_MS = (1, 16, 17, 32, 40)  # row tiles 1-5, whole and partial


def check_launches(bits: int, old=None, ms: tuple[int, ...] = CHECK_MS) -> dict:
    """NA, U and P change only the speed: every launch gives the NA = 1 launch's bits, at every M,
    the register feed (P = 0) included, and the residual variant those bits plus a residual as
    MLX's Add gives them; with ``old`` (``load_kernel_module``), that version's
    default launch too. Compiling every variant on a fresh machine takes over 90 s: give it 200."""
    out = {}
    for name in ("mlp.gate/up 5120->17408", "mlp.down 17408->5120"):
        N, K = SHAPES[name]
        q, s, b = random_quantized(N, K, bits, key=N)
        x = mx.random.normal((max(ms), K), key=mx.random.key(3)).astype(mx.bfloat16)
        st, bt = quant_mma.tile_pairs(s), quant_mma.tile_pairs(b)
        S = quant_mma.default_split(N, K, bits)
        rows = {}
        for M in ms:
            base = quant_mma.quantized_matmul_mma(x[:M], q, s, b, GS, bits, split=S, columns=1, unroll=1)
            launches = [{"columns": na, "unroll": u} for na in (1, 2, 4) for u in (1, 2)]
            launches += [{"stages": p} for p in (0, 2, 4)] + [{"stages": 2, "columns": 1}]
            launches += [{"stages": 2, "prefetch": 1, "columns": na} for na in (1, 2)] + [{"stages": 2, "prefetch": 0}]
            same = all(mx.array_equal(quant_mma.quantized_matmul_mma(x[:M], q, s, b, GS, bits, split=S, **kw),
                                      base).item() for kw in launches)
            # the residual variant: the bits of the add apart (MLX's Add), at the default launch and
            # at the register feed
            res = mx.random.normal((M, N), key=mx.random.key(M)).astype(mx.bfloat16)
            plus = res + base
            res_same = all(mx.array_equal(quant_mma.quantized_matmul_mma(x[:M], q, s, b, GS, bits, split=S, residual=res,
                                                                         **kw), plus).item() for kw in ({}, {"stages": 0}))
            # scales and biases tiled (quant_mma.tile_pairs): the same values from other addresses
            tiled_same = all(mx.array_equal(quant_mma.quantized_matmul_mma(x[:M], q, st, bt, GS, bits, split=S, tiled=True,
                                                                           **kw), base).item()
                             for kw in ({}, {"stages": 0}, {"columns": 2}, {"prefetch": 1, "stages": 2}))
            rows[M] = r = {"launches_equal": same, "residual_equal": res_same, "tiled_equal": tiled_same,
                           "rel_err_vs_mlx": rel_err(base, mlx_arm(x[:M], q, s, b, bits))}
            if old is not None:
                r["same_as_old"] = mx.array_equal(old.quantized_matmul_mma(x[:M], q, s, b, GS, bits), base).item()
            # one line a row count: a check cut by its time limit still shows what it saw
            log(f"check b{bits} {name} M{M}: {'same' if same else 'DIFFER'}, residual {'same' if res_same else 'DIFFERS'}, "
                f"tiled {'same' if tiled_same else 'DIFFERS'}, "
                f"{r['rel_err_vs_mlx']:.1e} from MLX's"
                + ("" if old is None else f"; {'the same bits as' if r['same_as_old'] else 'DIFFERS from'} the old kernel"))
        out[f"b{bits} {name}"] = rows
    out["ok"] = all(r["launches_equal"] and r["residual_equal"] and r["tiled_equal"] and r["rel_err_vs_mlx"] < 2e-2
                    and r.get("same_as_old", True)
                    for v in out.values() for r in v.values())
    return out


def matmul_mode(args) -> dict:
    bits = args.bits
    res: dict = {"mode": "matmul", "bits": bits, "env": env_settings(), "mlx": mx.__version__,
                 "kernel": quant_mma._NAME, "rows": []}
    res["check"] = check_launches(bits)
    save(args, res)
    tiny = random_quantized(16, 5120, bits, key=1)
    for name, (N, K) in SHAPES.items():
        if args.shapes and not any(s in name for s in args.shapes.split(",")):
            continue
        per = N * K * bits // 8
        L = max(2, min(16, int(args.gbytes * 1e9 // per)))
        weights = [random_quantized(N, K, bits, key=N + i) for i in range(L)]
        mx.eval(weights)
        arms = {"mlx": lambda x, q, s, b: mlx_arm(x, q, s, b, bits)}
        for S in splits_for(N, K, bits):
            for NA in (1, 2, 4):
                if (N // 16) % NA == 0:
                    arms[f"S{S} NA{NA}"] = kernel_arm(S, NA, bits)
            for P in (2, 4):
                arms[f"S{S} P{P}"] = kernel_arm(S, None, bits, P)
        for M in MS:
            x = mx.random.normal((M, K), key=mx.random.key(M)).astype(mx.bfloat16)
            xt = mx.random.normal((M, 5120), key=mx.random.key(M)).astype(mx.bfloat16)
            mx.eval(x, xt)
            bound = bytes_read(N, K, M, bits) / args.bandwidth
            row = {"shape": name, "N": N, "K": K, "M": M, "L": L, "bound_us": bound * 1e6, "arms": {}}
            for arm, fn in arms.items():
                t = per_call(fn, x, weights)
                host = per_call(fn, xt, [tiny] * L) if arm in ("mlx", f"S{splits_for(N, K, bits)[0]} NA1") else None
                row["arms"][arm] = {"us": t["s"] * 1e6, "spread_us": [v * 1e6 for v in t["spread"]],
                                    "build_us": t["build_s"] * 1e6, "bound_frac": bound / t["s"],
                                    **({"host_floor_us": host["s"] * 1e6} if host else {})}
            res["rows"].append(row)
            best = min((a for a in row["arms"] if a != "mlx"), key=lambda a: row["arms"][a]["us"])
            log(f"{name} M{M}: mlx {row['arms']['mlx']['us']:.1f} us, best {best} {row['arms'][best]['us']:.1f} us "
                f"(bound {bound * 1e6:.1f}; " + ", ".join(f"{a} {v['us']:.0f}" for a, v in row["arms"].items()) + ")")
            save(args, res)
        del weights
        mx.clear_cache()
    res["summary"] = summarize(res["rows"])
    return res


def summarize(rows: list[dict]) -> dict:
    """Per shape: the split whose summed time over M is least (S is fixed per shape: it is part
    of the summation order), then the best NA per M at that split; the issue's ratios."""
    out = {}
    for name in dict.fromkeys(r["shape"] for r in rows):
        sel = [r for r in rows if r["shape"] == name]
        splits = sorted({int(a.split()[0][1:]) for r in sel for a in r["arms"] if a != "mlx"})

        def best_at(r, S):
            cands = {a: v["us"] for a, v in r["arms"].items() if a.startswith(f"S{S} ")}
            a = min(cands, key=cands.get)
            return a, cands[a]

        S = min(splits, key=lambda S: sum(best_at(r, S)[1] for r in sel))
        by_m = {r["M"]: (best_at(r, S), r["arms"]["mlx"]["us"], r["bound_us"]) for r in sel}
        m1 = by_m[1][0][1]
        out[name] = {"split": S, "per_M": {m: {"arm": a, "us": us, "mlx_us": mlx, "bound_us": bd}
                                           for m, ((a, us), mlx, bd) in by_m.items()},
                     "m1_bound_frac": by_m[1][2] / m1,
                     "m16_over_m1": by_m[16][0][1] / m1 if 16 in by_m else None,
                     "m32_over_m1": by_m[32][0][1] / m1 if 32 in by_m else None}
    return out


def launch_of(text: str) -> tuple[int, int, int, int | None, int | None]:
    """"S:U:NA", "S:U:NA:P" or "S:U:NA:P:X" (0 for any of S, U, NA: the kernel's table; P or X
    absent: the table's, P = 0: the register feed; X = 0 / 1: the activations' prefetch off / on)."""
    v = [int(x) for x in text.split(":")]
    if len(v) not in (3, 4, 5):
        raise SystemExit(f"--launches: {text!r} is not S:U:NA, S:U:NA:P or S:U:NA:P:X")
    return v[0], v[1], v[2], (v[3] if len(v) >= 4 else None), (v[4] if len(v) == 5 else None)


def launch_name(S: int, U: int, NA: int, P: int | None = None, X: int | None = None) -> str:
    return f"S{S} U{U} NA{NA}" + ("" if P is None else f" P{P}") + ("" if X is None else f" X{X}")


_MARKER: list = []


def marker() -> None:
    """A kernel of its own name between measured groups, so a profiler's list of launches (in
    launch order) splits into the groups ``probe_mode`` records."""
    if not _MARKER:
        _MARKER.append(mx.fast.cuda_kernel(name="councild_probe_marker", input_names=["a"], output_names=["o"],
                                           source="o[0] = a[0];"))
    a = mx.zeros((1,), dtype=mx.float32)
    (o,) = _MARKER[0](inputs=[a], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(1,)],
                      output_dtypes=[mx.float32])
    mx.eval(o)
    mx.synchronize()


def probe_mode(args) -> dict:
    """For a profiler (ncu, nsys): per shape, M and arm, a marker kernel then ``--reps`` calls,
    each evaluated and synced; the plan (the groups in launch order) goes to the JSON. With
    ``--old-source``, arm "old" (that version's default launch) after "kernel"."""
    old = old_module(args)
    plan = []
    for name, (N, K) in SHAPES.items():
        if args.shapes and not any(s in name for s in args.shapes.split(",")):
            continue
        q, s, b = random_quantized(N, K, args.bits, key=N)
        st, bt = quant_mma.tile_pairs(s), quant_mma.tile_pairs(b)
        mx.eval(q, s, b, st, bt)
        for M in ([int(m) for m in args.ms.split(",")] if args.ms else MS):
            x = mx.random.normal((M, K), key=mx.random.key(M)).astype(mx.bfloat16)
            mx.eval(x)
            arms = {"mlx": lambda x: mlx_arm(x, q, s, b, args.bits),
                    "kernel": lambda x: quant_mma.quantized_matmul_mma(x, q, s, b, GS, args.bits)}
            if old is not None:
                arms["old"] = lambda x: old.quantized_matmul_mma(x, q, s, b, GS, args.bits)
            if args.tiled:  # the scales and biases tiled (quant_mma.tile_pairs), in both versions
                arms["tiled"] = lambda x: quant_mma.quantized_matmul_mma(x, q, st, bt, GS, args.bits, tiled=True)
                if old is not None:
                    arms["old tiled"] = lambda x: old.quantized_matmul_mma(x, q, st, bt, GS, args.bits, tiled=True)
            same_tiled = None
            if args.tiled:  # before this group's first marker: its launches fall after the last group's calls
                same_tiled = mx.array_equal(arms["tiled"](x), arms["kernel"](x)).item()
                log(f"probe {name} M{M}: tiled {'the same bits' if same_tiled else 'DIFFERS'}")
            for launch in filter(None, args.launches.split(",")):
                S, U, NA, P, X = launch_of(launch)
                arms[launch_name(S, U, NA, P, X)] = (lambda S, U, NA, P, X: lambda x: quant_mma.quantized_matmul_mma(
                    x, q, s, b, GS, args.bits, split=S or None, unroll=U or None, columns=NA or None,
                    stages=P, prefetch=X))(S, U, NA, P, X)
            for arm, fn in arms.items():
                mx.eval(fn(x))  # compiles outside the group
                mx.synchronize()
                marker()
                for _ in range(args.reps):
                    mx.eval(fn(x))
                    mx.synchronize()
                plan.append({"shape": name, "N": N, "K": K, "M": M, "arm": arm, "reps": args.reps, "tiled_same": same_tiled,
                             "bound_us": bytes_read(N, K, M, args.bits) / args.bandwidth * 1e6})
        del q, s, b
    marker()
    log(f"probe: {len(plan)} groups")
    return {"mode": "probe", "plan": plan, "kernel": quant_mma._NAME}


def host_mode(args) -> dict:
    """The host's time per call on a 16-column weight (the device's part is ~nothing), arms
    alternated by round: MLX's quantized_matmul and the kernel through quantized_matmul_mma."""
    q, s, b = random_quantized(16, 5120, args.bits, key=1)
    x = mx.random.normal((1, 5120)).astype(mx.bfloat16)
    arms = {"mlx": lambda x, q, s, b: mlx_arm(x, q, s, b, args.bits),
            "kernel": lambda x, q, s, b: quant_mma.quantized_matmul_mma(x, q, s, b, GS, args.bits)}
    res: dict = {}
    for _ in range(args.rounds * 3):
        for arm, fn in arms.items():
            res.setdefault(arm, []).append(per_call(fn, x, [(q, s, b)] * 64)["s"] * 1e6)
    out = {arm: {"us": statistics.median(v), "spread": [min(v), max(v)]} for arm, v in res.items()}
    log("host per call: " + ", ".join(f"{a} {v['us']:.1f} us" for a, v in out.items()))
    return {"mode": "host", "env": env_settings(), "arms": out}


def forward_mode(args) -> dict:
    from gpu_bench import QWEN35_27B, build_model, quantize_4bit
    from mlx_lm.models.cache import make_prompt_cache

    res: dict = {"mode": "forward", "env": env_settings(), "layers": args.layers, "mlx": mx.__version__}
    cfg = dict(QWEN35_27B, num_hidden_layers=args.layers)
    t = time.perf_counter()
    lm, head, _ = build_model(cfg)
    quantize_4bit(lm, head)
    mx.clear_cache()
    log(f"{args.layers}-layer 27B-shaped 4-bit stack built in {time.perf_counter() - t:.0f}s")
    text = lm.text_module
    V = cfg["vocab_size"]
    shapes = [(1, 1), (4, 1), (8, 1), (4, 2)]
    samples: dict = {}
    for rnd in range(args.rounds):
        for B, T in shapes:
            for arm in ("mlx", "qmm"):
                invariant.uninstall(text)
                if arm == "qmm":
                    invariant.install(text, max_rows=72, quantized_only=True)
                cache = make_prompt_cache(text)
                mx.eval(text(mx.random.randint(0, V, (B, 256)), cache=cache))
                mx.eval(text(mx.random.randint(0, V, (B, T)), cache=cache))
                builds, evals = [], []
                for _ in range(8):
                    toks = mx.random.randint(0, V, (B, T))
                    mx.eval(toks)
                    mx.synchronize()
                    t0 = time.perf_counter()
                    out = text(toks, cache=cache)
                    t1 = time.perf_counter()
                    mx.eval(out)
                    mx.synchronize()
                    builds.append(t1 - t0)
                    evals.append(time.perf_counter() - t1)
                key = f"{arm} B{B}T{T}"
                samples.setdefault(key, []).append({"build_ms": statistics.median(builds) * 1e3,
                                                    "eval_ms": statistics.median(evals) * 1e3})
                log(f"round {rnd} {key}: build {samples[key][-1]['build_ms']:.2f} ms, eval {samples[key][-1]['eval_ms']:.2f} ms")
                del cache
                mx.clear_cache()
        save(args, dict(res, samples=samples))
    res["samples"] = samples
    res["median"] = {k: {f: statistics.median(s[f] for s in v) for f in ("build_ms", "eval_ms")} for k, v in samples.items()}
    res["per_64_layers_ms"] = {k: {f: v[f] * 64 / args.layers for f in v} for k, v in res["median"].items()}
    return res


def save(args, res: dict) -> None:
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("matmul", "forward", "probe", "host", "check"), required=True)
    ap.add_argument("--reps", type=int, default=3, help="probe: calls per group")
    ap.add_argument("--ms", default="", help="probe: comma-separated M (default 1,2,4,8,16,32); check: its M (default 1,16,17,32,40)")
    ap.add_argument("--launches", default="", help="probe: extra kernel launches S:U:NA[:P[:X]], comma-separated")
    ap.add_argument("--json")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--shapes", default="", help="comma-separated parts of shape names (default: all)")
    ap.add_argument("--gbytes", type=float, default=0.7, help="weight copies per shape up to this many GB (2..16)")
    ap.add_argument("--bandwidth", type=float, default=3.4e12, help="bytes/s for the bound (the H200's measured copy)")
    ap.add_argument("--old-source", help="another quant_mma.py: check its bits against the tree's, or an arm \"old\" of the probe")
    ap.add_argument("--tiled", action="store_true", help="probe: arms \"tiled\" (and \"old tiled\"): scales and biases tiled")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    if invariant.backend() != "cuda":
        print("qmm_graph.py needs MLX on CUDA (the tensor-core kernel is CUDA-only)", file=sys.stderr)
        return 2
    modes = {"matmul": matmul_mode, "forward": forward_mode, "probe": probe_mode, "host": host_mode,
             "check": lambda args: {"mode": "check", "kernel": quant_mma._NAME, "check": check_launches(
                 args.bits, old_module(args), tuple(int(m) for m in args.ms.split(",")) if args.ms else CHECK_MS)}}
    res = modes[args.mode](args)
    save(args, res)
    if args.mode == "matmul":
        print("\n| shape | split | M=1 us (bound %) | M16/M1 | M32/M1 | best arm per M | MLX us per M |\n|---|---|---|---|---|---|---|")
        for name, v in res["summary"].items():
            pm = v["per_M"]
            print(f"| {name} | {v['split']} | {pm[1]['us']:.1f} ({v['m1_bound_frac']:.0%}) | {v['m16_over_m1']:.2f} | "
                  f"{v['m32_over_m1']:.2f} | " + " / ".join(f"{pm[m]['us']:.0f}" for m in pm) + " | "
                  + " / ".join(f"{pm[m]['mlx_us']:.0f}" for m in pm) + " |")
    elif args.mode == "forward":
        print("\n| B x T | mlx build / eval ms (64 layers) | qmm build / eval ms (64 layers) |\n|---|---|---|")
        for B, T in [(1, 1), (4, 1), (8, 1), (4, 2)]:
            m, q = res["per_64_layers_ms"].get(f"mlx B{B}T{T}"), res["per_64_layers_ms"].get(f"qmm B{B}T{T}")
            if m and q:
                print(f"| {B}x{T} | {m['build_ms']:.1f} / {m['eval_ms']:.1f} | {q['build_ms']:.1f} / {q['eval_ms']:.1f} |")
    return 0 if res.get("check", {}).get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
