"""Start a real daemon process on a real ipc socket, the way a service manager starts it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import zmq

from protocol.readiness import wait_until_answering

REPO = Path(__file__).resolve().parents[2]


class DaemonProcess:
    def __init__(self, endpoint: str, proc: subprocess.Popen, log_path: Path, runtime: Path):
        self.endpoint = endpoint
        self.proc = proc
        self.log_path = log_path
        self.runtime = runtime

    def events(self) -> list[dict]:
        out = []
        for line in self.log_path.read_text().splitlines():
            if line.startswith("{"):
                out.append(json.loads(line))
        return out

    def raw_socket(self, timeout_ms: int = 20000) -> zmq.Socket:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
        sock.connect(self.endpoint)
        return sock

    def stop(self, sig=signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def start_daemon(tmp: Path, model: Path, *extra: str, config: str | None = None, env: dict | None = None,
                 wait: bool = True, warmed: bool = True) -> DaemonProcess:
    """``wait``: until the daemon answers (ready); ``warmed``, with it: also until its start-up
    checks that run after ready are done (daemon/engine_thread/warming.py), so a test sees the
    paths a slow start had switched in, and their start-up events, before it starts."""
    runtime = tmp / "run"
    runtime.mkdir(mode=0o700, exist_ok=True)
    endpoint = f"ipc://{runtime / 'councild.sock'}"
    cmd = [sys.executable, "-m", "daemon.cli", "serve", "--model", str(model), "--endpoint", endpoint,
           "--log-format", "json", *extra]
    if config is not None:
        path = tmp / "councild.toml"
        path.write_text(config)
        cmd += ["--config", str(path)]
    log_path = tmp / "daemon.log"
    # Each test's daemons get their own cache folder (the prefix cache's disk tier lives
    # there): no test sees another's snapshots, a restart in the same tmp sees its own. The
    # start-up probes' verdicts (keyed by versions, engine source, device and model) are
    # shared through the user's cache, as every daemon of one install shares them: without
    # that, every test's daemon would pay both probes again.
    if "COUNCILD_CACHE_DIR" not in (env or {}):
        own = tmp / "cache"
        own.mkdir(exist_ok=True)
        link = own / "probe-verdicts"
        if not link.exists() and not link.is_symlink():
            shared = _user_cache() / "probe-verdicts"
            shared.mkdir(parents=True, exist_ok=True)
            link.symlink_to(shared, target_is_directory=True)
    env = {"COUNCILD_CACHE_DIR": str(tmp / "cache"), **(env or {})}
    full_env = dict(os.environ, COUNCILD_RUNTIME_DIR=str(runtime), PYTHONUNBUFFERED="1", **env)
    proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    d = DaemonProcess(endpoint, proc, log_path, runtime)
    if wait:
        wait_ready(d)
        if warmed:
            wait_warmed(d)
    return d


def wait_warmed(d: DaemonProcess, timeout_s: float = 120.0) -> None:
    """Until status says no start-up check is pending (``detail.warming.pending`` empty)."""
    import time

    from protocol.client import Client

    deadline = time.monotonic() + timeout_s
    with Client(d.endpoint, seat="harness-warmed", timeout_s=30) as c:
        while c.status().detail.get("warming", {}).get("pending"):
            if time.monotonic() > deadline or d.proc.poll() is not None:
                raise TimeoutError(f"the daemon's start-up checks were still pending after {timeout_s} s")
            time.sleep(0.05)


def _user_cache() -> Path:
    """The per-user cache folder a daemon without COUNCILD_CACHE_DIR would use."""
    from daemon.paths import cache_dir

    saved = os.environ.pop("COUNCILD_CACHE_DIR", None)
    try:
        return cache_dir()
    finally:
        if saved is not None:
            os.environ["COUNCILD_CACHE_DIR"] = saved


def wait_ready(d: DaemonProcess, timeout_s: float = 90.0) -> None:
    wait_until_answering(d.endpoint, d.proc, timeout_s=timeout_s, log_path=d.log_path)




class HeldLoad:
    """A copy of a model whose config.json is a FIFO: a daemon started on ``path`` blocks at
    the load's first read of it (after it has bound its socket and logged daemon.loading) until
    ``release()``, which hands that read the file's bytes and puts the real file in the FIFO's
place. A test then acts "during the
    load" for certain, however fast the load would be (the small test model's takes ~0.3 s).
    ``close()`` (also on exit of a ``with``) ends the writer."""

    def __init__(self, tmp: Path, model: Path):
        self.path = tmp / "held-model"
        shutil.copytree(model, self.path)
        fifo = self.path / "config.json"
        self._text = fifo.read_bytes()
        self._real = tmp / "held-config.json"
        fifo.rename(self._real)
        os.mkfifo(fifo)
        self._fifo = fifo
        self._released, self._closed = threading.Event(), threading.Event()
        self._writer = threading.Thread(target=self._serve, daemon=True)
        self._writer.start()

    def _serve(self) -> None:
        self._released.wait()
        with open(self._fifo, "wb") as f:  # returns once the daemon has opened it to read
            if self._closed.is_set():
                return
            # Later opens find the real file; the reader holding the FIFO gets its bytes once.
            os.replace(self._real, self._fifo)
            f.write(self._text)

    def release(self) -> None:
        self._released.set()

    def close(self) -> None:
        self._closed.set()
        self._released.set()
        try:  # a reader that opens and closes at once frees a writer blocked in open()
            os.close(os.open(self._fifo, os.O_RDONLY | os.O_NONBLOCK))
        except OSError:
            pass
        self._writer.join(5)

    def __enter__(self) -> "HeldLoad":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
