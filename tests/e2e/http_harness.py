"""Start `councild http` as a real process in front of a real daemon, as an operator would."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FrontProcess:
    def __init__(self, proc: subprocess.Popen, port: int, log_path: Path):
        self.proc = proc
        self.port = port
        self.log_path = log_path
        self.url = f"http://127.0.0.1:{port}"

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def start_front(tmp: Path, endpoint: str, http_table: str = "", wait_ready: bool = True,
                timeout_s: float = 60.0) -> FrontProcess:
    port = free_port()
    cfg = tmp / "front.toml"
    cfg.write_text(f'endpoint = "{endpoint}"\n[http]\nport = {port}\n{http_table}\n')
    log_path = tmp / f"front-{port}.log"
    proc = subprocess.Popen([sys.executable, "-m", "daemon.cli", "http", "--config", str(cfg)], cwd=REPO,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=open(log_path, "w"),
                            stderr=subprocess.STDOUT)
    front = FrontProcess(proc, port, log_path)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"councild http exited {proc.returncode}: {log_path.read_text()[-2000:]}")
        try:
            r = httpx.get(front.url + "/health", timeout=5.0)
            if r.status_code == 200 or not wait_ready:
                return front
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            front.stop()
            raise TimeoutError(f"councild http not ready in {timeout_s} s: {log_path.read_text()[-2000:]}")
        time.sleep(0.2)


def sse_events(lines) -> list:
    """The JSON payloads of an SSE stream's `data:` lines; the string "[DONE]" for the end."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def terminal_events(log_path: Path) -> dict[str, list[dict]]:
    """request id -> the daemon's terminal log events for it (request.done / request.error)."""
    out: dict[str, list[dict]] = {}
    for line in log_path.read_text().splitlines():
        if not line.startswith("{"):
            continue
        ev = json.loads(line)
        if ev.get("event") in ("request.done", "request.error"):
            out.setdefault(ev["request_id"], []).append(ev)
    return out
