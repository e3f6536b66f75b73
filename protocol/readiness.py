"""Wait for a daemon you just started to answer: for launchers, benchmarks and tests.

A ``Ping`` from a bare DEALER socket every 300 ms until any daemon message comes back. The
started process is watched as well, so a daemon that dies during start-up is reported at
once, with the end of its log when the caller names the log file.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import zmq

from .codec import decode_daemon, encode
from .messages import Ping


class DaemonNotReady(RuntimeError):
    """The daemon exited, or did not answer in time; the message says which."""


def _tail(log_path: Path | str | None, chars: int = 3000) -> str:
    if log_path is None:
        return ""
    try:
        return "\n" + Path(log_path).read_text(errors="replace")[-chars:]
    except OSError as exc:
        return f"\n(log {log_path} unreadable: {exc})"


def wait_until_answering(endpoint: str, proc: subprocess.Popen | None = None, *, timeout_s: float = 120.0,
                         log_path: Path | str | None = None, name: str = "daemon") -> None:
    """Return once the daemon at ``endpoint`` answers a Ping; raise DaemonNotReady if ``proc``
    exits first or ``timeout_s`` passes."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 300)
    sock.connect(endpoint)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise DaemonNotReady(f"{name} exited with code {proc.returncode} before it answered on "
                                     f"{endpoint}{_tail(log_path)}")
            sock.send(encode(Ping(nonce=1)))
            try:
                decode_daemon(sock.recv())
                return
            except zmq.Again:
                continue
        raise DaemonNotReady(f"{name} did not answer on {endpoint} within {timeout_s:.0f} s{_tail(log_path)}")
    finally:
        sock.close()
