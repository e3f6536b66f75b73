"""Where a decode step's time goes on the device: host graph building, the host's encoding of
kernels, or the GPU, for eager and compiled steps, per kernel set, in one call.

    PYTHONPATH=/tmp/site:$PWD python3 bench/step_split.py --out DIR [--shape 27b|tiny]
        [--model DIR] [--arms mlx,qmm] [--shapes 1x1,4x1,4x2,8x1] [--rounds 2] [--budget 540]

A decode step of a large model should be bound by reading its weights (a 27B-shaped 4-bit
step: ~15 GB at ~3.4 TB/s, ~4.5 ms). On the H200 it takes ~25 ms. This splits each step into
- build: Python runs the forward and returns the lazy graph (``lm.hidden`` + ``lm.logits``);
- encode: ``mx.async_eval`` returns once the host has encoded every kernel for the GPU;
- total: the step's wall time, to ``mx.synchronize``;
so a step whose total is about build + encode is bound by the host, not by the GPU or the
matmul kernel. Arms: kernels "mlx" (MLX's everywhere), "qmm" (the quantized linears on
engine/kernels/quant_mma.py), "gdn" (the GatedDeltaNet recurrence on engine/kernels/gdn_fused.py),
"conv" (with "gdn": the conv, SiLU and q/k norm folded into that kernel), "lin" (the bf16
linears and the tied head on the invariant set's dense matmul: MLX's gemv at one row,
``invariant_kernels.gemv_rows`` from two, not MLX's cuBLASLt), "inv" (engine/kernels/invariant.py's
whole set), "fixed" (with "lin" or "inv": the dense matmul on the fixed-order kernel at every
row count, as before ``gemv_rows``), "merge" (projections that read one input as one matmul,
engine/kernels/merged_linears.py; with "noattn": the attention's q, k and v left separate, as
before 2026-12-06) or a "+" of them, each eager and compiled (model/compiled.py's CompiledDecode,
switched in only when its self-check passes, as the daemon does). Arms alternate within each
round, the prompt changes between rounds, the first round is reported apart.

Two floors measured in the same call: ``chain``, N dependent tiny elementwise ops evaluated
at once (MLX's cost per kernel on this backend, host and launch), and ``qmm_chain``, N
quantized matmuls of one small shape (the cost per quantized-matmul call, each kernel set).

Prints a markdown table and writes DIR/step_split.json after each section.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
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
import mlx.nn as nn  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from daemon.engine.kernels import (forward, gdn_fused, gdn_layer, invariant, invariant_kernels,  # noqa: E402
                                   merged_linears, quant_mma)
from daemon.engine.model import compiled as compiled_step  # noqa: E402
from daemon.engine.model.compiled import enable_compiled_decode  # noqa: E402
from daemon.engine.model.loading import load_model  # noqa: E402
from gpu_bench import QWEN35_27B, TINY, build_model, log, quantize_4bit  # noqa: E402
from qmm_graph import load_kernel_module  # noqa: E402

T0 = time.perf_counter()
RESULTS: dict = {"argv": sys.argv[1:], "errors": []}


def save(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_split.json").write_text(json.dumps(RESULTS, indent=1, default=str))


def split_time(fn) -> tuple[float, float, float]:
    """(build, encode, total) seconds of one call of ``fn`` (returns the arrays to evaluate)."""
    mx.synchronize()
    t0 = time.perf_counter()
    outs = fn()
    t1 = time.perf_counter()
    mx.async_eval(outs)
    t2 = time.perf_counter()
    mx.synchronize()
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t0


def med(rows: list[tuple[float, float, float]]) -> dict:
    return {k: statistics.median(r[i] for r in rows) * 1e3 for i, k in enumerate(("build_ms", "encode_ms", "total_ms"))}


def chain_floor(n: int = 2000) -> dict:
    """Per-kernel cost of n dependent elementwise ops on a tiny array (no fusion: eager)."""
    x = mx.zeros((1, 16), dtype=mx.bfloat16)
    mx.eval(x)

    def run():
        y = x
        for _ in range(n):
            y = y * 1.0001 + 1
        return [y]

    run_rows = [split_time(run) for _ in range(5)]
    m = med(run_rows[1:])
    return {"ops": 2 * n, **m, "us_per_op_total": m["total_ms"] * 1e3 / (2 * n),
            "us_per_op_encode": m["encode_ms"] * 1e3 / (2 * n)}


def qmm_chain(n: int = 400) -> dict:
    """Per-call cost of a small quantized matmul (5120 -> 1024, M = 1), MLX's and the kernel's."""
    w = mx.random.normal((1024, 5120)).astype(mx.bfloat16)
    q, s, b = mx.quantize(w, group_size=64, bits=4)
    x = mx.random.normal((1, 5120)).astype(mx.bfloat16)
    mx.eval(q, s, b, x)
    out = {}
    fns = {"mlx": lambda v: mx.quantized_matmul(v, q, s, b, transpose=True, group_size=64, bits=4)}
    if invariant.backend() == "cuda":
        fns["qmm"] = lambda v: quant_mma.quantized_matmul_mma(v, q, s, b, 64, 4)
    for name, f in fns.items():
        def run():
            ys = [f(x) for _ in range(n)]  # independent calls: no dependency stalls
            return ys
        rows = [split_time(run) for _ in range(4)]
        m = med(rows[1:])
        out[name] = {"calls": n, **m, "us_per_call_total": m["total_ms"] * 1e3 / n,
                     "us_per_call_build": m["build_ms"] * 1e3 / n, "us_per_call_encode": m["encode_ms"] * 1e3 / n}
    return out


_SPLIT_FOR = quant_mma.split_for


_MMA = quant_mma.quantized_matmul_mma


def _mma_reshaped(x, w, scales, biases, group_size, bits, **launch):
    """The kernel's call as it was before 2026-12-06: x reshaped to 2-D around it (two view
    nodes a call). Arm token "rs"; the same kernel and the same bits, only the host's nodes."""
    y = _MMA(x.reshape(-1, x.shape[-1]), w, scales, biases, group_size, bits, **launch)
    return y.reshape(*x.shape[:-1], w.shape[0])


_STAGES = dict(quant_mma.STAGES_BY_TILES)
_WIDE = quant_mma.WIDE_SPLIT
_SPLITS = dict(quant_mma.SPLITS)
_MIN_BLOCKS = dict(quant_mma.MIN_BLOCKS_BY_TILES)
_PREFETCH = quant_mma.PREFETCH_TILES
_OLD: list = []


def old_kernel():
    """The "old" token's kernel: the quant_mma.py named by COUNCILD_QMM_OLD_SOURCE, loaded once."""
    if not _OLD:
        path = os.environ.get("COUNCILD_QMM_OLD_SOURCE")
        if not path:
            raise SystemExit('kernel token "old": set COUNCILD_QMM_OLD_SOURCE to another quant_mma.py')
        _OLD.append(load_kernel_module(path))
    return _OLD[0]


def split_table(path: str | None) -> dict[tuple[int, int, int], int]:
    """bench/qmm_split_pick.py's JSON as ``quant_mma.SPLITS`` entries (the "tbl" token's table)."""
    if not path:
        raise SystemExit('kernel token "tbl": set COUNCILD_QMM_SPLITS to bench/qmm_split_pick.py\'s --json')
    got = json.loads(Path(path).read_text())
    return {(int(N), int(K), int(got["bits"])): int(S) for N, K, S in got["splits"]}


def apply_launches(kernels: str) -> None:
    """The tensor-core kernel's split is looked up per layer shape: "sN" in a kernel set makes
    every layer's split N warps (a different summation order: a speed arm only); "pN" streams
    every launch's weights N chunks ahead through shared memory (P = N; "p0": the register feed;
    the same bits); "wN" gives layers whose tiles fill the chip N warps ("w1": one, as before
    2026-12-06; a different order); "tbl" adds the per-shape splits of the JSON file named by
    COUNCILD_QMM_SPLITS (bench/qmm_split_pick.py's; a different order where it differs from the
    default); "old" calls the kernel of the quant_mma.py named by COUNCILD_QMM_OLD_SOURCE (a speed
    A/B of two versions of the kernel); "rs" calls the kernel through ``_mma_reshaped``; "bN" keeps
    a layer at N blocks or more at 2 row tiles where the table would give its warps several
    column tiles (``quant_mma.MIN_BLOCKS_BY_TILES``; "b0": no such floor, the table's NA as before
    2026-12-06; speed only, the same bits); "xN" loads the next chunk's activations ahead in
    launches of up to N row tiles (``quant_mma.PREFETCH_TILES``; "x0": never, as before
    2026-12-07; speed only, the same bits); "r0" adds every residual apart instead of in the
    matmul's writes (``forward.FUSE_RESIDUAL``; as before 2026-12-06 evening; the same bits); "a0"
    leaves the attention eager up to its traced tail (``compiled.TRACE_ATTENTION_PARTS``; as before
    2026-12-06 evening; the same bits); "t1" (``set_arm``) has the kernel read every layer's scales
    and biases tiled (``quant_mma.tile_layers``; the same bits). Call it
    before each arm of a set runs (an eager step looks the split up at every call, a compiled one
    when it traces)."""
    parts = kernels.split("+")

    def number(letter: str) -> int | None:  # the N of a token "<letter>N"
        return next((int(p[1:]) for p in parts if p[:1] == letter and p[1:].isdigit()), None)

    split, wide, stages, blocks, prefetch = number("s"), number("w"), number("p"), number("b"), number("x")
    quant_mma.PREFETCH_TILES = _PREFETCH if prefetch is None else prefetch
    forward.FUSE_RESIDUAL = "r0" not in parts
    compiled_step.TRACE_ATTENTION_PARTS = "a0" not in parts
    quant_mma.MIN_BLOCKS_BY_TILES.clear()
    quant_mma.MIN_BLOCKS_BY_TILES.update(_MIN_BLOCKS if blocks is None else {2: blocks} if blocks else {})
    quant_mma.split_for = _SPLIT_FOR if split is None else (lambda N, K, bits: split)
    quant_mma.WIDE_SPLIT = _WIDE if wide is None else wide
    quant_mma.SPLITS.clear()
    quant_mma.SPLITS.update(_SPLITS)
    if "tbl" in parts:
        quant_mma.SPLITS.update(split_table(os.environ.get("COUNCILD_QMM_SPLITS")))
    quant_mma.STAGES_BY_TILES.clear()
    quant_mma.STAGES_BY_TILES.update(
        _STAGES if stages is None else {mt: stages for mt in range(1, quant_mma.MAX_TILES + 1)})
    quant_mma.forget_launches()
    quant_mma.quantized_matmul_mma = (_mma_reshaped if "rs" in parts else old_kernel().quantized_matmul_mma
                                      if "old" in parts else _MMA)


def set_arm(lm, kernels: str, compiled: bool) -> str:
    apply_launches(kernels)
    lm.compiled_decode = None
    invariant.uninstall(lm.text_module)
    gdn_layer.uninstall(lm.text_module)
    merged_linears.uninstall(lm.text_module)
    parts = kernels.split("+")
    if "gdn" in parts:  # "conv": with the conv folded into its kernel (the daemon's default on CUDA)
        gdn_layer.install(lm.text_module, conv_recurrence=gdn_fused.gated_delta_conv_fused if "conv" in parts else None)
    if "merge" in parts:  # before the kernel swap, which must reach the merged layers too
        merged_linears.install(lm.text_module, attention="noattn" not in parts)
    if "qmm" in parts:
        invariant.install(lm.text_module, max_rows=72, quantized_only=True)
    if "inv" in parts:  # the whole invariant set: linears, head, attention, quantized linears
        invariant.install(lm.text_module, max_rows=72)
    if "lin" in parts:  # the bf16 linears and the tied head alone on the custom matmul (one launch, no cuBLASLt)
        invariant.MAX_ROWS = max(invariant.MAX_ROWS, 72)
        invariant.restore_classes(lm.text_module, {nn.Linear: invariant.InvariantLinear,
                                                   nn.Embedding: invariant.InvariantEmbedding})
        if invariant.backend() == "cuda":
            invariant.verify_dense_rows(lm.text_module)
    if "fixed" in parts:  # the dense rows on the fixed-order kernel, as before gemv_rows (one row too)
        invariant_kernels.GEMV_MATCHED.clear()
    quant_mma.forget_tiled()
    if "t1" in parts:  # after the merge: the merged layers' arrays are the ones the kernel reads
        quant_mma.tile_layers(lm.text_module)
    if not compiled:
        return "eager"
    reason = enable_compiled_decode(lm)
    if reason is not None:
        return f"eager: {reason}"
    return "compiled" + ("" if lm.compiled_decode.batched else f" (batches eager: {lm.compiled_decode.batch_reason})")


def step_times(lm, B: int, T: int, context: int, steps: int, seed: int, last: list | None = None,
               profiler=None) -> list[tuple[float, float, float]]:
    """Median-ready (build, encode, total) of ``steps`` steps; ``last`` gets the last step's
    logits (the same seed gives every arm the same prompt and tokens: arms that differ only in
    speed must give the same bits); a ``cProfile.Profile`` given as ``profiler`` records the
    measured steps' builds (the Python returning the lazy graph) and nothing else."""
    V = lm.text_args.vocab_size
    mx.random.seed(seed)
    cache = make_prompt_cache(lm.text_module)
    mx.eval(lm.hidden(mx.random.randint(0, V, (B, context)), cache))
    # Two unmeasured steps: the first decode step of a cache (compiled traces apply from the
    # second), and the shape's first run (kernels, traces).
    rows, kept = [], []
    for i in range(steps + 2):
        toks = mx.random.randint(0, V, (B, T))
        mx.eval(toks)

        def step():
            logits = lm.logits(lm.hidden(toks, cache)[:, -1:])
            kept[:] = [logits]
            return [mx.argmax(logits, axis=-1), logits]

        measured = i >= 2
        r = split_time(lambda: profiler.runcall(step)) if profiler is not None and measured else split_time(step)
        if measured:
            rows.append(r)
    if last is not None:
        last[:] = kept
    del cache
    mx.clear_cache()
    return rows


def profile_build(lm, B: int, T: int, context: int, steps: int, top: int = 30) -> dict:
    """cProfile of ``steps`` step builds of the arm last set (``step_times``'s measured steps):
    which Python functions the host's build time goes to."""
    prof = cProfile.Profile()
    rows = step_times(lm, B, T, context, steps, seed=0, profiler=prof)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return {"shape": f"B{B}T{T}", "steps": steps, **med(rows), "table": buf.getvalue()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/out/step_split")
    ap.add_argument("--shape", choices=("27b", "tiny"), default="27b")
    ap.add_argument("--model", help="a model folder instead of the random --shape (e.g. daemon/assets/tiny-qwen35)")
    ap.add_argument("--arms", default="mlx,qmm")
    ap.add_argument("--shapes", default="1x1,4x1,4x2,8x1", help="BxT, comma-separated")
    ap.add_argument("--paths", default="eager,compiled")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--budget", type=float, default=540.0)
    ap.add_argument("--no-floors", action="store_true")
    ap.add_argument("--profile", default="", help="BxT: after the rounds, cProfile the last arm's build of this "
                    "shape (Python's share of the host time, by function)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    RESULTS["device"] = {"backend": invariant.backend(), "mlx": mx.__version__, "info": str(mx.default_device())}
    try:
        if args.no_floors:
            raise StopIteration
        RESULTS["chain"] = chain_floor()
        RESULTS["qmm_chain"] = qmm_chain()
        log(f"floors: chain {RESULTS['chain']['us_per_op_total']:.2f} us/op "
            f"(encode {RESULTS['chain']['us_per_op_encode']:.2f}); qmm_chain "
            + ", ".join(f"{k} {v['us_per_call_total']:.1f} us/call (build {v['us_per_call_build']:.1f}, "
                        f"encode {v['us_per_call_encode']:.1f})" for k, v in RESULTS["qmm_chain"].items()))
    except StopIteration:
        pass
    except Exception:  # noqa: BLE001 - the floors are context; the steps still run
        RESULTS["errors"].append(traceback.format_exc())
        print(RESULTS["errors"][-1], file=sys.stderr)
    save(out)

    t = time.perf_counter()
    if args.model:
        lm = load_model(args.model, compile_decode=False)
        label = args.model
    else:
        lm, head, _inv = build_model(QWEN35_27B if args.shape == "27b" else TINY)
        quantize_4bit(lm, head)
        del head
        label = f"{args.shape} 4-bit"
    mx.clear_cache()
    RESULTS["model"] = label
    log(f"{label} ready in {time.perf_counter() - t:.0f}s")
    arms = [(k, p) for k in args.arms.split(",") for p in args.paths.split(",")]
    if invariant.backend() != "cuda":  # the arms this backend has the kernels of
        arms = [(k, p) for k, p in arms if not {"gdn", "conv", "qmm", "old", "rs", "lin", "inv"} & set(k.split("+"))]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows: dict[str, list] = {}
    paths: dict[str, str] = {}
    firsts: dict[tuple, tuple] = {}
    for rnd in range(args.rounds):
        # The order alternates round by round: on an H100 (2026-12-07) the arm run second in a
        # round ran 5-10% faster whichever it was (bench/results/h100_2026-12-07b).
        for kernels, path in (arms if rnd % 2 == 0 else arms[::-1]):
            if time.perf_counter() - T0 > args.budget:
                RESULTS["errors"].append(f"budget: stopped before round {rnd} {kernels} {path}")
                break
            name = f"{kernels} {path}"
            try:
                paths[name] = set_arm(lm, kernels, path == "compiled")
                for B, T in shapes:
                    last: list = []
                    r = step_times(lm, B, T, args.context, args.steps, seed=1000 * rnd + 10 * B + T, last=last)
                    rows.setdefault(f"{name} B{B}T{T}", []).append(med(r))
                    m = rows[f"{name} B{B}T{T}"][-1]
                    # The round's first arm's last logits at this shape: the others' bits against it.
                    ref = firsts.setdefault((rnd, B, T), (name, last[0]))
                    same = bool(mx.array_equal(ref[1], last[0]).item())
                    m["same_bits_as"] = (ref[0], same)
                    log(f"round {rnd} {name} ({paths[name]}) B{B}T{T}: total {m['total_ms']:.2f} ms, "
                        f"build {m['build_ms']:.2f}, encode {m['encode_ms']:.2f}; last logits "
                        f"{'=' if same else 'DIFFER from'} {ref[0]}'s")
            except Exception:  # noqa: BLE001 - one arm's failure is a result; the others run
                RESULTS["errors"].append(f"{name}: " + traceback.format_exc())
                print(RESULTS["errors"][-1], file=sys.stderr)
            RESULTS["steps"] = {"rounds": rows, "paths": paths}
            save(out)
    if args.profile and rows:
        try:
            B, T = (int(v) for v in args.profile.split("x"))
            RESULTS["profile"] = profile_build(lm, B, T, args.context, args.steps)
            print(RESULTS["profile"]["table"])
        except Exception:  # noqa: BLE001 - the profile is context; the table still prints
            RESULTS["errors"].append("profile: " + traceback.format_exc())
        save(out)
    print("\n| arm | BxT | round 0 total ms | later total ms | build ms | encode ms | tok/s (B x 1000 / later total) |")
    print("|---|---|---|---|---|---|---|")
    for key, v in rows.items():
        later = v[1:] or v
        tot = statistics.median(x["total_ms"] for x in later)
        B = int(key.split(" B")[1].split("T")[0])
        print(f"| {key.rsplit(' B', 1)[0]} | {key.rsplit(' ', 1)[1]} | {v[0]['total_ms']:.2f} | {tot:.2f} | "
              f"{statistics.median(x['build_ms'] for x in later):.2f} | "
              f"{statistics.median(x['encode_ms'] for x in later):.2f} | {B * 1000 / tot:.0f} |")
    RESULTS["wall_s"] = time.perf_counter() - T0
    save(out)
    return 1 if RESULTS["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
