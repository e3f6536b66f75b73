"""How many operations one decode step asks of MLX, by kind: what a host-bound step pays for.

    PYTHONPATH=$PWD python3 bench/step_ops.py [--layers 64] [--shapes 1x1,4x1] [--json FILE]

On the H200 a 27B-shaped 4-bit step costs ~4.5 us of host time per MLX kernel and is bound by
that, not by the GPU (bench/results/h200_2026-12-03d). The number of operations in a step is a
property of the graph, the same on every backend, so it is counted here on any machine: a
random qwen3_5 with the 27B model's layer pattern (48 GatedDeltaNet layers, 16 gated attention
layers, full attention every 4th) at a small width (op counts do not depend on width), 4-bit
group 64, a 64-token cache, one decode step of B rows x T positions (the daemon's
``lm.hidden`` + ``lm.logits`` + argmax), eager and compiled (model/compiled.py, as the daemon
switches it in). The lazy graph is written with ``mx.export_to_dot`` and its nodes counted by
primitive. "views" are the primitives MLX evaluates without a kernel where the input is
contiguous (reshape, broadcast, slice, transpose, expand/squeeze dims, stop-gradient); every
other node is at least one kernel launch on a GPU. A ``Compiled`` node is one fused kernel.
Count on the backend in question: MLX builds ``mx.fast`` operations (rms_norm, rope, sdpa)
from plain ops where it has no kernel for them (the CPU), so a CPU count is higher than a
GPU's for the same step.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from daemon.engine.kernels import invariant  # noqa: E402
from gpu_bench import TINY, build_model, quantize_4bit  # noqa: E402
from step_split import set_arm  # noqa: E402

VIEWS = {"Reshape", "Broadcast", "Slice", "Transpose", "ExpandDims", "Squeeze", "StopGradient", "AsStrided",
         "BroadcastAxes", "Flatten", "Unflatten"}
_NODE = re.compile(r'\{ \d+ \[label ="([^"]+)"')


def count_ops(outputs: list[mx.array]) -> Counter:
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *outputs)
        text = Path(f.name).read_text()
    return Counter(_NODE.findall(text))


def step_graph(lm, B: int, T: int, context: int) -> Counter:
    V = lm.text_args.vocab_size
    mx.random.seed(B * 10 + T)
    cache = make_prompt_cache(lm.text_module)
    mx.eval(lm.hidden(mx.random.randint(0, V, (B, context)), cache))
    for _ in range(2):  # the cache's first decode step runs eager: count a later one
        mx.eval(mx.argmax(lm.logits(lm.hidden(mx.random.randint(0, V, (B, T)), cache)[:, -1:]), axis=-1))
    toks = mx.random.randint(0, V, (B, T))
    mx.eval(toks)
    out = mx.argmax(lm.logits(lm.hidden(toks, cache)[:, -1:]), axis=-1)
    ops = count_ops([out])
    mx.eval(out)
    return ops


def summary(ops: Counter) -> dict:
    views = sum(n for k, n in ops.items() if k in VIEWS)
    total = sum(ops.values())
    return {"nodes": total, "views": views, "kernels": total - views,
            "by_primitive": dict(ops.most_common())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=64, help="decoder layers (the 27B model has 64)")
    ap.add_argument("--shapes", default="1x1,4x1", help="BxT, comma-separated")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--arms", default="mlx,qmm", help="kernel sets as bench/step_split.py's set_arm takes them (mlx, or a "
                    "'+' of gdn, conv, merge, noattn, qmm); those with gdn, conv or qmm on CUDA only")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    lm, head, _ = build_model(dict(TINY, num_hidden_layers=args.layers))
    quantize_4bit(lm, head)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    res: dict = {"layers": args.layers, "backend": str(mx.default_device()), "mlx": mx.__version__, "steps": {}}
    cuda_only = {"gdn", "conv", "qmm"}
    arms = [a for a in args.arms.split(",") if not cuda_only & set(a.split("+")) or invariant.backend() == "cuda"]
    for arm in arms:
        for path in ("eager", "compiled"):
            how = set_arm(lm, arm, path == "compiled")
            if path == "compiled" and not how.startswith("compiled"):
                res["steps"][f"{arm} {path}"] = f"not compiled: {how}"
                continue
            for B, T in shapes:
                res["steps"][f"{arm} {path} B{B}T{T}"] = summary(step_graph(lm, B, T, args.context))
                if args.json:
                    args.json.write_text(json.dumps(res, indent=1))
    print("| step | nodes | kernels (not views) | per layer | top kernel primitives |")
    print("|---|---|---|---|---|")
    for key, s in res["steps"].items():
        if isinstance(s, str):
            print(f"| {key} | {s} | | | |")
            continue
        top = ", ".join(f"{k} {n}" for k, n in s["by_primitive"].items() if k not in VIEWS)
        print(f"| {key} | {s['nodes']} | {s['kernels']} | {s['kernels'] / args.layers:.1f} | {top[:220]} |")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
