"""The HTTP front's CPU per token by server stack: uvicorn on uvloop + httptools (what
`councild http` runs where the http extra installed them) against asyncio + h11 (uvicorn's
pure-Python fallback), two fronts on one daemon, arms alternated batch by batch.

Why: a front is one process on one event loop; every streamed token is a ZeroMQ receive, an
SSE event and a socket write there, so its CPU per token sets the most tokens per second it
can carry (1 / that, per core). On a GPU several streams of a small model outrun what a slow
front carries; the daemon's speed then never reaches the client.

Per batch: ``--streams`` streaming completions at once through one front (temperature 0, the
same prompts and max_tokens in both arms, so both carry identical tokens), and the front
process's CPU seconds over the batch (psutil: user + system) per token delivered. Round 0 warms
both paths up and is not reported; the arms' order alternates by round.

    PYTHONPATH=$PWD .venv/bin/python bench/front_cost.py --rounds 6 --streams 8 --tokens 128 \\
        --json bench/results/front_cost_cpu.json --markdown bench/results/front_cost_cpu.md
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import psutil  # noqa: E402

from bench.http_bench import PROMPTS, http_one, summarise  # noqa: E402
from bench.http_servers import free_port, start_councild_http, stop, wait_http  # noqa: E402
from daemon.measure.bench_io import spread, write_results  # noqa: E402

# The fallback arm: the same app, uvicorn told to use asyncio's loop and h11.
PLAIN_FRONT = """
import sys, uvicorn
from front.config import load_http_config
from front.app import build_app
cfg, _ = load_http_config(sys.argv[1], {"port": int(sys.argv[3])})
uvicorn.run(build_app(cfg, sys.argv[2]), host=cfg.host, port=cfg.port, log_level="warning", access_log=False,
            lifespan="on", loop="asyncio", http="h11")
"""


def stack_of(proc: psutil.Process) -> str:
    """Which loop and HTTP parser the front process loaded (read from its memory maps)."""
    maps = " ".join(m.path for m in proc.memory_maps())
    return f"{'uvloop' if 'uvloop' in maps else 'asyncio'} + {'httptools' if 'httptools' in maps else 'h11'}"


async def batch(h: httpx.AsyncClient, port: int, streams: int, tokens: int, offset: int, proc: psutil.Process) -> dict:
    c0 = proc.cpu_times()
    rows = await asyncio.gather(*(http_one(h, f"http://127.0.0.1:{port}/v1/completions", "councild",
                                           PROMPTS[(offset + i) % len(PROMPTS)], tokens, f"s{i}")
                                  for i in range(streams)))
    c1 = proc.cpu_times()
    res = summarise(list(rows))
    res["front_cpu_us_per_token"] = ((c1.user + c1.system) - (c0.user + c0.system)) * 1e6 / max(1, res["tokens"])
    return res


async def bench(args, fronts: dict) -> dict:
    samples = {name: [] for name in fronts}
    names = list(fronts)
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=64)) as h:
        for r in range(args.rounds + 1):
            for name in (names if r % 2 == 0 else names[::-1]):
                port, proc = fronts[name]
                res = await batch(h, port, args.streams, args.tokens, r, proc)
                if r:
                    samples[name].append(res)
            print(f"round {r}/{args.rounds}" + (" (warm-up)" if r == 0 else ""), file=sys.stderr, flush=True)
    return samples


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "daemon/assets/tiny-qwen35"))
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--json", default="bench/out/front_cost.json")
    ap.add_argument("--markdown")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="front-cost-"))
    env = dict(os.environ, COUNCILD_RUNTIME_DIR=str(tmp / "run"))
    procs: list[subprocess.Popen] = []
    try:
        procs, endpoint, port = start_councild_http(args.model, tmp, env, max_active=max(4, args.streams), timeout_s=180)
        plain_port = free_port()
        plain = subprocess.Popen([sys.executable, "-c", PLAIN_FRONT, str(tmp / "councild.toml"), endpoint, str(plain_port)],
                                 cwd=REPO, env=env, stdout=open(tmp / "plain_front.log", "w"), stderr=subprocess.STDOUT)
        procs.append(plain)
        wait_http(f"http://127.0.0.1:{plain_port}/health", plain, timeout_s=60)
        fronts = {"councild http": (port, psutil.Process(procs[1].pid)), "asyncio + h11": (plain_port, psutil.Process(plain.pid))}
        stacks = {name: stack_of(p) for name, (_, p) in fronts.items()}
        samples = asyncio.run(bench(args, fronts))
    finally:
        stop(procs)

    out = {"benchmark": "front_cost", "model": args.model, "streams": args.streams, "tokens": args.tokens,
           "rounds": args.rounds, "machine": platform.platform(), "cpus": os.cpu_count(),
           "command": " ".join([Path(sys.executable).name, *sys.argv]), "stacks": stacks, "arms": {}, "paired": {}}
    lines = [f"`{out['command']}`", "", "| front | stack | front CPU us per token (min-max) | tokens/s the front could carry "
             "per core | aggregate tok/s (min-max) | TTFT ms |", "|---|---|---|---|---|---|"]
    for name, rows in samples.items():
        s = {k: spread([r[k] for r in rows]) for k in ("front_cpu_us_per_token", "aggregate_tok_s", "ttft_s")}
        out["arms"][name] = s
        us, agg = s["front_cpu_us_per_token"], s["aggregate_tok_s"]
        lines.append(f"| {name} | {stacks[name]} | {us['median']:.0f} ({us['min']:.0f}-{us['max']:.0f}) | "
                     f"{1e6 / us['median']:.0f} | {agg['median']:.1f} ({agg['min']:.1f}-{agg['max']:.1f}) | "
                     f"{s['ttft_s']['median'] * 1e3:.0f} |")
    a, b = samples["councild http"], samples["asyncio + h11"]
    ratio = spread([x["front_cpu_us_per_token"] / y["front_cpu_us_per_token"] for x, y in zip(a, b)])
    out["paired"] = {"cpu_per_token_ratio": ratio}
    lines += ["", f"councild http's CPU per token over asyncio + h11's, paired by round: {ratio['median']:.2f}x "
                  f"({ratio['min']:.2f}-{ratio['max']:.2f})"]
    table = "\n".join(lines)
    print(table)
    write_results(out, table, args.json, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
