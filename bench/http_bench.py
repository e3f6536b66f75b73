"""The HTTP front's cost: the same requests through `councild http` and through the ZeroMQ
client, on one daemon, interleaved; optionally mlx_lm.server on the same model as a third arm.

Per round, each arm in turn (the order rotates every round), for each concurrency in
--streams: that many streaming completions at once (temperature 0, the same prompts and
max_tokens in every arm, so councild's arms decode identical tokens). Per request, measured
at the client: TTFT (send to the first text) and decode tokens/s (tokens after the first over
the time after the first); per batch, aggregate tokens/s (all tokens over first send to last
end). HTTP arms read SSE with httpx (a light client, so the front is what is measured), with
stream_options.include_usage for the token count.

    .venv/bin/python bench/http_bench.py --rounds 6 --json bench/results/http_cpu.json [--mlx-server]

Reported: medians with min-max, and per-round paired ratios HTTP / ZeroMQ (tok/s) and
differences (TTFT). This box is shared and noisy: read the spread beside the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from bench.http_servers import start_councild_http, start_mlx_lm_server, stop  # noqa: E402
from daemon.measure.bench_io import spread, write_results  # noqa: E402
from protocol.client import AsyncClient  # noqa: E402

PROMPTS = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n", "import os\n\n\ndef walk(path):\n",
           "def parse(line):\n", "for i in range(10):\n", "def main():\n", "x = [", "while True:\n"]


# ------------------------------------------------------------------ one request per arm


async def zmq_one(client: AsyncClient, prompt: str, tokens: int) -> dict:
    t0 = time.perf_counter()
    first = last = None
    stream = client.generate(prompt, max_tokens=tokens, temperature=0.0)
    async for _ in stream:
        now = time.perf_counter()
        first = first or now
        last = now
    n = stream.done.usage.completion_tokens
    return {"t0": t0, "first": first, "last": last, "end": time.perf_counter(), "tokens": n}


async def http_one(h: httpx.AsyncClient, url: str, model: str, prompt: str, tokens: int, seat: str) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    n = chunks = 0
    # One seat per stream, as the ZeroMQ arm has (mlx_lm.server ignores the header).
    async with h.stream("POST", url, json=body, headers={"X-Councild-Seat": seat}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                n = ev["usage"]["completion_tokens"]
            for c in ev.get("choices", []):
                if c.get("text"):
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    chunks += 1
    return {"t0": t0, "first": first, "last": last, "end": time.perf_counter(), "tokens": n or chunks}


def summarise(rows: list[dict]) -> dict:
    ok = [r for r in rows if r["first"] is not None]
    dec = [(r["tokens"] - 1) / (r["last"] - r["first"]) for r in ok if r["tokens"] > 1 and r["last"] > r["first"]]
    return {
        "ttft_s": statistics.median(r["first"] - r["t0"] for r in ok),
        "decode_tok_s": statistics.median(dec) if dec else 0.0,
        "aggregate_tok_s": sum(r["tokens"] for r in rows) / (max(r["end"] for r in rows) - min(r["t0"] for r in rows)),
        "tokens": sum(r["tokens"] for r in rows),
    }


async def run_arm(arm: str, conc: int, tokens: int, ctx: dict, offset: int) -> dict:
    prompts = [PROMPTS[(offset + i) % len(PROMPTS)] for i in range(conc)]
    if arm == "zmq":
        rows = await asyncio.gather(*(zmq_one(ctx["zmq"][i], p, tokens) for i, p in enumerate(prompts)))
    else:
        url, model = ctx[arm]
        rows = await asyncio.gather(*(http_one(ctx["http_client"], url, model, p, tokens, f"http{i}")
                                      for i, p in enumerate(prompts)))
    return summarise(list(rows))


def cpu_seconds(procs: dict) -> dict:
    out = {}
    for name, p in procs.items():
        t = p.cpu_times()
        out[name] = t.user + t.system
    return out


async def bench(args, endpoint: str, arms: dict, pids: dict) -> dict:
    import psutil

    procs = {name: psutil.Process(pid) for name, pid in pids.items()}
    procs["client"] = psutil.Process()
    ctx: dict = {"zmq": [AsyncClient(endpoint, seat=f"zmq{i}", timeout_s=120) for i in range(max(args.streams))],
                 "http_client": httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=64))}
    ctx.update(arms)
    names = ["zmq"] + list(arms)
    samples = {a: {c: [] for c in args.streams} for a in names}
    try:
        for r in range(args.rounds + 1):  # round 0 warms every path up
            order = names[r % len(names):] + names[: r % len(names)]
            for conc in args.streams:
                for arm in order:
                    c0 = cpu_seconds(procs)
                    res = await run_arm(arm, conc, args.tokens, ctx, offset=r)
                    c1 = cpu_seconds(procs)
                    # CPU seconds each process spent per 1,000 tokens of this batch.
                    res.update({f"cpu_{k}_s_per_1k": (c1[k] - c0[k]) * 1000 / max(1, res["tokens"]) for k in c0})
                    if r:
                        samples[arm][conc].append(res)
            print(f"round {r}/{args.rounds}" + (" (warm-up)" if r == 0 else ""), file=sys.stderr, flush=True)
    finally:
        for c in ctx["zmq"]:
            await c.close()
        await ctx["http_client"].aclose()
    return samples


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "daemon/assets/tiny-qwen35"))
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--streams", default="1,4", help="concurrent streams per batch, comma-separated")
    ap.add_argument("--mlx-server", action="store_true", help="add mlx_lm.server on the same model as an arm")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=TOML",
                    help="another councild daemon and front, TOML appended to its config (e.g. "
                         "'lookup=[speculation]\\nbatch_lookup = true'): an arm \"http NAME\" rotated with the "
                         "others and paired against \"http\"; repeatable")
    ap.add_argument("--json", default="bench/out/http.json")
    ap.add_argument("--markdown")
    args = ap.parse_args(argv)
    args.streams = [int(x) for x in args.streams.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="http-bench-"))
    procs = []
    env = dict(os.environ, COUNCILD_RUNTIME_DIR=str(tmp / "run"))
    try:
        procs, endpoint, port = start_councild_http(args.model, tmp, env, max_active=8, timeout_s=180)
        daemon, front = procs
        arms = {"http": (f"http://127.0.0.1:{port}/v1/completions", "councild")}
        pids = {"daemon": daemon.pid, "front": front.pid}
        for spec in args.variant:
            name, _, toml = spec.partition("=")
            home = tmp / f"variant-{len(procs)}"
            home.mkdir()
            vprocs, _, vport = start_councild_http(args.model, home, dict(env, COUNCILD_RUNTIME_DIR=str(home / "run")),
                                                   max_active=8, config_extra=toml.replace("\\n", "\n"), timeout_s=180)
            procs += vprocs
            arms[f"http {name}"] = (f"http://127.0.0.1:{vport}/v1/completions", "councild")
            pids[f"daemon {name}"], pids[f"front {name}"] = vprocs[0].pid, vprocs[1].pid
        if args.mlx_server:
            mlx, mport = start_mlx_lm_server(args.model, tmp, env, timeout_s=120)
            procs.append(mlx)
            arms["mlx_lm.server"] = (f"http://127.0.0.1:{mport}/v1/completions", args.model)
            pids["mlx_lm.server"] = mlx.pid
        samples = asyncio.run(bench(args, endpoint, arms, pids))
    finally:
        stop(procs)

    out = {"benchmark": "http", "model": args.model, "tokens": args.tokens, "rounds": args.rounds,
           "streams": args.streams, "machine": platform.platform(), "cpus": os.cpu_count(),
           "command": " ".join([Path(sys.executable).name, *sys.argv]), "arms": {}, "paired": {}}
    lines = ["| arm | streams | TTFT ms (min-max) | decode tok/s per stream (min-max) | aggregate tok/s (min-max) |",
             "|---|---|---|---|---|"]
    for arm, by in samples.items():
        out["arms"][arm] = {}
        for conc, rows in by.items():
            s = {k: spread([r[k] for r in rows]) for k in rows[0] if k == "ttft_s" or k.endswith("tok_s")
                 or k.startswith("cpu_")}
            out["arms"][arm][str(conc)] = s
            t, d, a = s["ttft_s"], s["decode_tok_s"], s["aggregate_tok_s"]
            lines.append(f"| {arm} | {conc} | {t['median'] * 1e3:.1f} ({t['min'] * 1e3:.1f}-{t['max'] * 1e3:.1f}) | "
                         f"{d['median']:.1f} ({d['min']:.1f}-{d['max']:.1f}) | "
                         f"{a['median']:.1f} ({a['min']:.1f}-{a['max']:.1f}) |")
    lines += ["", "| arm vs zmq (paired by round) | streams | aggregate tok/s ratio (min-max) | decode tok/s ratio | "
              "added TTFT ms (min-max) |", "|---|---|---|---|---|"]
    for arm in samples:
        if arm == "zmq":
            continue
        out["paired"][arm] = {}
        for conc in args.streams:
            z, h = samples["zmq"][conc], samples[arm][conc]
            agg = spread([b["aggregate_tok_s"] / a["aggregate_tok_s"] for a, b in zip(z, h)])
            dec = spread([b["decode_tok_s"] / a["decode_tok_s"] for a, b in zip(z, h) if a["decode_tok_s"]])
            ttft = spread([b["ttft_s"] - a["ttft_s"] for a, b in zip(z, h)])
            out["paired"][arm][str(conc)] = {"aggregate_ratio": agg, "decode_ratio": dec, "added_ttft_s": ttft}
            lines.append(f"| {arm} | {conc} | {agg['median']:.3f} ({agg['min']:.3f}-{agg['max']:.3f}) | "
                         f"{dec['median']:.3f} | {ttft['median'] * 1e3:+.1f} ({ttft['min'] * 1e3:+.1f}-"
                         f"{ttft['max'] * 1e3:+.1f}) |")
    variants = [a for a in samples if a.startswith("http ")]
    if variants:
        lines += ["", "| variant vs http (paired by round) | streams | aggregate tok/s ratio (min-max) | TTFT ratio |",
                  "|---|---|---|---|"]
    for arm in variants:
        for conc in args.streams:
            a_rows, b_rows = samples["http"][conc], samples[arm][conc]
            agg = spread([b["aggregate_tok_s"] / a["aggregate_tok_s"] for a, b in zip(a_rows, b_rows)])
            ttft = spread([b["ttft_s"] / a["ttft_s"] for a, b in zip(a_rows, b_rows) if a["ttft_s"]])
            out["paired"][arm][f"{conc}_vs_http"] = {"aggregate_ratio": agg, "ttft_ratio": ttft}
            lines.append(f"| {arm} | {conc} | {agg['median']:.3f} ({agg['min']:.3f}-{agg['max']:.3f}) | "
                         f"{ttft['median']:.3f} |")
    lines += ["", "| arm | streams | CPU s per 1,000 tokens: daemon | front | mlx_lm.server | this client |",
              "|---|---|---|---|---|---|"]
    for arm, by in out["arms"].items():
        # a variant's arm is served by its own daemon and front ("daemon NAME", "front NAME")
        own = f" {arm[len('http '):]}" if arm.startswith("http ") else ""
        for conc, s in by.items():
            cells = [f"{s[f'cpu_{k}_s_per_1k']['median']:.2f}" if f"cpu_{k}_s_per_1k" in s else "-"
                     for k in (f"daemon{own}", f"front{own}", "mlx_lm.server", "client")]
            lines.append(f"| {arm} | {conc} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    write_results(out, f"`{out['command']}`\n\n{table}", args.json, args.markdown)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
