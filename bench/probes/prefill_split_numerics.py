"""Does splitting a prefill differently change the state? (OPERATIONS.md, Prefix cache.)

Prefills one random prompt on the chunk grid (``--chunk``), then ``--plans`` random split
plans of the same tokens: forwards of 2-399 tokens through ``prefill_hidden`` mixed with
one-token decode steps (``hidden``, the decode path: compiled where the daemon compiles
it), and compares every layer's filled state (attention KV up to its offset, GatedDeltaNet
conv and recurrent state) and the next step's logits bit for bit. This is what decides
whether prefix-cache snapshots at any token are exact (``splits_agree`` probes a few fixed
plans at start-up); here, many.

    .venv/bin/python bench/probes/prefill_split_numerics.py --json bench/results/prefill_split_numerics_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from daemon.engine.model.loading import load_model  # noqa: E402
from daemon.engine.caches.prefix_cache import filled_arrays  # noqa: E402
from daemon.paths import BUNDLED_MODEL  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(BUNDLED_MODEL))
    ap.add_argument("--tokens", type=int, default=1400)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--plans", type=int, default=12)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json")
    args = ap.parse_args()
    lm = load_model(args.model)
    rng = random.Random(args.seed)
    n = args.tokens
    vocab = lm.text_args.vocab_size
    ids = mx.array([rng.randrange(1, vocab) for _ in range(n + 1)], dtype=mx.uint32)

    def run(plan: list[int]) -> list:
        cache, pos = lm.make_cache(), 0
        for m in plan:
            f = lm.hidden if m == 1 else lm.prefill_hidden
            mx.eval(f(ids[None, pos : pos + m], cache), [c.state for c in cache])
            pos += m
        out = filled_arrays(cache) + [lm.logits(lm.hidden(ids[None, n : n + 1], cache))]
        mx.eval(out)
        return out

    grid = [min(args.chunk, n - p) for p in range(0, n, args.chunk)]
    t0 = time.perf_counter()
    ref = run(grid)
    rows = []
    for i in range(args.plans):
        plan, pos = [], 0
        while pos < n:
            m = min(1 if rng.random() < 0.3 else rng.randrange(2, 400), n - pos)
            plan.append(m)
            pos += m
        got = run(plan)
        same = len(got) == len(ref) and all(a.shape == b.shape and mx.array_equal(a, b).item() for a, b in zip(got, ref))
        diff = max(float(mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32))).item())
                   for a, b in zip(got, ref) if a.shape == b.shape)
        rows.append({"plan": i, "forwards": len(plan), "decode_steps": plan.count(1),
                     "largest_forward": max(plan), "bit_identical": same, "max_abs_diff": diff})
        print(rows[-1], flush=True)
    summary = {"plans": len(rows), "bit_identical": sum(r["bit_identical"] for r in rows),
               "seconds": round(time.perf_counter() - t0, 1), "decode_path": lm.decode_path,
               "chunked_prefill": lm.chunked_prefill, "kernels": lm.kernels, "device": str(mx.default_device()),
               "mlx": mx.__version__, "platform": platform.platform()}
    print(summary)
    if args.json:
        Path(args.json).write_text(json.dumps({"command": "python bench/probes/prefill_split_numerics.py " + " ".join(sys.argv[1:]),
                                               "args": vars(args), "summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
