"""Start `councild http` as a real process in front of a real daemon, as an operator would."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import anthropic
import httpx
import openai
from e2e_harness import start_daemon

REPO = Path(__file__).resolve().parents[2]
# Heartbeats fast enough that a daemon's end is noticed within seconds.
FAST_HEARTBEAT = "heartbeat_timeout_s = 3.0\nheartbeat_interval_s = 0.5\n"


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


@contextmanager
def daemon_behind_front(tmp: Path, model: Path, http_table: str = ""):
    """(daemon, front): a daemon serving ``model`` with FAST_HEARTBEAT and `councild http` in
    front of it; on leaving both stop, and the daemon must have exited 0."""
    d = start_daemon(tmp, model, config=FAST_HEARTBEAT)
    front = start_front(tmp, d.endpoint, http_table)
    try:
        yield d, front
    finally:
        front.stop()
        code = d.stop()
    assert code == 0, d.log_path.read_text()[-3000:]


def openai_client(front: FrontProcess, api_key: str = "x", timeout: float = 300) -> openai.OpenAI:
    """The official openai client on ``front``, without retries: a test sees every status."""
    return openai.OpenAI(base_url=front.url + "/v1", api_key=api_key, max_retries=0, timeout=timeout)


def anthropic_client(front: FrontProcess, api_key: str = "x", timeout: float = 300) -> anthropic.Anthropic:
    """The official anthropic client on ``front``, without retries."""
    return anthropic.Anthropic(base_url=front.url, api_key=api_key, max_retries=0, timeout=timeout)


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
