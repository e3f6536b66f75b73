"""Logs: a real daemon on a terminal writes the human console format; every request event
names its request and seat; docs/OPERATIONS.md lists every event the code emits."""

from __future__ import annotations

import os
import pty
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest

from e2e_harness import REPO
from protocol import Cancel, Done, Error, Generate, Hello, Ping, Pong, Tokens, decode_daemon, encode

import zmq

# A console line: "2026-11-29T08:32:48.270201Z [info     ] request.done    key=value key=value"
CONSOLE_LINE = re.compile(r"^\d{4}-\d\d-\d\dT[\d:.]+Z \[(?P<level>\w+)\s*\] (?P<event>[a-z_]+\.[a-z_.]+)\s*(?P<rest>.*)$")
FIELD = re.compile(r"(\w+)=('[^']*'|\S+)")


class TtyDaemon:
    """`councild serve` with stdin/stdout/stderr on a pseudo-terminal, as when someone runs
    it in a shell; a thread keeps the terminal drained."""

    def __init__(self, tmp: Path, model: Path, config: str):
        self.runtime = tmp / "run"
        self.runtime.mkdir(mode=0o700)
        self.endpoint = f"ipc://{self.runtime / 'councild.sock'}"
        (tmp / "c.toml").write_text(config)
        env = dict(os.environ, COUNCILD_RUNTIME_DIR=str(self.runtime), PYTHONUNBUFFERED="1", TERM="dumb")
        env.pop("COUNCILD_LOG_FORMAT", None)
        master, slave = pty.openpty()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "daemon.cli", "serve", "--model", str(model), "--endpoint", self.endpoint,
             "--config", str(tmp / "c.toml")],
            cwd=REPO, env=env, stdin=slave, stdout=slave, stderr=slave, close_fds=True)
        os.close(slave)
        self.master = master
        self.output = b""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:  # EIO: the child closed the terminal
                return
            if not data:
                return
            self.output += data

    def text(self) -> str:
        return self.output.decode("utf-8", "replace").replace("\r\n", "\n")

    def lines(self) -> list[str]:
        return [line for line in self.text().splitlines() if line.strip()]

    def events(self) -> list[dict]:
        """Parsed console lines: {'event', 'level', field: value...} (values as printed)."""
        out = []
        for line in self.lines():
            m = CONSOLE_LINE.match(line)
            if m:
                out.append({"event": m["event"], "level": m["level"], **dict(FIELD.findall(m["rest"]))})
        return out

    def wait_for(self, event: str, timeout: float = 90.0, count: int = 1) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sum(1 for e in self.events() if e["event"] == event) >= count:
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited with {self.proc.returncode}:\n{self.text()[-3000:]}")
            time.sleep(0.05)
        raise AssertionError(f"no {event} within {timeout} s:\n{self.text()[-3000:]}")

    def socket(self) -> zmq.Socket:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 20000)
        sock.connect(self.endpoint)
        return sock

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self._reader.join(5)
        os.close(self.master)
        return code


def until_terminal(sock: zmq.Socket, request_id: str, cancel_after: int | None = None):
    n = 0
    while True:
        reply = decode_daemon(sock.recv())
        if getattr(reply, "request_id", None) != request_id:
            continue
        if isinstance(reply, Tokens):
            n += 1
            if n == cancel_after:
                sock.send(encode(Cancel(request_id=request_id)))
        elif isinstance(reply, (Done, Error)):
            return reply


@pytest.fixture(scope="module")
def tty_daemon(tmp_path_factory, e2e_model):
    # Fault injection makes a decode fail after 8 tokens (request.failed); shorter requests are unaffected.
    d = TtyDaemon(tmp_path_factory.mktemp("tty"), e2e_model, "debug_fail_after_tokens = 8\nmax_tokens = 512\n")
    d.wait_for("daemon.start")
    sock = d.socket()
    sock.send(encode(Hello(seat="alpha")))
    decode_daemon(sock.recv())
    # One of each request ending, all from seat "alpha".
    assert isinstance(until_terminal_after(sock, Generate(request_id="ok", prompt="def f(x):", max_tokens=4)), Done)
    term = until_terminal_after(sock, Generate(request_id="cancelled", prompt="def f(x):", max_tokens=8, stream=True),
                                cancel_after=1)
    assert isinstance(term, Done)
    term = until_terminal_after(sock, Generate(request_id="oov", prompt_tokens=[10**6], max_tokens=4))
    assert isinstance(term, Error) and term.code == "invalid_request"
    term = until_terminal_after(sock, Generate(request_id="boom", prompt="def f(x):", max_tokens=30))
    assert isinstance(term, Error) and term.code == "internal"
    term = until_terminal_after(sock, Generate(request_id="huge", prompt="x", max_tokens=513))
    assert isinstance(term, Error) and term.code == "invalid_request"
    # A frame that fails decoding but whose request id can be read (temperature < 0).
    sock.send(msgspec.msgpack.encode({"type": "generate", "v": 1, "request_id": "neg-temp", "prompt": "a",
                                      "temperature": -1.0}))
    reply = decode_daemon(sock.recv())
    assert isinstance(reply, Error) and reply.code == "invalid_request" and reply.request_id == "neg-temp"
    sock.send(encode(Ping(nonce=3)))
    assert decode_daemon(sock.recv()) == Pong(nonce=3)
    sock.close()
    d.wait_for("request.rejected", count=2, timeout=10)
    yield d
    assert d.stop() == 0, d.text()[-3000:]


def until_terminal_after(sock, msg: Generate, cancel_after: int | None = None):
    sock.send(encode(msg))
    return until_terminal(sock, msg.request_id, cancel_after)


def test_console_format_on_a_terminal(tty_daemon):
    lines = tty_daemon.lines()
    assert not [line for line in lines if line.lstrip().startswith("{")], "JSON on a terminal"
    events = tty_daemon.events()
    names = [e["event"] for e in events]
    for name in ("daemon.loading", "model.loaded", "daemon.start", "request.accepted", "request.done"):
        assert name in names, (name, tty_daemon.text()[-2000:])
    start = next(e for e in events if e["event"] == "daemon.start")
    assert start["level"] == "info" and start["endpoint"] == tty_daemon.endpoint
    assert "\x1b[" not in tty_daemon.text()  # no colour codes (they garble journald and files)


REQUEST_EVENTS = ("request.accepted", "request.done", "request.error", "request.failed")


def test_every_request_event_names_request_and_seat(tty_daemon):
    events = tty_daemon.events()
    seen = {}
    for e in events:
        if e["event"] in REQUEST_EVENTS:
            assert "request_id" in e and e.get("seat") == "alpha", e
            seen.setdefault(e["event"], set()).add(e["request_id"])
    assert seen["request.accepted"] >= {"ok", "cancelled", "boom"}
    assert seen["request.done"] >= {"ok", "cancelled"}
    assert seen["request.error"] >= {"oov", "boom"}
    assert seen["request.failed"] == {"boom"}
    failed = next(e for e in events if e["event"] == "request.failed")
    assert failed["level"] == "error"
    rejected = [e for e in events if e["event"] == "request.rejected" and e.get("request_id") == "huge"]
    assert rejected and rejected[0]["seat"] == "alpha" and rejected[0]["code"] == "invalid_request"


def test_rejected_invalid_frame_log_names_request_and_seat(tty_daemon):
    rejected = [e for e in tty_daemon.events() if e["event"] == "request.rejected" and e.get("code") == "invalid_request"]
    assert [e for e in rejected if e.get("request_id") == "neg-temp" and e.get("seat") == "alpha"], rejected


# ---------------------------------------------------------------------------- the doc
# A logger call with the event as first argument, or an event dict built by a processor
# (logs.py renames library records to one event).
EMIT = re.compile(r'(?:(?:\.(?:info|warning|error|debug|exception|critical)|\bemit)\(\s*|\{"event": )"([a-z_]+\.[a-z_.]+)"')


def emitted_events() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for root in ("daemon", "governor"):
        for path in (REPO / root).rglob("*.py"):
            for m in EMIT.finditer(path.read_text()):
                found.setdefault(m.group(1), set()).add(str(path.relative_to(REPO)))
    return found


def documented_events() -> dict[str, list[str]]:
    text = (REPO / "docs" / "OPERATIONS.md").read_text()
    table = text.split("## Log events", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in table.splitlines():
        m = re.match(r"^\| `([a-z_]+\.[a-z_.]+)` \|(.*)\|\s*$", line)
        if m:
            rows[m.group(1)] = [c.strip() for c in m.group(2).split("|")]
    return rows


@pytest.mark.quick
def test_operations_doc_lists_every_log_event():
    emitted = emitted_events()
    assert {"daemon.start", "request.done", "governor.decision", "notify.send_failed"} <= emitted.keys()
    rows = documented_events()
    missing = sorted(set(emitted) - set(rows))
    assert not missing, f"add these events to the Log events table of docs/OPERATIONS.md: {missing}"
    stale = sorted(set(rows) - set(emitted))
    assert not stale, f"the Log events table lists events no code emits any more: {stale}"
    for name, cells in rows.items():
        level, when, fields = cells[0], cells[1], cells[2]
        assert re.fullmatch(r"(debug|info|warning|error)( / (debug|info|warning|error))*", level), (name, level)
        assert when and fields, name
