"""How many streamed tokens per second the HTTP front carries, and how late they arrive,
with the model out of the way: `councild http` in front of a stand-in daemon that speaks the
real protocol and emits tokens at a set rate.

Why: on a GPU several streams of a small model give thousands of tokens per second, and every
one is a ZeroMQ frame, an SSE event and a socket write in the front's one process. On this CPU
the model gives ~280 tok/s, far below what the front could carry, so a council over HTTP never
shows where the front's ceiling is. Here the stand-in daemon (``--stand-in``, a ROUTER socket:
Welcome, Pong, a ready StatusReply; for each Generate an Accepted, ``max_tokens`` Tokens frames
and a Done) paces the tokens of all open streams together at ``--rates`` tokens/s, each
token's text the time it was sent (``<ns>;``), and a light raw-socket client reads the SSE bytes
and takes each token's lag (received minus sent) from them, so neither the client's nor the
stand-in's cost per token is the front's.

Per rate: ``--streams`` streaming completions at once for ``--seconds`` of tokens; reported are
the tokens/s delivered over the tokens/s asked, the lag p50/p95/max, and the front's CPU
(user + system seconds over the wall time: 1.0 is one core). With ``--trees A,B`` one front per
source tree (each ``python -m daemon.cli http`` of that tree) on the same stand-in, the trees
alternated rate by rate and round by round.

    PYTHONPATH=$PWD .venv/bin/python bench/front_capacity.py --rates 1000,2000,4000,8000 --streams 8 \\
        --rounds 3 --json bench/out/front_capacity.json --markdown bench/out/front_capacity.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import psutil  # noqa: E402
import zmq  # noqa: E402

from bench.http_servers import free_port, stop, wait_http  # noqa: E402
from daemon.measure.bench_io import spread, write_results  # noqa: E402
from protocol import messages as m  # noqa: E402
from protocol.codec import decode_client, encode  # noqa: E402

STAMP = re.compile(rb"(\d{16,20});")


# ------------------------------------------------------------------ the stand-in daemon


def stand_in(endpoint: str, rate: float) -> None:
    """Serve ``endpoint`` until killed: every open stream's tokens, round-robin, ``rate``
    tokens/s in all (late ones go out at once, never skipped)."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    # No send limit: a ROUTER drops what passes its high-water mark, silently, and a lost Done
    # would leave a stream open for ever; a front that falls behind shows as lag here instead.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.bind(endpoint)
    limits = m.Limits(max_frame_bytes=64 << 20, max_tokens=1 << 20, max_prompt_tokens=1 << 20,
                      heartbeat_interval_s=5.0, heartbeat_timeout_s=60.0)
    streams: dict[tuple[bytes, str], list[int]] = {}  # (identity, request_id) -> [seq, left, asked]
    interval, due = 1.0 / rate, time.perf_counter()

    def send(ident: bytes, msg) -> None:
        sock.send_multipart([ident, encode(msg)])

    while True:
        if streams:
            now = time.perf_counter()
            wait_ms = max(0, int((due - now) * 1000))
        else:
            wait_ms = 100
        if sock.poll(wait_ms, zmq.POLLIN):
            while True:
                try:
                    ident, frame = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                msg = decode_client(frame)
                if isinstance(msg, m.Hello):
                    send(ident, m.Welcome(seat=msg.seat, server="stand-in", model="stand-in", capabilities=["stream"],
                                          limits=limits))
                elif isinstance(msg, m.Ping):
                    send(ident, m.Pong(nonce=msg.nonce))
                elif isinstance(msg, m.Status):
                    send(ident, m.StatusReply(server="stand-in", model="stand-in", uptime_s=1.0, active=len(streams),
                                              queued=0, detail={"state": "ready"}))
                elif isinstance(msg, m.Generate):
                    send(ident, m.Accepted(request_id=msg.request_id, queue_position=0, prompt_tokens=1))
                    if not streams:
                        due = time.perf_counter()
                    streams[(ident, msg.request_id)] = [0, msg.max_tokens, msg.max_tokens]
                elif isinstance(msg, m.Cancel):
                    for key in [k for k in streams if k[1] == msg.request_id]:
                        finish(send, key, streams.pop(key), "cancelled")
        now = time.perf_counter()
        for key in list(streams):  # one round-robin pass over the streams due now
            if now < due:
                break
            st = streams[key]
            send(key[0], m.Tokens(request_id=key[1], seq=st[0], text=f"{time.time_ns()};", token_ids=[7]))
            st[0] += 1
            st[1] -= 1
            due += interval
            if st[1] == 0:
                finish(send, key, streams.pop(key), "length")


def finish(send, key: tuple[bytes, str], st: list[int], reason: str) -> None:
    n = st[0]
    send(key[0], m.Done(request_id=key[1], finish_reason=reason, text="", usage=m.Usage(prompt_tokens=1, completion_tokens=n),
                        timings=m.Timings(queue_s=0.0, prefill_s=0.0, decode_s=0.0, ttft_s=0.0, tokens_per_s=0.0)))


# ------------------------------------------------------------------ the light client


async def sse_stream(port: int, tokens: int, seat: str) -> tuple[int, list[float]]:
    """One streaming completion over a raw socket: the tokens received and each one's lag (s)."""
    body = json.dumps({"model": "stand-in", "prompt": "x", "max_tokens": tokens, "stream": True}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                 b"X-Councild-Seat: " + seat.encode() + b"\r\nConnection: close\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    await writer.drain()
    lags: list[float] = []
    tail = b""
    while True:
        data = await reader.read(1 << 16)
        if not data:
            break
        now = time.time_ns()
        buf = tail + data
        last = 0
        for match in STAMP.finditer(buf):
            lags.append((now - int(match.group(1))) / 1e9)
            last = match.end()
        tail = buf[max(last, len(buf) - 24):]
    writer.close()
    return len(lags), lags


# ------------------------------------------------------------------ one measurement


async def measure(port: int, proc: psutil.Process, rate: int, streams: int, seconds: float) -> dict:
    per_stream = max(1, int(rate * seconds / streams))
    c0, t0 = proc.cpu_times(), time.perf_counter()
    results = await asyncio.gather(*(sse_stream(port, per_stream, f"s{i}") for i in range(streams)))
    wall = time.perf_counter() - t0
    c1 = proc.cpu_times()
    lags = sorted(x for _, ls in results for x in ls)
    got = sum(n for n, _ in results)
    return {"rate": rate, "asked_tokens": per_stream * streams, "tokens": got, "wall_s": wall,
            "delivered_tok_s": got / wall, "delivered_share": got / wall / rate,
            "lag_p50_ms": lags[len(lags) // 2] * 1e3 if lags else None,
            "lag_p95_ms": lags[int(len(lags) * 0.95)] * 1e3 if lags else None,
            "lag_max_ms": lags[-1] * 1e3 if lags else None,
            "front_cpu": ((c1.user + c1.system) - (c0.user + c0.system)) / wall}


def start_front(tree: Path, endpoint: str, tmp: Path, env: dict) -> tuple[subprocess.Popen, int]:
    port = free_port()
    cfg = tmp / f"http-{port}.toml"
    cfg.write_text(f"[http]\nport = {port}\n")
    proc = subprocess.Popen([sys.executable, "-m", "daemon.cli", "http", "--config", str(cfg), "--endpoint", endpoint,
                             "--log-level", "warning"], cwd=tree, env=dict(env, PYTHONPATH=str(tree)),
                            stdout=open(tmp / f"front-{port}.log", "w"), stderr=subprocess.STDOUT)
    wait_http(f"http://127.0.0.1:{port}/health", proc, timeout_s=60)
    return proc, port


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stand-in", metavar="ENDPOINT", help=argparse.SUPPRESS)  # the stand-in daemon's own process
    ap.add_argument("--rate", type=float, default=1000.0, help=argparse.SUPPRESS)
    ap.add_argument("--rates", default="1000,2000,4000,8000", help="tokens/s in all, comma-separated")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=4.0, help="tokens per rate: rate x seconds, split over the streams")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--trees", default=str(REPO), help="source trees whose fronts are compared, comma-separated")
    ap.add_argument("--json", default="bench/out/front_capacity.json")
    ap.add_argument("--markdown")
    args = ap.parse_args(argv)
    if args.stand_in:
        stand_in(args.stand_in, args.rate)
        return 0
    rates = [int(r) for r in args.rates.split(",")]
    trees = [Path(t).resolve() for t in args.trees.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="front-capacity-"))
    env = dict(os.environ)
    samples: dict[str, dict[int, list[dict]]] = {str(t): {r: [] for r in rates} for t in trees}
    for rnd in range(args.rounds + 1):  # round 0 warms each front up and is not reported
        for rate in rates:
            # A stand-in per rate (its pace is fixed at start); every tree's front in turn on it.
            endpoint = f"ipc://{tmp / f'stand-in-{rnd}-{rate}.sock'}"
            daemon = subprocess.Popen([sys.executable, __file__, "--stand-in", endpoint, "--rate", str(rate)], cwd=REPO,
                                      env=env, stdout=open(tmp / "stand-in.log", "a"), stderr=subprocess.STDOUT)
            procs = [daemon]
            try:
                order = trees if (rnd + rates.index(rate)) % 2 == 0 else trees[::-1]
                for tree in order:
                    front, port = start_front(tree, endpoint, tmp, env)
                    procs.append(front)
                    res = asyncio.run(measure(port, psutil.Process(front.pid), rate, args.streams, args.seconds))
                    stop([front])
                    procs.remove(front)
                    if rnd:
                        samples[str(tree)][rate].append(res)
                    print(f"round {rnd} rate {rate} {tree.name}: delivered {res['delivered_tok_s']:.0f} tok/s, lag p95 "
                          f"{res['lag_p95_ms']:.1f} ms, front CPU {res['front_cpu']:.2f}", file=sys.stderr, flush=True)
            finally:
                stop(procs)

    def med(rows: list[dict], key: str) -> str:
        s = spread([r[key] for r in rows if r[key] is not None])
        return f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})"

    out = {"benchmark": "front_capacity", "streams": args.streams, "seconds": args.seconds, "rounds": args.rounds,
           "machine": platform.platform(), "cpus": os.cpu_count(),
           "command": " ".join([Path(sys.executable).name, *sys.argv]), "samples": samples}
    lines = [f"`{out['command']}`", "", "| front (tree) | asked tok/s | delivered / asked | lag p50 ms | lag p95 ms | "
             "lag max ms | front CPU (cores) |", "|---|---|---|---|---|---|---|"]
    for tree, by in samples.items():
        for rate, rows in by.items():
            lines.append(f"| {Path(tree).name} | {rate} | {med(rows, 'delivered_share')} | {med(rows, 'lag_p50_ms')} | "
                         f"{med(rows, 'lag_p95_ms')} | {med(rows, 'lag_max_ms')} | {med(rows, 'front_cpu')} |")
    table = "\n".join(lines)
    print(table)
    write_results(out, table, args.json, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
