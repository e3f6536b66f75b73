"""Council throughput and interactive latency through the real daemon.

Two daemons on the same model, one with continuous batching (the default) and one without
(`scheduler.batching = false`: active streams are time-sliced, one forward per stream).
Per round, for each arm in turn (ABAB):
  - aggregate tokens/s with 1, 2, 4, 8 concurrent streams (each its own client and seat,
    `--tokens` tokens, speculation off so only the scheduling differs);
  - time to first token of an interactive request, alone and behind 8 background streams.
Prints a markdown table (median and min-max over rounds) and writes JSON.

    .venv/bin/python bench/council_bench.py --rounds 3 --json bench/results/council_cpu.json
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from daemon.measure.bench_io import spread, write_results  # noqa: E402
from protocol.client import Client  # noqa: E402

PROMPTS = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n", "import os\n\n\ndef walk(path):\n",
           "def parse(line):\n"]


def start(model: str, batching: bool, tmp: Path) -> tuple[subprocess.Popen, str]:
    runtime = tmp / ("batch" if batching else "slice")
    runtime.mkdir(mode=0o700)
    cfg = runtime / "councild.toml"
    cfg.write_text(f"[scheduler]\nbatching = {'true' if batching else 'false'}\nmax_active = 8\n"
                   "[scheduler.seats.chat]\npriority = \"interactive\"\n"
                   "[scheduler.seats.bg]\npriority = \"background\"\n")
    endpoint = f"ipc://{runtime / 'councild.sock'}"
    log = open(runtime / "daemon.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "daemon.cli", "serve", "--model", model, "--endpoint", endpoint,
                             "--config", str(cfg), "--log-format", "json"], cwd=REPO, stdout=log, stderr=log,
                            env=dict(os.environ, COUNCILD_RUNTIME_DIR=str(runtime)))
    from daemon.demo import wait_ready

    wait_ready(endpoint, proc)
    return proc, endpoint


def aggregate(endpoint: str, n: int, tokens: int) -> float:
    """n clients stream at once; tokens/s over the span from first send to last Done."""
    done = []
    barrier = threading.Barrier(n)

    def one(i: int) -> None:
        with Client(endpoint, seat=f"s{i}", timeout_s=120) as c:
            barrier.wait()
            d = c.complete(PROMPTS[i % len(PROMPTS)], max_tokens=tokens, speculation="off")
            done.append((time.monotonic(), d.usage.completion_tokens))

    t0 = time.monotonic()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(k for _, k in done) / (max(t for t, _ in done) - t0)


def interactive_ttft(endpoint: str, background: int, tokens: int) -> float:
    with Client(endpoint, seat="bg", timeout_s=120) as bg, Client(endpoint, seat="chat", timeout_s=120) as fg:
        streams = [bg.generate(PROMPTS[i % len(PROMPTS)], max_tokens=tokens * 4, speculation="off")
                   for i in range(background)]
        if background:
            time.sleep(0.5)  # the background work is decoding
        ttft = fg.complete("def main():", max_tokens=8).timings.ttft_s
        for s in streams:
            s.cancel()
        for s in streams:
            s.result()
    return ttft


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "daemon/assets/tiny-qwen35"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--streams", default="1,2,4,8")
    ap.add_argument("--json", default="bench/out/council.json")
    args = ap.parse_args(argv)
    counts = [int(x) for x in args.streams.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="council-bench-"))
    arms = {}
    try:
        for name, batching in (("batched", True), ("time-sliced", False)):
            arms[name] = start(args.model, batching, tmp)
        results = {a: {"tok_s": {n: [] for n in counts}, "ttft_idle": [], "ttft_loaded": []} for a in arms}
        for r in range(args.rounds + 1):  # round 0 warms up
            for name, (_, ep) in arms.items():
                for n in counts:
                    v = aggregate(ep, n, args.tokens)
                    if r:
                        results[name]["tok_s"][n].append(v)
                idle = interactive_ttft(ep, 0, args.tokens)
                loaded = interactive_ttft(ep, 8, args.tokens)
                if r:
                    results[name]["ttft_idle"].append(idle)
                    results[name]["ttft_loaded"].append(loaded)
            print(f"round {r}/{args.rounds}" + (" (warm-up)" if r == 0 else ""), file=sys.stderr, flush=True)
    finally:
        for proc, _ in arms.values():
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    out = {"benchmark": "council", "model": args.model, "tokens": args.tokens, "rounds": args.rounds,
           "machine": platform.platform(), "command": " ".join([sys.executable, *sys.argv]),
           "arms": {a: {"tok_s": {str(n): spread(v) for n, v in res["tok_s"].items()},
                        "ttft_idle_s": spread(res["ttft_idle"]), "ttft_loaded_s": spread(res["ttft_loaded"])}
                    for a, res in results.items()}}
    print("\n| streams | batched tok/s (min-max) | time-sliced tok/s (min-max) | ratio |\n|---|---|---|---|")
    for n in counts:
        b, s = out["arms"]["batched"]["tok_s"][str(n)], out["arms"]["time-sliced"]["tok_s"][str(n)]
        print(f"| {n} | {b['median']:.1f} ({b['min']:.1f}-{b['max']:.1f}) | {s['median']:.1f} "
              f"({s['min']:.1f}-{s['max']:.1f}) | {b['median'] / s['median']:.2f}x |")
    print("\n| arm | interactive TTFT idle, ms | behind 8 background streams, ms |\n|---|---|---|")
    for a in arms:
        i, lo = out["arms"][a]["ttft_idle_s"], out["arms"][a]["ttft_loaded_s"]
        print(f"| {a} | {i['median'] * 1000:.0f} ({i['min'] * 1000:.0f}-{i['max'] * 1000:.0f}) | "
              f"{lo['median'] * 1000:.0f} ({lo['min'] * 1000:.0f}-{lo['max'] * 1000:.0f}) |")
    write_results(out, "", args.json, None)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
