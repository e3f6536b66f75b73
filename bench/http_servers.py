"""The OpenAI-compatible servers the HTTP benchmarks compare, started and stopped one way.

``start_councild_http``: a councild daemon on an ipc socket under ``tmp`` with its HTTP
front (`councild http`) on a free port, each waited for until it answers;
``start_mlx_lm_server``: ``python -m mlx_lm server`` on the same model; ``stop``: SIGTERM in
reverse order of start, a kill after 60 s. Used by http_bench.py (the front's cost) and
council_http.py (a council through the OpenAI API); each process logs to a file in ``tmp``.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from protocol.readiness import wait_until_answering

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:4]} exited {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(url)


def start_councild_http(model: str, tmp: Path, env: dict, max_active: int | str, config_extra: str = "",
                        timeout_s: float = 600.0) -> tuple[list[subprocess.Popen], str, int]:
    """The daemon (``max_active`` batch rows, or "auto", ``config_extra`` TOML appended to its config)
    and its HTTP front; returns both processes, the daemon's endpoint and the front's port.
    ``env`` should set COUNCILD_RUNTIME_DIR to ``tmp / "run"``, where the socket goes."""
    runtime = tmp / "run"
    runtime.mkdir(mode=0o700)
    endpoint = f"ipc://{runtime / 'councild.sock'}"
    port = free_port()
    cfg = tmp / "councild.toml"
    # A TOML table may appear once: max_active joins the extra's own [scheduler] table if it has one.
    # Top-level keys of the extra (those before its first table) go first, before any table.
    rows = f"max_active = {max_active}\n" if isinstance(max_active, int) else f'max_active = "{max_active}"\n'
    lines = config_extra.splitlines(keepends=True)
    first_table = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("[")), len(lines))
    top, config_extra = "".join(lines[:first_table]), "".join(lines[first_table:])
    if top and not top.endswith("\n"):
        top += "\n"
    if "[scheduler]\n" in config_extra:
        cfg.write_text(top + f"[http]\nport = {port}\n" + config_extra.replace("[scheduler]\n", "[scheduler]\n" + rows, 1))
    else:
        cfg.write_text(top + f"[scheduler]\n{rows}[http]\nport = {port}\n" + config_extra)
    daemon = subprocess.Popen([sys.executable, "-m", "daemon.cli", "serve", "--model", model, "--endpoint",
                               endpoint, "--config", str(cfg), "--log-format", "json"], cwd=REPO,
                              stdout=open(tmp / "daemon.log", "w"), stderr=subprocess.STDOUT, env=env)
    try:
        wait_until_answering(endpoint, daemon, timeout_s=timeout_s, log_path=tmp / "daemon.log")
        front = subprocess.Popen([sys.executable, "-m", "daemon.cli", "http", "--config", str(cfg), "--endpoint",
                                  endpoint, "--log-level", "warning"], cwd=REPO, stdout=open(tmp / "front.log", "w"),
                                 stderr=subprocess.STDOUT, env=env)
    except BaseException:
        stop([daemon])
        raise
    try:
        wait_http(f"http://127.0.0.1:{port}/health", front, timeout_s=timeout_s)
    except BaseException:
        stop([daemon, front])
        raise
    return [daemon, front], endpoint, port


def start_mlx_lm_server(model: str, tmp: Path, env: dict, timeout_s: float = 300.0) -> tuple[subprocess.Popen, int]:
    """mlx_lm.server on ``model`` and the port it answers on."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mlx_lm", "server", "--model", model, "--port", str(port),
                             "--log-level", "WARNING"], cwd=REPO, stdout=open(tmp / "mlx_server.log", "w"),
                            stderr=subprocess.STDOUT, env=env)
    try:
        wait_http(f"http://127.0.0.1:{port}/v1/models", proc, timeout_s=timeout_s)
    except BaseException:
        stop([proc])
        raise
    return proc, port


def stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM each process still running, last started first (the front before its daemon),
    and wait for it to drain; a kill after 60 s."""
    for p in reversed(procs):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
