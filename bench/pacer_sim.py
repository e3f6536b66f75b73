"""The prefill pacer (daemon/engine_thread/prefill_pacer.py) fed a synthetic engine: what
pieces it gives, and in how many forwards a prompt's tail goes, under a cost model of one's
choosing. No mlx, no daemon: the pacer's own arithmetic against iterations that cost

    quiet(h) * (1 +- jitter)                      decoding only (h rows, a random walk 1..8)
    quiet(h) * (1 +- jitter) + fixed + b * n      decoding and prefilling n prompt tokens

with quiet(h) = --quiet-base + --quiet-row * h. A prompt of --prompt tokens arrives --gap
iterations after the last one finished. Defaults: a GPU-like engine (a forward's fixed part
6 ms, 0.03 ms a prompt token); --cpu: this project's CPU (fixed 10 ms, 4.6 ms a token, a quiet
iteration ~34 ms). One row per (jitter, walk) of the grid; JSON with --json.

    python bench/pacer_sim.py
    python bench/pacer_sim.py --cpu --json /tmp/pacer_sim_cpu.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from daemon.engine_thread.prefill_pacer import PrefillPacer  # noqa: E402


def simulate(args, jitter: float, walk: int, seed: int = 0) -> dict:
    rnd = random.Random(seed)
    pacer = PrefillPacer(bound=args.bound)
    pieces, forwards, left, height, next_prompt, count = [], [], 0, 4, 0, 0
    for i in range(args.iterations):
        if i % walk == 0:
            height = min(8, max(1, height + rnd.choice((-1, 1))))
        quiet = (args.quiet_base + args.quiet_row * height) * (1 + rnd.uniform(-jitter, jitter))
        if left == 0 and i >= next_prompt:
            left, count = args.prompt, 0
        n = 0
        if left:
            n = min(left, pacer.allowance(True, args.chunk))
            left -= n
            pieces.append(n)
            count += 1
            if left == 0:
                forwards.append(count)
                next_prompt = i + args.gap
        pacer.iteration_done(quiet + (args.fixed + args.per_token * n if n else 0.0), n, True)
    fit = pacer.to_dict()
    return {"jitter": jitter, "walk": walk, "median_piece": statistics.median(pieces),
            "forwards_per_prompt": statistics.median(forwards), "prompts": len(forwards),
            "fit": {k: fit[k] for k in ("quiet_ms", "iteration_ms", "prefill_token_ms", "error_ms", "fixed_piece")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="this project's CPU's costs instead of a GPU's")
    ap.add_argument("--bound", type=float, default=3.0)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=300, help="tokens of each prompt's tail")
    ap.add_argument("--gap", type=int, default=25, help="iterations between a prompt's end and the next")
    ap.add_argument("--iterations", type=int, default=3000)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.cpu:
        args.fixed, args.per_token, args.quiet_base, args.quiet_row = 0.010, 0.0046, 0.026, 0.002
    else:
        args.fixed, args.per_token, args.quiet_base, args.quiet_row = 0.006, 0.00003, 0.004, 0.002
    rows = [simulate(args, j, w) for j in (0.0, 0.1, 0.3) for w in (10, 3)]
    print("| jitter | height walk (iterations) | median piece | forwards a prompt | fit: quiet / intercept ms, "
          "ms a token, error ms, fixed piece |")
    print("|---|---|---|---|---|")
    for r in rows:
        f = r["fit"]
        print(f"| {r['jitter']} | {r['walk']} | {r['median_piece']} | {r['forwards_per_prompt']} | {f['quiet_ms']} / "
              f"{f['iteration_ms']}, {f['prefill_token_ms']}, {f['error_ms']}, {f['fixed_piece']} |")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "json"}, "rows": rows},
                                        indent=1))


if __name__ == "__main__":
    main()
