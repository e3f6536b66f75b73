"""Where the daemon's threads spend their active time while 8 streams decode over HTTP, by
py-spy's samples: per thread, its top leaf frames, and the engine thread's share in the send
that hands each message to the socket loop (engine_thread/worker.py ``_send``).

Why: on a GPU the decode step of a large model is host-bound, so whatever the engine thread
does besides building and encoding the step is the step's time. py-spy is not a dependency
of the project: install it where you like (``pip install py-spy``) and pass its path.

    PYTHONPATH=$PWD .venv/bin/python bench/probes/engine_send_share.py --py-spy /path/to/py-spy \
        --json bench/results/engine_send_share_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from bench.http_bench import PROMPTS, http_one  # noqa: E402
from bench.http_servers import start_councild_http, stop  # noqa: E402


async def load(port: int, rounds: int, streams: int, tokens: int) -> None:
    async with httpx.AsyncClient(timeout=300) as h:
        for _ in range(rounds):
            await asyncio.gather(*(http_one(h, f"http://127.0.0.1:{port}/v1/completions", "councild",
                                            PROMPTS[i % len(PROMPTS)], tokens, f"s{i}") for i in range(streams)))


def read(raw: Path) -> dict:
    """Per thread: samples, and its top leaf frames; the engine thread's samples in a send."""
    threads: collections.Counter = collections.Counter()
    leaves: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in raw.read_text().splitlines():
        if not line.strip():
            continue
        stack, n = line.rsplit(" ", 1)
        frames = stack.split(";")
        name = frames[0].split(": ", 1)[-1]
        threads[name] += int(n)
        leaves[name][frames[-1].split(" (")[0]] += int(n)
    engine = threads.get("councild-engine", 0)
    send = leaves["councild-engine"].get("Socket.send", 0)
    return {"threads": dict(threads), "top_leaves": {t: leaves[t].most_common(6) for t in threads},
            "engine_samples": engine, "engine_in_send": send, "engine_send_share": send / engine if engine else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--py-spy", default="py-spy")
    ap.add_argument("--model", default=str(REPO / "daemon/assets/tiny-qwen35"))
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seconds", type=int, default=15, help="py-spy's recording (the load runs meanwhile)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="engine-send-"))
    env = dict(os.environ, COUNCILD_RUNTIME_DIR=str(tmp / "run"))
    procs, _, port = start_councild_http(args.model, tmp, env, max_active=args.streams, timeout_s=180)
    try:
        asyncio.run(load(port, 1, args.streams, args.tokens))  # first uses, not recorded
        spy = subprocess.Popen([args.py_spy, "record", "--pid", str(procs[0].pid), "--duration", str(args.seconds),
                                "--threads", "--nonblocking", "--format", "raw", "-o", str(tmp / "raw.txt")])
        asyncio.run(load(port, args.rounds, args.streams, args.tokens))
        spy.wait()
    finally:
        stop(procs)
    res = read(tmp / "raw.txt")
    print(f"engine thread: {res['engine_samples']} active samples, {res['engine_in_send']} in Socket.send "
          f"({res['engine_send_share']:.1%})")
    for t, n in sorted(res["threads"].items(), key=lambda kv: -kv[1]):
        print(f"{n:6d}  {t}: " + ", ".join(f"{f} {c}" for f, c in res["top_leaves"][t][:4]))
    if args.json:
        Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv), **res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
