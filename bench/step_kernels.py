"""Where the GPU time of one decode step goes, per kernel, from Nsight Compute.

    ncu --metrics gpu__time_duration.sum --cache-control none --clock-control none --csv \\
        --log-file DIR/ncu.csv python3 bench/step_kernels.py --plan DIR/plan.json [--layers 8] [--shapes 1x1,4x1]
    python3 bench/step_kernels.py --report DIR     # joins plan.json and ncu.csv: tables + step_kernels.json

bench/step_split.py says a 27B-shaped decode step spends more GPU time than reading its
weights needs; this says on which kernels. The random 27B-shaped 4-bit model of
bench/gpu_bench.py, cut to ``--layers`` layers (a multiple of 4: the 27B pattern, three
GatedDeltaNet layers then one full-attention layer, repeats every 4; a layer's kernels take
the same time as in the 64-layer model), runs with the daemon's default kernel set on CUDA
("gdn+conv+merge+qmm", compiled, step_split.py's ``set_arm``). For each shape BxT: a 256-token
prompt, 3 unmeasured steps (the cache's first step, traces, kernel compiles), then exactly one
step between two marker kernels (bench/qmm_ncu.py's way of cutting ncu's CSV into cases).
Caches are not flushed (``--cache-control none``) and clocks are left alone: kernel times as
in a real step, back to back. No wall times: under ncu, which serializes and replays
kernels, they mean nothing.

The report groups each case's kernels by family (the tensor-core matmul, the GatedDeltaNet
kernel, norms, attention, fused elementwise, ...). With 8 or more layers it also finds the
repeating block of 4 layers in the kernel sequence and scales it to the 64-layer model
(what precedes and follows the layers, embedding, final norm, lm_head, argmax, counts once).

On a CPU (no markers, no ncu) ``--plan`` runs the same steps with MLX's kernels, as a smoke
test; ``--shape tiny`` (gpu_bench.py's small config of the same structure) makes it quick.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

import qmm_ncu  # noqa: E402  (its marker kernel and its reading of ncu's CSV)
from daemon.engine.kernels import invariant  # noqa: E402
from gpu_bench import QWEN35_27B, TINY, build_model, log, quantize_4bit  # noqa: E402
from step_split import set_arm  # noqa: E402

CONTEXT = 256
FULL_LAYERS = 64  # the 27B model's
BLOCK = 4  # layers in one repeat of the layer pattern (full_attention_interval)


# --- the profiled run --------------------------------------------------------------------

def make_marker():
    """qmm_ncu.py's marker kernel; a no-op where there is no CUDA (the CPU smoke test)."""
    return qmm_ncu.make_marker() if invariant.backend() == "cuda" else (lambda: None)


def build(shape: str, layers: int):
    """The random 4-bit model (27B-shaped or tiny) with ``layers`` layers, the default kernels
    installed."""
    cfg = QWEN35_27B if shape == "27b" else TINY
    lm, head, _inv = build_model(dict(cfg, num_hidden_layers=layers))
    quantize_4bit(lm, head)
    del head
    mx.clear_cache()
    # The custom kernels need CUDA; on a CPU the same steps with MLX's (the smoke test).
    kernels = "gdn+conv+merge+qmm" if invariant.backend() == "cuda" else "mlx"
    path = set_arm(lm, kernels, compiled=True)
    log(f"{shape}, {layers} layers, kernels {kernels}, {path}")
    return lm, kernels, path


def one_step(lm, B: int, T: int, mark) -> None:
    """Prefill, 3 unmeasured steps, then one step between two markers."""
    V = lm.text_args.vocab_size
    cache = make_prompt_cache(lm.text_module)
    mx.eval(lm.hidden(mx.random.randint(0, V, (B, CONTEXT)), cache))

    def step() -> None:
        toks = mx.random.randint(0, V, (B, T))
        mx.eval(toks)  # the tokens' kernel before the marker, not in the measured step
        mx.eval(mx.argmax(lm.logits(lm.hidden(toks, cache)[:, -1:]), axis=-1))

    for _ in range(3):
        step()
    mx.synchronize()
    mark()
    step()
    mx.synchronize()
    mark()
    del cache
    mx.clear_cache()


def run(plan_path: Path, shape: str, layers: int, shapes: list[tuple[int, int]]) -> None:
    if layers % BLOCK:
        raise SystemExit(f"--layers must be a multiple of {BLOCK} (the layer pattern's period)")
    mx.random.seed(0)
    lm, kernels, path = build(shape, layers)
    mark = make_marker()
    cases = []
    for B, T in shapes:
        one_step(lm, B, T, mark)
        cases.append(f"B{B}T{T}")
        log(f"case B{B}T{T} done")
    plan = {"shape": shape, "layers": layers, "context": CONTEXT, "kernels": kernels, "path": path,
            "backend": str(mx.default_device()), "cases": cases}
    plan_path.parent.mkdir(parents=True, exist_ok=True)
    plan_path.write_text(json.dumps(plan, indent=1))


# --- the report ----------------------------------------------------------------------------

def split_cases(rows: list[tuple[str, float]], n: int) -> list[list[tuple[str, float]]]:
    """Each case's kernels: between the (2i)th and (2i+1)th of the last 2n markers (anything
    before, the model's build and the prefills, falls outside the pairs)."""
    at = [i for i, (name, _) in enumerate(rows) if qmm_ncu.MARKER in name]
    if len(at) < 2 * n:
        raise SystemExit(f"{len(at)} markers in ncu.csv for {n} cases (need {2 * n})")
    if len(at) != 2 * n:
        print(f"warning: {len(at)} markers for {n} cases; using the last {2 * n}", file=sys.stderr)
    at = at[-2 * n:]
    return [rows[at[2 * i] + 1:at[2 * i + 1]] for i in range(n)]


# Fused elementwise kernels of mx.compile are named after their tape: per node a name, a dtype
# kind and size, the primitive ("Cf4Multiply", "Db2Add", ...; MLX's build_lib_name).
_FUSED = re.compile(r"(^|[^A-Za-z])[A-Z]{1,3}[fbiuc]\d{1,2}[A-Z][a-z]+")
FAMILIES = (  # first match wins: the custom kernels' names before the generic words
    (lambda n: "councild_qmm_mma" in n, "qmm (tensor-core matmul)"),
    (lambda n: "gated_delta" in n.lower() or "gdn" in n.lower(), "GatedDeltaNet kernel"),
    (lambda n: "rms" in n.lower(), "RMSNorm"),
    (lambda n: "sdpa" in n.lower() or "attention" in n.lower(), "attention"),
    (lambda n: "compiled" in n.lower() or _FUSED.search(n) is not None, "fused elementwise"),
    (lambda n: "copy" in n.lower(), "copy"),
    (lambda n: "gather" in n.lower() or "scatter" in n.lower(), "gather/scatter"),
)


def family(name: str) -> str:
    return next((fam for match, fam in FAMILIES if match(name)), name[:40])


def by_family(kernels: list[tuple[str, float]]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for name, us in kernels:
        f = out.setdefault(family(name), {"kernels": 0, "us": 0.0})
        f["kernels"] += 1
        f["us"] += us
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["us"]))


def layer_block(names: list[str], repeats: int) -> tuple[int, int] | None:
    """(start, length) of the longest run of ``repeats`` identical blocks of kernel names (the
    layers: each block is 4 of them); None where the sequence has no such run."""
    n = len(names)
    for b in range(n // repeats, 0, -1):
        for p in range(n - b * repeats + 1):
            if all(names[p + i] == names[p + i + b] for i in range(b * (repeats - 1))):
                return p, b
    return None


def scaled_to_full(kernels: list[tuple[str, float]], layers: int) -> dict | None:
    """The case's families in a 64-layer step: the kernels outside the layers once, a block of
    4 layers (their mean over the blocks) 16 times. Needs at least two blocks to find one."""
    repeats = layers // BLOCK
    if repeats < 2:
        return None
    found = layer_block([n for n, _ in kernels], repeats)
    if found is None:
        return None
    p, b = found
    blocks = kernels[p:p + b * repeats]
    outside = kernels[:p] + kernels[p + b * repeats:]
    per_block = FULL_LAYERS // BLOCK / repeats  # each measured block stands for this many
    full = by_family([(n, us) for n, us in outside] + [(n, us * per_block) for n, us in blocks])
    for f in full.values():  # counts of a 64-layer step
        f["kernels"] = 0
    for n, _ in outside:
        full[family(n)]["kernels"] += 1
    for n, _ in blocks:
        full[family(n)]["kernels"] += per_block
    return {"block_start": p, "block_kernels": b, "outside_kernels": len(outside),
            "block_us": sum(us for _, us in blocks) / repeats, "families": full}


def print_table(title: str, fams: dict[str, dict]) -> None:
    total_us = sum(f["us"] for f in fams.values())
    total_n = sum(f["kernels"] for f in fams.values())
    print(f"\n### {title}\n\n| family | kernels | total us | share | mean us/kernel |\n|---|---|---|---|---|")
    for name, f in fams.items():
        mean = f["us"] / f["kernels"] if f["kernels"] else float("nan")
        print(f"| {name} | {f['kernels']:g} | {f['us']:.1f} | {f['us'] / total_us:.1%} | {mean:.2f} |")
    print(f"\ntotal: {total_n:g} kernels, {total_us:.1f} us")


def report(folder: Path) -> int:
    plan = json.loads((folder / "plan.json").read_text())
    segments = split_cases(qmm_ncu.read_kernel_times(folder / "ncu.csv"), len(plan["cases"]))
    out = {"plan": plan, "cases": {}}
    print(f"{plan.get('shape', '27b')}, {plan['layers']} layers, kernels {plan['kernels']} ({plan['path']}), context {plan['context']}")
    for label, kernels in zip(plan["cases"], segments):
        fams = by_family(kernels)
        print_table(f"{label}: {plan['layers']} layers measured", fams)
        full = scaled_to_full(kernels, plan["layers"])
        if full is not None:
            print_table(f"{label}: scaled to {FULL_LAYERS} layers (block of {BLOCK} layers: "
                        f"{full['block_kernels']} kernels, {full['block_us']:.1f} us)", full["families"])
        elif plan["layers"] >= 2 * BLOCK:
            print(f"\n{label}: no repeating block of layers in the kernel sequence; not scaled")
        out["cases"][label] = {"kernels": [{"name": n, "family": family(n), "us": us} for n, us in kernels],
                               "total_us": sum(us for _, us in kernels), "families": fams,
                               f"scaled_{FULL_LAYERS}_layers": full}
    (folder / "step_kernels.json").write_text(json.dumps(out, indent=1))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plan", type=Path, help="run the steps (under ncu), writing the plan here")
    # The 27B model's random weights take over 15 minutes to build on a 2-core CPU: "tiny"
    # (gpu_bench.py's same-structure small config) is for the CPU smoke test.
    ap.add_argument("--shape", choices=("27b", "tiny"), default="27b")
    ap.add_argument("--layers", type=int, default=8, help=f"a multiple of {BLOCK}")
    ap.add_argument("--shapes", default="1x1,4x1", help="BxT, comma-separated")
    ap.add_argument("--report", type=Path, help="a folder with plan.json and ncu.csv")
    args = ap.parse_args(argv)
    if args.report:
        return report(args.report)
    if args.plan:
        run(args.plan, args.shape, args.layers, [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")])
        return 0
    ap.error("--plan or --report")
    return 2


if __name__ == "__main__":
    sys.exit(main())
