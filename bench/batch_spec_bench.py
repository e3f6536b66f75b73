"""Speculation inside the continuous batch vs the batch at depth 0 (bundled model; any backend).

    PYTHONPATH=. .venv/bin/python bench/batch_spec_bench.py --heights 2 4 --depths 1 2 --tokens 48 --rounds 3

For each batch height B, arms run interleaved (A B C ... A B C ...) for --rounds rounds,
each decoding the same B greedy rows (mixed prompts) for --tokens tokens per row, prefill
outside the timed region:
- batch d0: BatchDecoder (daemon/engine/decoders/batch.py), one batched forward per token (what a
  busy council got before: every row at depth 0);
- spec d0: SpecBatchDecoder at depth 0 (the new decoder's own overhead, no drafts; its next
  cycle is queued before the host reads this one, as batch d0's is);
- spec d0 unpipelined (with --unpipelined): the same without that (every cycle read before
  the next is built), the "before" arm of the pipelining;
- spec dK: SpecBatchDecoder at depth K (rows draft with the MTP head, one verify per cycle).
Aggregate tokens/s per arm, median and range over rounds, and the per-round ratio of each
arm to "batch d0" (median and range). Every arm's tokens are checked equal to batch d0's
(all greedy; on CPU batched rows are serial's). Prints markdown, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402

from daemon.engine.decoders.batch import BatchDecoder  # noqa: E402
from daemon.engine.decoders.batch_spec import SpecBatchDecoder  # noqa: E402
from daemon.engine.model.loading import load_model  # noqa: E402
from daemon.engine.model.mtp_head import load_mtp_head  # noqa: E402
from daemon.engine.decoders.sampling import Sampler  # noqa: E402
from daemon.engine.types import SamplingParams  # noqa: E402
from daemon.paths import BUNDLED_MODEL  # noqa: E402

TEXTS = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n", "import os\n\n\ndef walk(path):\n",
         "# sort a list\ndef quicksort(items):\n", "for i in range(10):\n    print(", "import json\n\nclass Encoder:",
         "def load(path):\n    with open(path) as f:", "x = [1, 2, 3]\n"]


def run_arm(lm, head, arm: str, prompts: list[list[int]], tokens: int, exact: bool = True) -> tuple[float, dict]:
    """Returns (aggregate tokens/s, {row: tokens})."""
    if arm == "batch d0":
        bd = BatchDecoder(lm, max_rows=len(prompts))
        for i, p in enumerate(prompts):
            bd.add(i, Sampler(SamplingParams()), p, exact=exact)
    else:
        k = int(arm.split(" ")[1][1:])
        bd = SpecBatchDecoder(lm, lambda: head, lambda B, k=k: k, max_rows=len(prompts),
                              pipeline="unpipelined" not in arm)
        for i, p in enumerate(prompts):
            bd.add(i, Sampler(SamplingParams()), p, exact=exact)
    got = {i: [] for i in range(len(prompts))}
    t0 = time.perf_counter()
    while min(len(v) for v in got.values()) < tokens:
        for r, out in bd.step().items():
            got[r] += [out] if isinstance(out, int) else out.tokens
    dt = time.perf_counter() - t0
    produced = sum(len(v) for v in got.values())
    return produced / dt, {r: v[:tokens] for r, v in got.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(BUNDLED_MODEL))
    ap.add_argument("--heights", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=str(ROOT / "bench/results/batch_spec_cpu.json"))
    ap.add_argument("--fast", action="store_true",
                    help="rows in the fast configuration (for backends whose batched kernels round unlike M=1, "
                         "where exact rows do not batch): tokens that differ from batch d0 are counted, not refused")
    ap.add_argument("--unpipelined", action="store_true",
                    help='add the arm "spec d0 unpipelined": the speculating batch at depth 0 without the cycle '
                         "issued ahead (before/after of the pipelining, in the same run)")
    args = ap.parse_args(argv)

    lm = load_model(args.model)
    head = load_mtp_head(lm)
    arms = ["batch d0", "spec d0"] + (["spec d0 unpipelined"] if args.unpipelined else []) + [
        f"spec d{k}" for k in args.depths]
    results = []
    for B in args.heights:
        prompts = [lm.tokenizer.encode(TEXTS[i % len(TEXTS)]) for i in range(B)]
        rates = {a: [] for a in arms}
        ref = None
        differ = {a: 0 for a in arms}
        for _ in range(args.rounds):
            for a in arms:
                rate, toks = run_arm(lm, head, a, prompts, args.tokens, exact=not args.fast)
                if ref is None:
                    ref = toks
                if args.fast:  # flips allowed: count rows whose tokens differ from batch d0's
                    differ[a] += sum(toks[r] != ref[r] for r in ref)
                else:
                    assert toks == ref, f"{a} at B={B} decoded other tokens than batch d0"
                rates[a].append(rate)
        for a in arms:
            ratios = [x / y for x, y in zip(rates[a], rates["batch d0"])]
            results.append({"height": B, "arm": a, "tokens_per_s": rates[a],
                            "median_tokens_per_s": statistics.median(rates[a]),
                            "ratio_vs_batch_d0": ratios, "median_ratio": statistics.median(ratios),
                            "rows_differing_from_batch_d0": differ[a] if args.fast else 0})
    print(f"batched speculation, {Path(args.model).name}, {platform.machine()}, {mx.default_device()}, "
          f"{args.tokens} tokens/row, {args.rounds} rounds interleaved" + (", fast rows" if args.fast else "") + "\n")
    print("| rows | arm | tokens/s median (range) | vs batch d0: median (range) |")
    print("|---|---|---|---|")
    for r in results:
        t, q = r["tokens_per_s"], r["ratio_vs_batch_d0"]
        print(f"| {r['height']} | {r['arm']} | {r['median_tokens_per_s']:.1f} ({min(t):.1f}-{max(t):.1f}) | "
              f"{r['median_ratio']:.2f}x ({min(q):.2f}-{max(q):.2f}) |")
    paired = []
    if args.unpipelined:  # the pipelining's own gain: per round, spec d0 over spec d0 unpipelined
        print("\n| rows | spec d0 vs spec d0 unpipelined: median (range) |\n|---|---|")
        for B in args.heights:
            on, off = ([r for r in results if r["height"] == B and r["arm"] == a][0]["tokens_per_s"]
                       for a in ("spec d0", "spec d0 unpipelined"))
            q = [x / y for x, y in zip(on, off)]
            paired.append({"height": B, "ratios": q, "median": statistics.median(q)})
            print(f"| {B} | {statistics.median(q):.2f}x ({min(q):.2f}-{max(q):.2f}) |")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"model": args.model, "tokens": args.tokens, "rounds": args.rounds,
                                           "machine": platform.machine(), "results": results,
                                           "pipelined_vs_unpipelined": paired,
                                           "command": "PYTHONPATH=. python bench/batch_spec_bench.py "
                                           + " ".join(argv if argv is not None else sys.argv[1:])}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
