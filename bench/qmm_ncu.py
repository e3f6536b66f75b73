"""The quantized matmuls' GPU time alone, from Nsight Compute: no host time, cold L2.

    ncu --metrics gpu__time_duration.sum --csv --log-file DIR/ncu.csv \\
        python3 bench/qmm_ncu.py --plan DIR/plan.json [--sweep]
    python3 bench/qmm_ncu.py --report DIR      # joins plan.json and ncu.csv: a table + qmm_ncu.json

The "us per call" of bench/qmm_device.py includes the host's graph building and MLX's
custom-kernel call (~15-20 us a call on the H200), so it cannot say how close the kernel
itself comes to the weight-read bound. Here every case (shape x M x kernel, and with
``--sweep`` the tensor-core kernel's launch variants) runs once, evaluated alone; ncu times
each kernel (flushing caches between kernels by default), and the plan, written in launch
order, names the matmul kernel of each case. Inputs are made and evaluated before the cases,
so between cases only the matmul kernels run (their names tell them from anything else).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

SHAPES = {  # name: (N, K)
    "mlp.gate/up 5120->17408": (17408, 5120),
    "mlp.down 17408->5120": (5120, 17408),
    "attn.k/v_proj 5120->1024": (1024, 5120),
    "gdn.in_proj_qkv 5120->10240": (10240, 5120),
    "lm_head 5120->248320": (248320, 5120),
}
MS = (1, 4, 8, 16, 32)
SWEEP_SHAPE = "mlp.gate/up 5120->17408"


def bound_us(N: int, K: int, bits: int, gs: int, bandwidth: float = 3.4e12) -> float:
    weight = N * K * bits / 8 + 2 * N * (K // gs) * 2  # packed weights + bf16 scales and biases
    return weight / bandwidth * 1e6


def cases(sweep: bool) -> list[dict]:
    out = []
    for name, (N, K) in SHAPES.items():
        for M in MS:
            for kern in ("mlx", "qmm"):
                out.append({"shape": name, "N": N, "K": K, "M": M, "kernel": kern, "launch": {}})
    if sweep:
        N, K = SHAPES[SWEEP_SHAPE]
        for M in (1, 16, 32):
            for S in ((1, 2, 4, 8) if M == 1 else (1, 2, 4)):
                for U in ((1, 2, 4) if M == 1 else (1, 2)):
                    for NA in ((1,) if M == 1 else (1, 2, 4)):
                        out.append({"shape": SWEEP_SHAPE, "N": N, "K": K, "M": M, "kernel": "qmm",
                                    "launch": {"split": S, "unroll": U, "columns": NA}})
    return out


MARKER = "councild_case_marker"
UNITS_US = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}


def make_marker():
    """A one-thread kernel, evaluated alone, whose name cuts ncu's CSV into cases."""
    import mlx.core as mx

    marker = mx.fast.cuda_kernel(name=MARKER, input_names=["a"], output_names=["o"],
                                 source="if (threadIdx.x == 0) o[0] = a[0];")
    one = mx.ones((1,), dtype=mx.float32)

    def mark() -> None:
        (o,) = marker(inputs=[one], grid=(1, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(1,)],
                      output_dtypes=[mx.float32])
        mx.eval(o)
        mx.synchronize()

    return mark


def read_kernel_times(csv_path: Path) -> list[tuple[str, float]]:
    """(kernel name, us) in launch order, markers included, from ncu's ``--csv`` log."""
    with open(csv_path, newline="") as f:
        lines = [ln for ln in f if ln.startswith('"')]  # ncu's own "==PROF==" lines are not CSV
    rows = []
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        v = float(r["Metric Value"].replace(",", ""))
        rows.append((r.get("Kernel Name", ""), v * UNITS_US.get(r.get("Metric Unit", "ns"), 1e-3)))
    return rows


def run(plan_path: Path, sweep: bool, only_sweep: bool = False, budget: float = 1e9) -> None:
    import mlx.core as mx

    from daemon.engine.kernels import quant_mma

    import time

    t0 = time.perf_counter()
    plan = cases(sweep)
    if only_sweep:
        plan = [c for c in plan if c["launch"]]
    weights = {}
    for name, (N, K) in SHAPES.items():
        w = (mx.random.normal((N, K)) * K ** -0.5).astype(mx.bfloat16)
        weights[name] = mx.quantize(w, group_size=64, bits=4)
        mx.eval(*weights[name])
        del w
    xs = {M: mx.random.normal((M, 5120)).astype(mx.bfloat16) for M in MS}
    xs_down = {M: mx.random.normal((M, 17408)).astype(mx.bfloat16) for M in MS}
    mx.eval(list(xs.values()), list(xs_down.values()))
    mark = make_marker()
    mark()  # compiled here; and it opens the first case
    mx.synchronize()
    profiler = CudaProfiler()
    profiler.start()
    for c in plan:
        if time.perf_counter() - t0 > budget:  # not run: its segment is closed all the same
            c["ran"], c["error"] = False, "budget"
            mark()
            continue
        q, s, b = weights[c["shape"]]
        x = xs_down[c["M"]] if c["K"] == 17408 else xs[c["M"]]
        try:
            if c["kernel"] == "mlx":
                y = mx.quantized_matmul(x, q, s, b, transpose=True, group_size=64, bits=4)
            else:
                y = quant_mma.quantized_matmul_mma(x, q, s, b, 64, 4, **c["launch"])
            mx.eval(y)
            mx.synchronize()
            c["ran"] = True
            mark()
        except Exception as exc:  # noqa: BLE001 - a launch the device refuses is a result
            c["ran"] = False
            c["error"] = f"{type(exc).__name__}: {exc}"[:300]
            mark()
    profiler.stop()
    plan_path.parent.mkdir(parents=True, exist_ok=True)
    plan_path.write_text(json.dumps(plan, indent=1))


class CudaProfiler:
    """Starts and stops ncu's range (for --profile-from-start off) through the CUDA runtime
    or, where MLX links the runtime statically, the driver, whichever this process loaded."""

    def __init__(self) -> None:
        import ctypes

        with open("/proc/self/maps") as f:
            libs = {ln.split()[-1] for ln in f if ".so" in ln}
        rt = sorted(p for p in libs if "libcudart.so" in p)
        drv = sorted(p for p in libs if "libcuda.so" in p)
        if rt:
            lib = ctypes.CDLL(rt[0])
            self._start, self._stop, self.via = lib.cudaProfilerStart, lib.cudaProfilerStop, rt[0]
        else:
            lib = ctypes.CDLL(drv[0] if drv else "libcuda.so.1")
            self._start, self._stop, self.via = lib.cuProfilerStart, lib.cuProfilerStop, drv[0] if drv else "libcuda.so.1"

    def start(self) -> None:
        print(f"profiler start via {self.via}: {self._start()}", file=sys.stderr)

    def stop(self) -> None:
        print(f"profiler stop: {self._stop()}", file=sys.stderr)


def report(folder: Path) -> int:
    plan = json.loads((folder / "plan.json").read_text())
    segments: list[list[tuple[str, float]]] = [[]]
    for name, us in read_kernel_times(folder / "ncu.csv"):
        if MARKER in name:
            segments.append([])
        else:
            segments[-1].append((name, us))
    # Each case closes with a marker (also one that raised). Profiled from the start, the
    # marker before the first case closes the set-up's kernels: dropped. Profiled from
    # cudaProfilerStart on, segment i is case i's. The last segment follows the last marker.
    if len(segments) - 1 == len(plan) + 1:
        segments = segments[1:]
    if len(segments) - 1 != len(plan):
        print(f"warning: {len(segments) - 1} marked segments for {len(plan)} cases", file=sys.stderr)
    for c, seg in zip(plan, segments):
        if c.get("ran") and seg:
            c["kernels"] = [(n[:60], round(us, 2)) for n, us in seg]
            c["us"] = sum(us for _, us in seg)
        c["bound_us"] = bound_us(c["N"], c["K"], 4, 64)
    ran = [c for c in plan if c.get("ran")]
    table = {}
    for c in ran:
        if not c["launch"] and "us" in c:
            table.setdefault(c["shape"], {}).setdefault(c["kernel"], {})[c["M"]] = c["us"]
    print("| shape | kernel | bound us | " + " | ".join(f"M={m}" for m in MS) + " | M=1 at bound | M16/M1 | M32/M1 |")
    print("|---|---|---|" + "---|" * (len(MS) + 3))
    for shape, by in table.items():
        N, K = SHAPES[shape]
        bd = bound_us(N, K, 4, 64)
        for kern, t in by.items():
            cells = " | ".join(f"{t.get(m, float('nan')):.1f}" for m in MS)
            print(f"| {shape} | {kern} | {bd:.1f} | {cells} | {bd / t[1]:.0%} | {t[16] / t[1]:.2f} | {t[32] / t[1]:.2f} |")
    sweep = [c for c in ran if c["launch"] and "us" in c]
    if sweep:
        print("\n| M | S | U | NA | us |\n|---|---|---|---|---|")
        for c in sorted(sweep, key=lambda c: (c["M"], c["us"])):
            L = c["launch"]
            print(f"| {c['M']} | {L['split']} | {L['unroll']} | {L['columns']} | {c['us']:.1f} |")
        best = {}
        for c in sweep:
            if c["M"] not in best or c["us"] < best[c["M"]]["us"]:
                best[c["M"]] = c
        print("best: " + ", ".join(f"M={m}: {b['launch']} {b['us']:.1f} us" for m, b in sorted(best.items())))
    failed = [c for c in plan if not c.get("ran")]
    for c in failed:
        print(f"did not run: {c['shape']} M={c['M']} {c['kernel']} {c['launch']}: {c.get('error')}")
    (folder / "qmm_ncu.json").write_text(json.dumps({"cases": plan, "table_us": table}, indent=1))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", type=Path, help="run the cases (under ncu), writing the plan here")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--only-sweep", action="store_true", help="the launch variants alone")
    ap.add_argument("--budget", type=float, default=1e9, help="seconds; cases past it are not run")
    ap.add_argument("--report", type=Path, help="a folder with plan.json and ncu.csv")
    args = ap.parse_args(argv)
    if args.report:
        return report(args.report)
    if args.plan:
        run(args.plan, args.sweep or args.only_sweep, args.only_sweep, args.budget)
        return 0
    ap.error("--plan or --report")
    return 2


if __name__ == "__main__":
    sys.exit(main())
