"""What one forward carrying the decoding rows and a prompt's piece (daemon/engine/prefill/mixed_forward.py)
saves against the step the worker runs today (the batch's forward, then the piece's own).

    .venv/bin/python bench/mixed_step_bench.py                                  # B = 3, L = 1, 4, 8, 16, 32
    .venv/bin/python bench/mixed_step_bench.py --rows 1 3 --lengths 4 16 --rounds 6 --json out.json

Per (B rows, L tokens), arms alternated A B C, C B A, ... over --rounds rounds, each round on
fresh state (B rows whose prompts are 300-500 tokens, merged as the continuous batch merges them;
a prompt with 300 tokens in its cache), each arm --iters iterations:
- "decode": the batch's step alone (forward, logits, argmax, evaluated): a quiet iteration;
- "alone": that step issued, then the piece's forward, both evaluated (today's paced iteration);
- "mixed": one mixed_hidden over both groups, then the decode rows' logits and argmax.
Reported: median ms per iteration and spread, alone/mixed (median of the per-round ratios), and
each arm's iteration in quiet iterations (what the prefill pacer's bound,
``scheduler.decode_gap_bound``, is counted in). Every round also checks that the mixed arm's
tokens are the alone arm's ("identical"). Prints markdown; --json writes the rows.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402

from daemon.engine.model.loading import load_model  # noqa: E402
from daemon.engine.prefill.mixed_forward import mixed_hidden  # noqa: E402
from daemon.engine.prefill.prefill import prefill  # noqa: E402
from daemon.paths import BUNDLED_MODEL  # noqa: E402

ARMS = ("decode", "alone", "mixed")


def make_state(lm, B: int, L: int, iters: int, rng: random.Random):
    V = lm.text_args.vocab_size
    rows = []
    for _ in range(B):
        c = lm.make_cache()
        rows.append((c, prefill(lm, [rng.randrange(V) for _ in range(rng.choice((300, 400, 500)))], c)))
    batch = [type(layer[0]).merge(list(layer)) for layer in zip(*[c for c, _ in rows])]
    toks = mx.concatenate([last for _, last in rows])[:, None]
    piece_cache = lm.make_cache()
    prefill(lm, [rng.randrange(V) for _ in range(301)], piece_cache)
    ids = mx.array([rng.randrange(V) for _ in range(L * iters)], dtype=mx.uint32)
    mx.eval(toks, [c.state for c in batch + piece_cache], ids)
    return toks, batch, piece_cache, ids


def run_arm(lm, arm: str, state, L: int, iters: int) -> tuple[float, list]:
    toks, batch, piece_cache, ids = state
    emitted = []
    t0 = time.perf_counter()
    for it in range(iters):
        piece = ids[it * L:(it + 1) * L][None]
        if arm == "mixed":
            hd, hp = mixed_hidden(lm, [(toks, batch), (piece, piece_cache)])
            toks = mx.argmax(lm.logits(hd)[:, -1], axis=-1).astype(mx.uint32)[:, None]
            mx.eval(toks, hp, [c.state for c in batch + piece_cache])
        else:
            hd = lm.hidden(toks, batch)
            toks = mx.argmax(lm.logits(hd)[:, -1], axis=-1).astype(mx.uint32)[:, None]
            if arm == "decode":
                mx.eval(toks, [c.state for c in batch])
            else:  # the worker's order: the batch's forward queued, then the piece's
                mx.async_eval(toks, [c.state for c in batch])
                hp = lm.hidden(piece, piece_cache)
                mx.eval(toks, hp, [c.state for c in batch + piece_cache])
        emitted.append(toks.reshape(-1).tolist())
    return (time.perf_counter() - t0) / iters * 1000, emitted


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(BUNDLED_MODEL))
    ap.add_argument("--rows", type=int, nargs="+", default=[3])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.rounds < 1 or args.iters < 1 or min(args.rows) < 1 or min(args.lengths) < 1:
        ap.error("--rows, --lengths, --rounds and --iters must be at least 1")
    lm = load_model(args.model)
    rng = random.Random(0)
    out = []
    print("| B | L | decode ms | alone ms | mixed ms | alone/mixed | alone in quiet iterations | mixed in quiet iterations | identical |")
    print("|---|---|---|---|---|---|---|---|---|")
    for B in args.rows:
        for L in args.lengths:
            ms = {a: [] for a in ARMS}
            identical = True
            for r in range(args.rounds):
                state = make_state(lm, B, L, args.iters, rng)
                tokens = {}
                for arm in (ARMS if r % 2 == 0 else ARMS[::-1]):
                    t, tokens[arm] = run_arm(lm, arm, copy.deepcopy(state), L, args.iters)
                    ms[arm].append(t)
                identical &= tokens["mixed"] == tokens["alone"] == tokens["decode"]
            ratio = [a / m for a, m in zip(ms["alone"], ms["mixed"])]
            med = {a: statistics.median(v) for a, v in ms.items()}
            row = {"rows": B, "piece": L, "rounds": args.rounds, "iters": args.iters, "identical": identical,
                   **{f"{a}_ms": round(med[a], 2) for a in ARMS},
                   **{f"{a}_spread_ms": round(max(v) - min(v), 2) for a, v in ms.items()},
                   "alone_over_mixed": round(statistics.median(ratio), 3),
                   "alone_over_mixed_range": [round(min(ratio), 3), round(max(ratio), 3)],
                   "alone_quiet": round(med["alone"] / med["decode"], 2),
                   "mixed_quiet": round(med["mixed"] / med["decode"], 2)}
            out.append(row)
            print(f"| {B} | {L} | {med['decode']:.1f} | {med['alone']:.1f} | {med['mixed']:.1f} | "
                  f"{row['alone_over_mixed']:.2f} ({min(ratio):.2f}-{max(ratio):.2f}) | {row['alone_quiet']:.2f} | "
                  f"{row['mixed_quiet']:.2f} | {identical} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "machine": platform.platform(),
                                               "mlx": mx.__version__, "device": str(mx.default_device()),
                                               "rows": out}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
