"""What a prompt piece of a token count never seen before costs, against the same count again.

A council's prompts end where they end: every request's last prefill forward (and every
prompts-together forward) has a token count of its own. If MLX's backend pays a per-shape
cost at first use (a matmul plan, a CUDA graph's capture and instantiation, a kernel variant),
every request pays it, and a benchmark whose later rounds repeat the first round's lengths
hides it there. This measures it on the bundled model with the daemon's own loader and
prefill forward (engine/model: chunked GatedDeltaNet prefill and fused kernels where the
platform uses them), each arm in a fresh process (MLX reads its switches once):

  daemon     the switches the daemon sets (backend_env.configure: cuDNN attention off, ...)
  no-graphs  the same with MLX_USE_CUDA_GRAPHS=0 (is the cost the graphs'?)

In each: a warm-up (lengths 256, 100, 17, 3 on a cache 256 tokens deep: MLX's modules are
compiled by op graph, not size, so this leaves only per-size costs), then for each of --new
token counts never run before: a forward of that many tokens on a fresh cache holding 256
tokens (the daemon's second chunk), timed synced ("new"), then the same count again ("warm");
then one bf16 matmul at the model's MLP shape with M = each count, new and again (the plan
cost alone); then ("prewarmed") --new more counts, each first forwarded once on an empty cache
by the daemon's prefill_lengths part (engine_thread/warmup.prefill_each_length), then at depth
256 and again: what of the first-use cost that part takes away; then ("new_depth") the first
counts, warm, at a cache depth never run and again: the attention's per-depth share, which
no warm-up covers. Medians, ms.

    PYTHONPATH=$PWD python3 bench/probes/prefill_length_first_use.py --json $OUT/prefill_length_first_use.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.probe_child import parse_or_answer, run_child  # noqa: E402

ARMS = ("daemon", "no-graphs")
WARM_LENGTHS = (256, 100, 17, 3)
DEPTH = 256  # tokens already in the cache: the piece is a prompt's second chunk


def _child(args) -> dict:
    import mlx.core as mx

    from daemon.engine.model.loading import load_model
    from daemon.engine_thread import warmup
    from daemon.paths import BUNDLED_MODEL

    lm = load_model(BUNDLED_MODEL)
    vocab = 1000

    def primed_cache(depth: int):
        cache = lm.make_cache()
        lm.prefill_hidden(mx.arange(5, 5 + depth, dtype=mx.uint32)[None] % vocab, cache)
        mx.eval([c.state for c in cache])
        mx.synchronize()
        return cache

    def forward_ms(n: int, depth: int = DEPTH) -> float:
        cache = primed_cache(depth)
        ids = (mx.arange(n, dtype=mx.uint32)[None] * 7 + 11) % vocab
        t = time.perf_counter()
        h = lm.prefill_hidden(ids, cache)
        mx.eval(h, [c.state for c in cache])
        mx.synchronize()
        return (time.perf_counter() - t) * 1e3

    def matmul_ms(m: int, w: mx.array) -> float:
        x = mx.random.normal((m, w.shape[0])).astype(mx.bfloat16)
        mx.eval(x)
        mx.synchronize()
        t = time.perf_counter()
        mx.eval(x @ w)
        mx.synchronize()
        return (time.perf_counter() - t) * 1e3

    for n in WARM_LENGTHS:
        forward_ms(n)
        forward_ms(n)
    rng = random.Random(args.seed)
    seen = set(WARM_LENGTHS)

    def unseen_counts() -> list[int]:
        out = []
        while len(out) < args.new:
            n = rng.randint(4, 255)
            if n not in seen:
                seen.add(n)
                out.append(n)
        return out

    counts = unseen_counts()
    rows = [{"tokens": n, "new_ms": forward_ms(n), "warm_ms": forward_ms(n)} for n in counts]
    # The daemon's remedy (the prefill_lengths part): each count forwarded once on an empty
    # cache, by the function the part runs; then the count at depth DEPTH, new there, and again.
    prewarmed = []
    for n in unseen_counts():
        warmup.prefill_each_length(lm, [n], chunk=256, head=None)
        mx.synchronize()
        prewarmed.append({"tokens": n, "new_ms": forward_ms(n), "warm_ms": forward_ms(n)})
    # A count already warm at a cache depth never run: attention's per-depth share.
    depths = rng.sample(range(DEPTH + 1, 4 * DEPTH), len(counts))
    new_depth = [{"tokens": n, "depth": d, "new_ms": forward_ms(n, d), "warm_ms": forward_ms(n, d)}
                 for n, d in zip(counts, depths)]
    config = json.loads((Path(BUNDLED_MODEL) / "config.json").read_text())
    w = mx.random.normal((config["hidden_size"], config["intermediate_size"])).astype(mx.bfloat16)
    mx.eval(w)
    matmul_ms(256, w), matmul_ms(256, w)
    mm_counts = [n + 300 for n in counts]  # M values no forward above used
    mm = [{"m": m, "new_ms": matmul_ms(m, w), "warm_ms": matmul_ms(m, w)} for m in mm_counts]
    return {"device": str(mx.default_device()), "env": {k: v for k, v in os.environ.items() if k.startswith("MLX_")},
            "forwards": rows, "matmuls": mm, "prewarmed": prewarmed, "new_depth": new_depth}


def _env(arm: str) -> dict:
    from daemon.engine.jit import backend_env

    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_") or k == backend_env.PTX_CACHE_DIR}
    backend_env.configure(False, None, env)
    if arm == "no-graphs":
        env["MLX_USE_CUDA_GRAPHS"] = "0"
    return env


def _summary(rows: list[dict]) -> dict:
    new = [r["new_ms"] for r in rows]
    warm = [r["warm_ms"] for r in rows]
    return {"new_median_ms": statistics.median(new), "warm_median_ms": statistics.median(warm),
            "new_over_warm": statistics.median(n / w for n, w in zip(new, warm)),
            "new_range_ms": [min(new), max(new)], "warm_range_ms": [min(warm), max(warm)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--new", type=int, default=16, help="token counts never run before, per arm")
    ap.add_argument("--seed", type=int, default=0)
    args = parse_or_answer(ap, _child)
    if args is None:
        return
    results = {}
    print("| arm | what | new: median ms (range) | again: median ms (range) | new / again (median of pairs) |")
    print("|---|---|---|---|---|")
    for i, arm in enumerate(args.arms.split(",")):
        r = results[arm] = run_child(__file__, ["--new", str(args.new), "--seed", str(args.seed + i)], _env(arm))
        if "error" in r:
            continue
        r["summary"] = {what: _summary(r[what]) for what in ("forwards", "matmuls", "prewarmed", "new_depth")}
        for what, s in r["summary"].items():
            print(f"| {arm} | {what} | {s['new_median_ms']:.2f} ({s['new_range_ms'][0]:.2f}-{s['new_range_ms'][1]:.2f}) "
                  f"| {s['warm_median_ms']:.2f} ({s['warm_range_ms'][0]:.2f}-{s['warm_range_ms'][1]:.2f}) "
                  f"| {s['new_over_warm']:.2f}x |", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"command": " ".join(sys.argv), "arms": results}, indent=1))


if __name__ == "__main__":
    main()
