"""The daemon itself across a group: a 1-rank daemon and an N-rank `serve --distributed`
daemon on the bundled model, the same greedy requests to both, tokens compared.

``python bench/distributed_daemon_check.py [--ranks 2] [--backend ring|nccl] [--json OUT]``

A check, not a benchmark (tests/distributed does the same on CPU with the ring backend):
it exists to run the daemon's lockstep channel over another backend (NCCL on the GPU
machine), where the tests do not run. It prints and records, per prompt and mode, whether
the group's tokens equal the single daemon's, and the group's status row.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PROMPTS = ["def fibonacci(n):\n", "The council met at dawn to decide"]


def _port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _start(tmp: Path, ranks: int, backend: str) -> tuple[str, list[subprocess.Popen]]:
    from protocol.readiness import wait_until_answering

    run = tmp / f"run{ranks}"
    run.mkdir()
    endpoint = f"ipc://{run}/s.sock"
    cmd = [sys.executable, "-m", "daemon.cli", "serve", "--endpoint", endpoint, "--log-format", "json"]
    envs = [{}]
    if ranks > 1:
        cmd += ["--distributed"]
        if backend == "ring":
            hosts = tmp / "hosts.json"
            hosts.write_text(json.dumps([[f"127.0.0.1:{_port()}"] for _ in range(ranks)]))
            envs = [dict(MLX_RANK=str(r), MLX_HOSTFILE=str(hosts)) for r in range(ranks)]
        else:
            port = str(_port())
            envs = [dict(MLX_RANK=str(r), MLX_WORLD_SIZE=str(ranks), NCCL_HOST_IP="127.0.0.1", NCCL_PORT=port,
                         CUDA_VISIBLE_DEVICES=str(r), NCCL_NVLS_ENABLE="0") for r in range(ranks)]
        cfg = tmp / "group.toml"
        cfg.write_text(f'[distributed]\nbackend = "{backend}"\n')
        cmd += ["--config", str(cfg)]
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, COUNCILD_RUNTIME_DIR=str(run), **e),
                              stdout=open(tmp / f"r{ranks}-{i}.log", "w"), stderr=subprocess.STDOUT)
             for i, e in enumerate(envs)]
    wait_until_answering(endpoint, procs[0], timeout_s=300, log_path=tmp / f"r{ranks}-0.log")
    return endpoint, procs


def _answers(endpoint: str, tokens: int) -> tuple[dict, dict]:
    from protocol.client import Client

    out = {}
    with Client(endpoint, seat="check", timeout_s=120) as c:
        deadline = time.monotonic() + 300
        while c.status().detail.get("state") != "serving":
            if time.monotonic() > deadline:
                raise TimeoutError("the daemon did not start serving")
            time.sleep(0.5)
        for p in PROMPTS:
            out[f"{p!r} off"] = _ids(c, p, tokens, "off", None)
            for depth in (1, 2):
                c.governor("pin_depth", depth)
                out[f"{p!r} exact d{depth}"] = _ids(c, p, tokens, "exact", depth)
        c.governor("auto")
        detail = c.status().detail
    return out, {k: detail.get(k) for k in ("exact_decode", "decode_path", "group")}


def _ids(c, prompt: str, tokens: int, mode: str, depth: int | None) -> list[int]:
    stream = c.generate(prompt, max_tokens=tokens, speculation=mode)
    "".join(stream)
    return list(stream.token_ids)


def _stop(procs: list[subprocess.Popen]) -> list[int]:
    procs[0].send_signal(signal.SIGTERM)
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=60))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait())
    return codes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--backend", default="ring", choices=["ring", "nccl"])
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        endpoint, procs = _start(tmp, 1, args.backend)
        single, single_status = _answers(endpoint, args.tokens)
        single_codes = _stop(procs)
        endpoint, procs = _start(tmp, args.ranks, args.backend)
        try:
            group, group_status = _answers(endpoint, args.tokens)
        finally:
            group_codes = _stop(procs)
        logs = {p.name: p.read_text()[-4000:] for p in sorted(tmp.glob("r*.log"))}
    same = {k: group[k] == single[k] for k in single}
    result = {"command": ["python", "bench/distributed_daemon_check.py", *(argv or sys.argv[1:])],
              "ranks": args.ranks, "backend": args.backend, "identical": same, "single_status": single_status,
              "group_status": group_status, "exit_codes": {"single": single_codes, "group": group_codes},
              "single": single, "group": group, "log_tails": logs if not all(same.values()) else {}}
    for k, v in same.items():
        print(f"{'same' if v else 'DIFFERENT'}: {k}")
    print(f"exact decode: single {single_status['exact_decode']}, group {group_status['exact_decode']}; "
          f"exit codes single {single_codes}, group {group_codes}")
    print(json.dumps(group_status.get("group"), indent=1)[:1500])
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
