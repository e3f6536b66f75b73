"""Start a real tensor-parallel group: one `councild serve --distributed` process per rank on
loopback with the ring backend (MLX_RANK + MLX_HOSTFILE, as mlx.launch sets them), rank 0
on a real ipc socket."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from protocol.readiness import wait_until_answering

REPO = Path(__file__).resolve().parents[2]


def free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Group:
    def __init__(self, endpoint: str, procs: list[subprocess.Popen], logs: list[Path]):
        self.endpoint = endpoint
        self.procs = procs
        self.logs = logs

    def events(self, rank: int) -> list[dict]:
        return [json.loads(line) for line in self.logs[rank].read_text().splitlines() if line.startswith("{")]

    def tail(self, rank: int, n: int = 3000) -> str:
        return self.logs[rank].read_text()[-n:]

    def wait(self, rank: int, timeout: float) -> int | None:
        try:
            return self.procs[rank].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout: float = 60.0) -> list[int]:
        """SIGTERM rank 0 (the drain stops the others with it); kill what is left."""
        if self.procs[0].poll() is None:
            self.procs[0].send_signal(signal.SIGTERM)
        codes = []
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
        return codes

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def start_group(tmp: Path, model: Path, n: int = 2, *extra: str, config: str | None = None,
                rank_configs: dict[int, str] | None = None, wait: bool = True) -> Group:
    """``config``: every rank's TOML; ``rank_configs``: a rank's own instead (the [governor]
    table is read by each rank for its memory probes)."""
    runtime = tmp / "run"
    runtime.mkdir(mode=0o700, exist_ok=True)
    endpoint = f"ipc://{runtime / 'councild.sock'}"
    hostfile = tmp / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(n)]))
    cmd = [sys.executable, "-m", "daemon.cli", "serve", "--distributed", "--model", str(model),
           "--endpoint", endpoint, "--log-format", "json", *extra]
    procs, logs = [], []
    for rank in range(n):
        text = (rank_configs or {}).get(rank, config)
        rank_cmd = list(cmd)
        if text is not None:
            path = tmp / f"councild-rank{rank}.toml"
            path.write_text(text)
            rank_cmd += ["--config", str(path)]
        log_path = tmp / f"rank{rank}.log"
        env = dict(os.environ, COUNCILD_RUNTIME_DIR=str(runtime), PYTHONUNBUFFERED="1", MLX_RANK=str(rank),
                   MLX_HOSTFILE=str(hostfile))
        procs.append(subprocess.Popen(rank_cmd, cwd=REPO, env=env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT))
        logs.append(log_path)
    g = Group(endpoint, procs, logs)
    if wait:
        try:
            wait_until_answering(endpoint, procs[0], timeout_s=120.0, log_path=logs[0])
            wait_serving(g, timeout_s=120.0)
        except BaseException:
            g.kill()
            raise
    return g


def wait_serving(g: Group, timeout_s: float) -> None:
    """Until rank 0's status says serving (every rank loaded and the group said hello)."""
    from protocol.client import Client

    deadline = time.monotonic() + timeout_s
    with Client(g.endpoint, seat="harness", timeout_s=10) as c:
        while time.monotonic() < deadline:
            if g.procs[0].poll() is not None:
                raise RuntimeError(f"rank 0 exited with {g.procs[0].returncode}:\n{g.tail(0)}")
            if c.status().detail.get("state") == "serving":
                return
            time.sleep(0.3)
    raise TimeoutError(f"the group did not start serving within {timeout_s} s:\n{g.tail(0)}\n{g.tail(1)}")
