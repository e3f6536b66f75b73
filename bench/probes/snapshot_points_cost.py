"""What the prefix cache's extra snapshot points cost a cold prefill (in process, bundled model).

A cold prefill of a ``--tokens``-token random prompt on the chunk grid, storing a snapshot at
each of its snapshot points: ``new``, the points ``PrefixCache.boundaries`` takes now where
splits are exact (the prompt's last two grid points and its exact end); ``old``, the exact
end only (as at 323d015). The arms alternate (ABBA...); reported: the whole prefill's time
and the stores' share, per round. The chunks forwarded are the same in both (the grid points
are where the cold run's chunks end anyway), so what differs is the stores' copies.

    .venv/bin/python bench/probes/snapshot_points_cost.py --rounds 4 --json bench/results/snapshot_points_cost_cpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from daemon.engine.model.loading import load_model  # noqa: E402
from daemon.engine.prefill.prefill import ChunkedPrefill  # noqa: E402
from daemon.engine.caches.prefix_cache import PrefixCache  # noqa: E402
from daemon.paths import BUNDLED_MODEL  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2398)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json")
    args = ap.parse_args()
    lm = load_model(str(BUNDLED_MODEL))
    rng = random.Random(0)
    rows = []
    for rnd in range(args.rounds):
        for arm in ("old", "new") if rnd % 2 == 0 else ("new", "old"):
            prompt = [rng.randrange(1, lm.text_args.vocab_size) for _ in range(args.tokens)]
            pc = PrefixCache(1 << 40, args.chunk, splits_exact=True)
            points = pc.boundaries(len(prompt), 0) if arm == "new" else {len(prompt) - 1}
            pre = ChunkedPrefill(lm, prompt, args.chunk, lm.make_cache(), stops=points)
            t0, stores, forwards = time.perf_counter(), 0.0, 0
            while not pre.done:
                pre.step()
                forwards += 1
                if pre.pos in points:
                    t1 = time.perf_counter()
                    pc.store(prompt[: pre.pos], pre.cache, None)
                    stores += time.perf_counter() - t1
            rows.append({"round": rnd, "arm": arm, "points": sorted(points), "forwards": forwards,
                         "prefill_s": round(time.perf_counter() - t0, 3), "stores_ms": round(stores * 1000, 1),
                         "snapshot_bytes": pc.nbytes})
            print(rows[-1], flush=True)
    summary = {}
    for arm in ("old", "new"):
        rs = [r for r in rows if r["arm"] == arm]
        summary[arm] = {"prefill_s_median": statistics.median(r["prefill_s"] for r in rs),
                        "stores_ms_median": statistics.median(r["stores_ms"] for r in rs),
                        "snapshot_bytes": rs[0]["snapshot_bytes"]}
    paired = [n["prefill_s"] / o["prefill_s"] for o, n in zip([r for r in rows if r["arm"] == "old"],
                                                             [r for r in rows if r["arm"] == "new"])]
    summary["new_over_old_per_round"] = [round(x, 3) for x in paired]
    print(summary)
    if args.json:
        Path(args.json).write_text(json.dumps({"command": "python bench/probes/snapshot_points_cost.py " + " ".join(sys.argv[1:]),
                                               "args": vars(args), "summary": summary, "rows": rows,
                                               "platform": platform.platform()}, indent=1))


if __name__ == "__main__":
    main()
