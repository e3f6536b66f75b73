"""What the test suite's CPU time is made of, on this machine: MLX's CPU matmul rate by dtype
and shape, the bundled model's decode and prefill cost a token by weight dtype, and a daemon
start's CPU seconds with its phases (from the daemon's own log). tests/README.md quotes it.

    PYTHONPATH=$PWD .venv/bin/python bench/cpu_costs.py --json bench/results/cpu_costs.json

Medians over --rounds; every sample is in the JSON. The machine is shared: read the rates
against each other (float32 vs bfloat16, decode vs prefill), not as absolutes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "e2e")]

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_map  # noqa: E402

from daemon.engine.model.compiled import enable_compiled_decode  # noqa: E402
from daemon.engine.model.loading import load_model  # noqa: E402
from daemon.engine.decoders.sampling import Sampler, SamplingParams  # noqa: E402
from daemon.engine.decoders.serial import serial_decode  # noqa: E402
from daemon.engine.prefill.prefill import prefill  # noqa: E402
from daemon.paths import BUNDLED_MODEL  # noqa: E402
from e2e_harness import start_daemon  # noqa: E402

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
# (rows, in, out): a decode step's MLP product and a 300-token prefill's, the bundled model's shapes.
SHAPES = [(1, 256, 768), (300, 256, 768)]
PHASES = [("imports and tokenizer", "daemon.loading", "model.load_progress"),
          ("weights and compiled step", "model.load_progress", "model.loaded"),
          ("head and probes", "model.loaded", "profile.absent"),
          ("warm-up", "profile.absent", "warmup.done")]


def matmul_rates(rounds: int) -> list[dict]:
    rows = []
    for m, k, n in SHAPES:
        a, w = mx.random.normal((m, k)), mx.random.normal((n, k))
        for name, dt in DTYPES.items():
            a2, w2 = a.astype(dt), w.astype(dt)
            mx.eval(a2, w2)
            reps = 200 if m == 1 else 10
            samples = []
            for _ in range(rounds):
                t = time.perf_counter()
                for _ in range(reps):
                    mx.eval(a2 @ w2.T)
                samples.append(2 * m * k * n / ((time.perf_counter() - t) / reps) / 1e9)
            rows.append({"shape": f"{m}x{k} @ {k}x{n}", "dtype": name, "gflops": statistics.median(samples),
                         "samples": samples})
    return rows


def model_costs(rounds: int) -> list[dict]:
    rows = []
    for name in ("bfloat16", "float32"):
        lm = load_model(BUNDLED_MODEL, compile_decode=False)
        if name == "float32":
            lm.model.update(tree_map(lambda p: p.astype(mx.float32), lm.model.parameters()))
        lm.decode_path = "compiled" if enable_compiled_decode(lm) is None else "eager"
        pre, dec = [], []
        for _ in range(rounds):
            t = time.perf_counter()
            mx.eval(prefill(lm, list(range(5, 306)), lm.make_cache()))
            pre.append((time.perf_counter() - t) / 300 * 1e3)
            steps = serial_decode(lm, list(range(5, 25)), Sampler(SamplingParams(temperature=0.0)))
            next(steps)
            t = time.perf_counter()
            for _ in range(64):
                next(steps)
            dec.append((time.perf_counter() - t) / 64 * 1e3)
        rows.append({"weights": name, "decode_path": lm.decode_path, "prefill_ms_per_token": statistics.median(pre),
                     "decode_ms_per_token": statistics.median(dec), "prefill_samples": pre, "decode_samples": dec})
    return rows


def _stamp(event: dict) -> float:
    return datetime.datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def start_costs(rounds: int) -> list[dict]:
    rows = []
    for _ in range(rounds):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        d = start_daemon(Path(tempfile.mkdtemp()), BUNDLED_MODEL)
        ready = time.perf_counter() - t
        assert d.stop() == 0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        first = {}
        for e in d.events():
            first.setdefault(e["event"], _stamp(e))
        row = {"ready_s": ready, "cpu_s": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)}
        for what, a, b in PHASES:
            row[what] = first[b] - first[a] if a in first and b in first else None
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="samples of each figure (default 3)")
    ap.add_argument("--json", type=Path, help="write every sample here")
    args = ap.parse_args(argv)
    print("[cpu_costs] matmul rates", file=sys.stderr)
    rates = matmul_rates(args.rounds)
    print("[cpu_costs] the bundled model, bfloat16 and float32 weights", file=sys.stderr)
    model = model_costs(args.rounds)
    print("[cpu_costs] daemon starts (probe verdicts from the user's cache)", file=sys.stderr)
    starts = start_costs(args.rounds)

    print("| matmul | dtype | GFLOP/s |\n|---|---|---|")
    for r in rates:
        print(f"| {r['shape']} | {r['dtype']} | {r['gflops']:.2f} |")
    print("\n| weights | decode path | prefill ms/token (300) | decode ms/token |\n|---|---|---|---|")
    for r in model:
        print(f"| {r['weights']} | {r['decode_path']} | {r['prefill_ms_per_token']:.2f} | {r['decode_ms_per_token']:.2f} |")
    print("\n| daemon start | median s |\n|---|---|")
    for key in ["ready_s", "cpu_s"] + [p[0] for p in PHASES]:
        vals = [r[key] for r in starts if r[key] is not None]
        print(f"| {key} | {statistics.median(vals):.2f} |" if vals else f"| {key} | - |")
    if args.json:
        args.json.write_text(json.dumps({"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                         "load_avg": os.getloadavg(), "mlx": mx.__version__, "matmul": rates,
                                         "model": model, "starts": starts}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
