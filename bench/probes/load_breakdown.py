"""Where a model load's seconds go after the weights, phase by phase, in one process: the
first GPU op (context), mlx-lm's import, the lazy load, reading the weights, the fused
recurrence's self-check (twice: the first pays whatever compiles in this process, the second
is the check alone), merging the linears, and the first forwards. Run it with a PTX folder
that already holds MLX's modules (a second start) to see what a start pays beyond them: the
custom kernels (mx.fast.cuda_kernel), which MLX does not keep on disk, compile in every
process (issue 46).

    MLX_PTX_CACHE_DIR=/tmp/ptx-warm PYTHONPATH=$PWD python3 bench/probes/load_breakdown.py --json $OUT/load_breakdown.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

T0 = time.perf_counter()
phases: list[tuple[str, float]] = []


def phase(name: str, fn):
    t = time.perf_counter()
    out = fn()
    phases.append((name, round(time.perf_counter() - t, 3)))
    print(f"{name:40s} {phases[-1][1]:8.3f} s", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(REPO / "daemon/assets/tiny-qwen35"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    ptx = Path(os.environ.get("MLX_PTX_CACHE_DIR", "/nonexistent"))
    before = set(ptx.rglob("*.ptx")) if ptx.exists() else set()

    mx = phase("import mlx.core", lambda: __import__("mlx.core", fromlist=["core"]))
    phase("first GPU op (context, allocator)", lambda: mx.eval(mx.zeros((4,)) + 1))
    from daemon.frameworks import hide_unused_frameworks

    hide_unused_frameworks()
    mlx_lm = phase("import mlx_lm", lambda: __import__("mlx_lm"))
    from daemon.engine.kernels import gdn_fused, gdn_layer, merged_linears
    from daemon.engine.model import loading
    from daemon.engine.model.model import LoadedModel

    model, tok = phase("mlx_lm.load (lazy)", lambda: mlx_lm.load(args.model, lazy=True))
    phase("read the weights", lambda: loading._read_weights(model, None))
    config = json.loads((Path(args.model) / "config.json").read_text())
    lm = LoadedModel(model=model, tokenizer=tok, path=Path(args.model), config=config,
                     model_type=config.get("model_type", ""), eos_token_ids=frozenset())
    tm = lm.text_module
    first = phase("conv self-check, first", lambda: gdn_layer.conv_self_check(tm))
    phase("conv self-check, again", lambda: gdn_layer.conv_self_check(tm))
    if first is None:
        gdn_layer.install(tm, conv_recurrence=gdn_fused.gated_delta_conv_fused)
        phase("merge the linears", lambda: merged_linears.install(tm))
    cache = model.make_cache()
    ids = mx.array([[1, 2, 3, 4]])
    phase("first forward (4 tokens)", lambda: mx.eval(model(ids, cache=cache)))
    phase("first forward (1 token)", lambda: mx.eval(model(ids[:, :1], cache=cache)))
    phase("again (1 token)", lambda: mx.eval(model(ids[:, 1:2], cache=cache)))
    new = sorted(p.stem for p in (set(ptx.rglob("*.ptx")) if ptx.exists() else set()) - before)
    print(f"conv self-check: {first or 'passed'}; MLX modules compiled here: {len(new)} {new[:8]}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"mlx": mx.__version__, "device": str(mx.default_device()),
                                         "phases": phases, "conv_self_check": first, "compiled_modules": new,
                                         "command": sys.argv}, indent=1))


if __name__ == "__main__":
    main()
