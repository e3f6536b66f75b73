"""`councild bench serial`: what the daemon costs over plain mlx-lm, measured interleaved.

Three arms decode the same prompts greedily for the same number of tokens:
  mlx_lm     mlx_lm.stream_generate in this process (the reference),
  engine     councild's serial engine in this process (daemon.engine.decoders.serial),
  daemon     a real `councild serve` child, over its ZeroMQ socket, with the client library.
Rounds run A B C A B C ... so drift on a shared machine hits every arm alike. Decode speed is
tokens after the first over the time from first to last token; time to first token is
reported separately (it includes the socket round trip and queueing for the daemon).
Prints a markdown table and writes JSON.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from daemon.measure.bench_io import spread, write_results

PROMPTS = [
    "def fibonacci(n):\n",
    "class Stack:\n    def __init__(self):\n",
    "import os\n\n\ndef walk(path):\n",
]


def _arm_mlx_lm(lm, prompt: str, n: int) -> tuple[float, float, int]:
    import mlx_lm

    t0 = time.perf_counter()
    times = []
    for _ in mlx_lm.stream_generate(lm.model, lm.tokenizer, prompt, max_tokens=n):
        times.append(time.perf_counter())
    return times[0] - t0, times[-1] - times[0], len(times)


def _arm_engine(lm, prompt: str, n: int) -> tuple[float, float, int]:
    from daemon.engine.decoders.sampling import Sampler
    from daemon.engine.decoders.serial import serial_decode
    from daemon.engine.types import SamplingParams

    t0 = time.perf_counter()
    ids = lm.encode_prompt(prompt, None, None)
    gen = serial_decode(lm, ids, Sampler(SamplingParams()))
    times = []
    for _ in range(n):
        next(gen)
        times.append(time.perf_counter())
    gen.close()
    return times[0] - t0, times[-1] - times[0], len(times)


def _arm_daemon(client, prompt: str, n: int) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    times, count = [], 0
    stream = client.generate(prompt, max_tokens=n, speculation="off")
    for _ in stream:
        times.append(time.perf_counter())
    count = stream.done.usage.completion_tokens
    # Chunks are per decode step (one token each when serial); eos may end it early.
    return times[0] - t0, times[-1] - times[0], count


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="councild bench serial", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model folder (default: the bundled model)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5; first is warm-up)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per generation (default 128)")
    ap.add_argument("--json", default="bench/out/serial.json", help="where to write the JSON result")
    args = ap.parse_args(argv)
    if args.rounds < 2:
        ap.error("--rounds must be at least 2 (the first round is a warm-up)")

    from daemon.paths import resolve_model
    from daemon.engine.model.loading import load_model
    from protocol.client import Client

    model = resolve_model(args.model)
    lm = load_model(model)
    runtime = Path(tempfile.mkdtemp(prefix="councild-bench-"))
    endpoint = f"ipc://{runtime / 'councild.sock'}"
    env = dict(os.environ, COUNCILD_RUNTIME_DIR=str(runtime))
    log = open(runtime / "daemon.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "daemon.cli", "serve", "--model", model, "--endpoint", endpoint,
                             "--log-format", "json", "--speculation", "off"], env=env, stdout=log, stderr=log)
    results: dict[str, dict[str, list[float]]] = {a: {"tok_s": [], "ttft_s": []} for a in ("mlx_lm", "engine", "daemon")}
    try:
        from daemon.demo import wait_ready

        wait_ready(endpoint, proc)
        client = Client(endpoint, seat="bench", timeout_s=60.0)
        arms = {
            "mlx_lm": lambda p: _arm_mlx_lm(lm, p, args.tokens),
            "engine": lambda p: _arm_engine(lm, p, args.tokens),
            "daemon": lambda p: _arm_daemon(client, p, args.tokens),
        }
        for r in range(args.rounds):
            for name, arm in arms.items():
                for prompt in PROMPTS:
                    ttft, span, count = arm(prompt)
                    if r == 0:
                        continue  # warm-up
                    results[name]["tok_s"].append((count - 1) / span if span > 0 else 0.0)
                    results[name]["ttft_s"].append(ttft)
            print(f"round {r + 1}/{args.rounds} done" + (" (warm-up)" if r == 0 else ""), file=sys.stderr)
        client.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)

    summary = {name: {k: spread(v) for k, v in arm.items()} for name, arm in results.items()}
    # Ratios per matched sample (same round, same prompt), then their median.
    def ratio(a: str, b: str) -> dict:
        return spread([x / y for x, y in zip(results[a]["tok_s"], results[b]["tok_s"])])

    ratios = {"engine/mlx_lm": ratio("engine", "mlx_lm"), "daemon/engine": ratio("daemon", "engine"),
              "daemon/mlx_lm": ratio("daemon", "mlx_lm")}
    extra_ttft = spread([d - e for d, e in zip(results["daemon"]["ttft_s"], results["engine"]["ttft_s"])])
    out = {
        "benchmark": "serial", "model": model, "tokens": args.tokens, "rounds": args.rounds - 1,
        "prompts": len(PROMPTS), "machine": platform.platform(), "python": platform.python_version(),
        "arms": summary, "ratios": ratios, "daemon_extra_ttft_s": extra_ttft,
    }
    try:
        import mlx.core as mx
        import mlx_lm

        out["versions"] = {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "device": str(mx.default_device())}
    except Exception:
        pass
    print("\n| arm | tok/s median | min | max | ttft median (ms) |\n|---|---|---|---|---|")
    for name, s in summary.items():
        t = s["tok_s"]
        print(f"| {name} | {t['median']:.1f} | {t['min']:.1f} | {t['max']:.1f} | {s['ttft_s']['median'] * 1000:.1f} |")
    print("\n| ratio | median | min | max |\n|---|---|---|---|")
    for name, s in ratios.items():
        print(f"| {name} | {s['median']:.3f} | {s['min']:.3f} | {s['max']:.3f} |")
    print(f"\ndaemon extra time to first token: median {extra_ttft['median'] * 1000:.1f} ms")
    write_results(out, "", args.json, None)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
