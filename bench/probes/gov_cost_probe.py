"""Does the daemon's measured cost of a depth-k cycle match the engine's, first use vs warm?
Pin depth 0, 1, 2 (fast rows), each twice, solo and 4 concurrent rows; print the cost
model's per-depth (solo) and per-height tables after each phase.

    PYTHONPATH=$PWD python3 bench/probes/gov_cost_probe.py [--config 'cudnn_attention = true']
    (from the repository root; --config adds top-level TOML lines to the daemon's config)

Result on the H200: bench/results/h200_2026-12-02/gov_cost_probe.txt."""
import argparse
import json
import pathlib
import sys
import tempfile
import time

sys.path[:0] = ["tests/e2e", "tests", "."]
from e2e_harness import start_daemon, wait_ready  # noqa: E402
from daemon.paths import BUNDLED_MODEL  # noqa: E402
from protocol.client import Client  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description="pin depths 0-2 solo and 4 rows; print the governor's cost tables")
    ap.add_argument("--config", default="", help="top-level TOML lines for the daemon's config")
    args = ap.parse_args()
    t0 = time.time()
    d = start_daemon(pathlib.Path(tempfile.mkdtemp()), BUNDLED_MODEL,
                     config=args.config + "\n[scheduler]\nmax_active = 4\n", wait=False)
    wait_ready(d, 400)
    print(f"config {args.config!r}: started in {time.time()-t0:.1f}s", flush=True)
    prompts = ["def fibonacci(n):\n", "The council met at dawn to decide", "import os\nimport sys\n", "class Council:\n"]

    def run(tag, depth, n, tokens=128):
        with Client(d.endpoint, seat="obs", timeout_s=300) as c:
            assert c.governor("pin_depth", depth).ok
            t = time.time()
            ss = [c.generate(prompts[i % 4] + f"# {tag}\n", max_tokens=tokens, speculation="fast") for i in range(n)]
            toks = sum(s.result().usage.completion_tokens for s in ss)
            wall = time.time() - t
            time.sleep(0.3)
            cm = c.status().detail["governor"]["cost_model"]
            solo = [(x["depth"], x["cost_s"] and round(x["cost_s"] * 1e3, 2), x["samples"]) for x in cm["depths"][:3]]
            hs = {h["heights"]: [(x["depth"], x["cost_s_per_row"] and round(x["cost_s_per_row"] * 1e3, 2), x["samples"]) for x in h["depths"][:3]] for h in cm["heights"] if h["cycles"]}
            print(f"{tag} rows={n} pin {depth}: {toks/wall:.1f} tok/s; solo ms {solo}; per-row ms {json.dumps(hs)}", flush=True)
    for rep in ("first", "again"):
        for n in (1, 4):
            for depth in (0, 1, 2):
                run(f"{rep}", depth, n)
    d.stop()


if __name__ == "__main__":
    main()
