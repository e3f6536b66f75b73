"""Start to a first answer over HTTP: councild (daemon + its HTTP front, started together as
a service manager starts them) against mlx_lm.server, arms alternated over rounds.

    PYTHONPATH=$PWD .venv/bin/python bench/start_http.py --rounds 4 \
        --json bench/results/start_http_cpu.json --markdown bench/results/start_http_cpu.md

Arms, each round in a rotated order: ``councild fresh`` (an empty COUNCILD_CACHE_DIR: no
cached probe verdicts, no prefix snapshots), ``councild second`` (the cache folder of an
earlier councild start of this run: what a restart finds) and ``mlx_lm.server``. Each start
is timed from the first process's spawn to: ``ready`` (councild: /health says "ready", the
moment the daemon sends READY=1; mlx_lm.server: /v1/models answers) and ``first answer``
(a greedy 8-token /v1/chat/completions request answered 200, sent every 50 ms from the
spawn on). For councild it also reads the daemon's ``engine.warmed`` event (the background
checks all done, daemon/engine_thread/warming.py), waiting for it up to --warm-timeout s.
With ``--slow-arms``, two more: the same two councild starts with ``warm_in_background =
false`` (every check and the warm-up before ready: the start before serve-first), the slow
second start on its own kept folder.
Prints a markdown table (median, min-max) and the ratios to mlx_lm.server paired by round.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

try:
    import httpx
except ImportError:  # the GPU machine has the openai client's fork only (tools/stage_device.sh)
    import httpx2 as httpx

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]

from bench.http_servers import free_port, stop  # noqa: E402
from daemon.paths import BUNDLED_MODEL  # noqa: E402

ASK = {"messages": [{"role": "user", "content": "Write a haiku about the sea."}], "max_tokens": 8,
       "temperature": 0.0}


def _until(fn, deadline: float, procs: list[subprocess.Popen]) -> float:
    """Call fn every 50 ms until it returns True; the time.monotonic() it did."""
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args[:5]} exited {p.returncode}")
        try:
            if fn():
                return time.monotonic()
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError("no answer in time")


def _answer(url: str, model: str) -> bool:
    r = httpx.post(url, json={"model": model, **ASK}, timeout=60)
    return r.status_code == 200 and bool(r.json()["choices"][0]["message"]["content"] is not None)


def councild(tmp: Path, cache: Path, timeout_s: float, warm_timeout_s: float, config_extra: str) -> dict:
    runtime = tmp / "run"
    runtime.mkdir(mode=0o700)
    port = free_port()
    cfg = tmp / "councild.toml"
    cfg.write_text(config_extra + f"[scheduler]\nmax_active = 4\n[http]\nport = {port}\n")
    endpoint = f"ipc://{runtime / 'councild.sock'}"
    env = dict(os.environ, COUNCILD_CACHE_DIR=str(cache), COUNCILD_RUNTIME_DIR=str(runtime), PYTHONUNBUFFERED="1")
    log = tmp / "daemon.log"
    wall0, t0 = time.time(), time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-m", "daemon.cli", "serve", "--model", str(BUNDLED_MODEL), "--endpoint",
                               endpoint, "--config", str(cfg), "--log-format", "json"], cwd=REPO, env=env,
                              stdout=open(log, "w"), stderr=subprocess.STDOUT)]
    procs.append(subprocess.Popen([sys.executable, "-m", "daemon.cli", "http", "--config", str(cfg), "--endpoint",
                                   endpoint, "--log-level", "warning"], cwd=REPO, env=env,
                                  stdout=open(tmp / "front.log", "w"), stderr=subprocess.STDOUT))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = t0 + timeout_s
        ready = _until(lambda: httpx.get(f"{base}/health", timeout=2).json().get("status") == "ready", deadline, procs)
        answered = _until(lambda: _answer(f"{base}/v1/chat/completions", "councild"), deadline, procs)
        warmed = None
        end = time.monotonic() + warm_timeout_s
        while warmed is None and time.monotonic() < end:
            for line in log.read_text().splitlines():
                if '"engine.warmed"' in line:
                    e = json.loads(line)
                    warmed = datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp() - wall0
            time.sleep(0.2)
    finally:
        stop(procs)
    events = {}
    for line in log.read_text().splitlines():
        if line.startswith("{"):
            e = json.loads(line)
            if e.get("event") in ("daemon.loading", "model.loaded", "daemon.start") and e["event"] not in events:
                events[e["event"]] = round(datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()
                                           - wall0, 3)
    return {"ready_s": round(ready - t0, 3), "first_answer_s": round(answered - t0, 3),
            "warmed_s": None if warmed is None else round(warmed, 3), "events_s": events}


def mlx_lm_server(tmp: Path, timeout_s: float) -> dict:
    port = free_port()
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "mlx_lm", "server", "--model", str(BUNDLED_MODEL), "--port", str(port),
                             "--log-level", "WARNING"], cwd=REPO, stdout=open(tmp / "mlx_server.log", "w"),
                            stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = t0 + timeout_s
        ready = _until(lambda: httpx.get(f"{base}/v1/models", timeout=2).status_code == 200, deadline, [proc])
        answered = _until(lambda: _answer(f"{base}/v1/chat/completions", str(BUNDLED_MODEL)), deadline, [proc])
    finally:
        stop([proc])
    return {"ready_s": round(ready - t0, 3), "first_answer_s": round(answered - t0, 3)}


def spread(xs: list[float]) -> dict:
    return {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3), "max": round(max(xs), 3), "n": len(xs)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--warm-timeout", type=float, default=90.0, help="seconds to wait for engine.warmed after the answer")
    ap.add_argument("--config", default="", help="TOML lines for councild's config (top-level keys)")
    ap.add_argument("--slow-arms", action="store_true", help="add councild arms with warm_in_background = false")
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    args = ap.parse_args(argv)
    arms = ["councild fresh", "councild second", "mlx_lm.server"]
    slow = "warm_in_background = false\n"
    if args.slow_arms:
        arms[2:2] = ["councild fresh, warm before ready", "councild second, warm before ready"]
    samples: dict[str, list[dict]] = {a: [] for a in arms}
    root = Path(tempfile.mkdtemp(prefix="start-http-"))
    try:
        # The second starts' folders: each filled by a councild start of its kind first.
        kept = {"": root / "kept-cache", slow: root / "kept-cache-slow"}
        for config, folder in kept.items():
            if config == slow and not args.slow_arms:
                continue
            print(f"[start_http] filling {folder.name}", file=sys.stderr, flush=True)
            (root / f"fill-{folder.name}").mkdir()
            councild(root / f"fill-{folder.name}", folder, args.timeout, args.warm_timeout, config + args.config)
        for r in range(args.rounds):
            order = arms[r % len(arms):] + arms[: r % len(arms)]
            for arm in order:
                tmp = root / f"{r}-{arm.replace(' ', '_').replace(',', '')}"
                tmp.mkdir()
                print(f"[start_http {r + 1}/{args.rounds}] {arm}", file=sys.stderr, flush=True)
                if arm == "mlx_lm.server":
                    s = mlx_lm_server(tmp, args.timeout)
                else:
                    config = slow if "before ready" in arm else ""
                    cache = tmp / "cache" if "fresh" in arm else kept[config]
                    s = councild(tmp, cache, args.timeout, args.warm_timeout, config + args.config)
                s["round"], s["loadavg"] = r, round(os.getloadavg()[0], 2)
                samples[arm].append(s)
                print(f"  {json.dumps(s)}", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base = samples["mlx_lm.server"]
    res = {"command": "bench/start_http.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "platform": platform.platform(), "cpus": os.cpu_count(), "model": str(BUNDLED_MODEL), "config": args.config,
           "ask": ASK, "arms": {}}
    lines = ["| arm | start to ready, s | start to first answer, s | first answer / mlx_lm.server's (paired) "
             "| background checks done, s |", "|---|---|---|---|---|"]
    for arm, ss in samples.items():
        rd, fa = spread([s["ready_s"] for s in ss]), spread([s["first_answer_s"] for s in ss])
        ratio = spread([s["first_answer_s"] / b["first_answer_s"] for s, b in zip(ss, base)])
        warmed = [s["warmed_s"] for s in ss if s.get("warmed_s") is not None]
        res["arms"][arm] = {"ready_s": rd, "first_answer_s": fa, "first_answer_over_mlx_lm": ratio,
                            "warmed_s": spread(warmed) if warmed else None, "samples": ss}
        fmt = lambda d: f"{d['median']:.2f} ({d['min']:.2f}-{d['max']:.2f})"  # noqa: E731
        lines.append(f"| {arm} | {fmt(rd)} | {fmt(fa)} | {fmt(ratio)} | {fmt(spread(warmed)) if warmed else '-'} |")
    loads = [s["loadavg"] for ss in samples.values() for s in ss]
    lines += ["", f"{args.rounds} rounds, arms rotated; load average {min(loads):.1f}-{max(loads):.1f} "
              f"on {os.cpu_count()} CPUs"]
    table = "\n".join(lines)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(f"`PYTHONPATH=$PWD .venv/bin/python {res['command']}`\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
