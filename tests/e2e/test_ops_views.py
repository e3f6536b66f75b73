"""What operators see: `councild top` in a real (pseudo-)terminal against a real daemon under a
council's load, and `councild governor timeline` drawn from that daemon's own log.

The terminal is a pseudo-terminal (pexpect) whose output is fed to a terminal emulator (pyte),
so the test reads the screen a person would see, at the size the terminal has."""

from __future__ import annotations

import shutil
import sys
import threading
import time

import pexpect
import pyte
import pytest

from daemon.paths import BUNDLED_MODEL
from e2e_harness import REPO, start_daemon
from governor.timeline import main as timeline_main
from governor.timeline_data import read_timeline
from governor.timeline_plot import figure
from protocol.client import Client, CouncilError

COUNCIL = {"planner": "def fibonacci(n):\n", "coder": "class Stack:\n    def __init__(self):\n",
           "critic": "import os\n\n\ndef walk(path):\n"}


class Terminal:
    """`councild top` in a pseudo-terminal, and the screen it draws."""

    def __init__(self, endpoint: str, rows: int = 40, cols: int = 120):
        self.screen = pyte.Screen(cols, rows)
        self.stream = pyte.ByteStream(self.screen)
        env = {k: v for k, v in __import__("os").environ.items() if k not in ("COLUMNS", "LINES")}
        env.update(TERM="xterm-256color", PYTHONPATH=str(REPO))
        self.child = pexpect.spawn(sys.executable, ["-m", "daemon.cli", "top", "--endpoint", endpoint,
                                                    "--interval", "0.5", "--timeout", "1.5"],
                                   cwd=str(REPO), env=env, dimensions=(rows, cols))

    @property
    def text(self) -> str:
        return "\n".join(self.screen.display)

    def pump(self, seconds: float = 0.2) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                self.stream.feed(self.child.read_nonblocking(65536, timeout=0.1))
            except pexpect.TIMEOUT:
                pass

    def wait_for(self, check, what: str, timeout: float = 120.0):  # a loaded CI box is slow
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.pump()
            found = check(self.screen.display)
            if found:
                return found
        raise AssertionError(f"the screen never showed {what}:\n{self.text}")

    def resize(self, rows: int, cols: int) -> None:
        self.screen.resize(rows, cols)
        self.child.setwinsize(rows, cols)


def decoding_seats(lines: list[str]) -> set[str]:
    """Seats whose row says they have a request decoding (columns: seat active queued decoding ...)."""
    out = set()
    for line in lines:
        cells = line.split()
        if len(cells) >= 4 and cells[0] in COUNCIL and cells[3].isdigit() and int(cells[3]) > 0:
            out.add(cells[0])
    return out


def council(endpoint: str, stop: threading.Event, errors: list) -> list[threading.Thread]:
    def member(seat: str, prompt: str) -> None:
        try:
            with Client(endpoint, seat=seat, timeout_s=60) as c:
                while not stop.is_set():
                    c.complete(prompt, max_tokens=48)
        except CouncilError as exc:  # pragma: no cover - reported by the test
            errors.append(f"{seat}: {exc}")

    threads = [threading.Thread(target=member, args=item, daemon=True) for item in COUNCIL.items()]
    for t in threads:
        t.start()
    return threads


@pytest.mark.quick
def test_top_prints_one_plain_frame_when_stdout_is_not_a_terminal(bundled_daemon):
    import subprocess

    with Client(bundled_daemon.endpoint, seat="top-frame", timeout_s=30) as c:
        c.complete("def f(x):\n", max_tokens=4)  # the seat has a row, with its TTFT
    out = subprocess.run([sys.executable, "-m", "daemon.cli", "top", "--endpoint", bundled_daemon.endpoint],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for panel in ("councild top", "seats", "top-frame", "batch", "MTP head", "memory", "governor decisions"):
        assert panel in out.stdout, out.stdout
    assert "\x1b[" not in out.stdout  # plain text: no escape codes into a pipe or a file
    missing = subprocess.run([sys.executable, "-m", "daemon.cli", "top", "--once", "--timeout", "0.5",
                              "--endpoint", "ipc:///nonexistent/councild.sock"],
                             cwd=REPO, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1 and missing.stderr.startswith("councild:") and not missing.stdout


def test_top_live_through_load_a_key_an_eviction_a_resize_and_a_restart_then_the_runs_timeline(tmp_path):
    """One daemon of its own (the test stops and restarts it): `top` follows it, and the log of
    the same council run, with its forced eviction, becomes the timeline."""
    d = start_daemon(tmp_path, BUNDLED_MODEL)
    stop, errors = threading.Event(), []
    threads = council(d.endpoint, stop, errors)
    term = Terminal(d.endpoint)
    try:
        # Under load: the seats that decode are on screen, each with a request decoding.
        term.wait_for(lambda lines: len(decoding_seats(lines)) >= 2, "two seats decoding")
        assert "serving" in term.text and f"pid {d.proc.pid}" in term.text
        # A key: s sorts the seats by active requests; enter expands the seat under the cursor.
        term.child.send("s")
        term.wait_for(lambda lines: "sort: active" in lines[0] + lines[1], "the sort key change")
        term.child.send("p")  # pause: the screen holds, and says so
        term.wait_for(lambda lines: "PAUSED" in lines[0] + lines[1], "the pause")
        term.child.send("p")
        term.wait_for(lambda lines: "PAUSED" not in lines[0] + lines[1], "the pause lifted")
        term.child.send("\r")
        term.wait_for(lambda lines: any(line.strip().startswith(("│ seat ", "seat ")) and "active," in line
                                        for line in lines), "the expanded seat")
        # A forced eviction mid-run: the head panel and the decisions follow.
        with Client(d.endpoint, seat="ops", timeout_s=30) as c:
            before = time.time()
            assert c.governor("evict_head").ok
            after = time.time()
        term.wait_for(lambda lines: "not resident" in "\n".join(lines) and "evict_head" in "\n".join(lines),
                      "the eviction")
        # tab moves to the decisions; enter expands the newest with every input it was logged with.
        term.child.send("\t")
        term.child.send("\r")
        term.wait_for(lambda lines: any('"decision": "' in line for line in lines), "an expanded decision")
        # A resize: the screen is drawn again at the new size, the footer on its last line.
        term.resize(30, 90)
        term.wait_for(lambda lines: len(lines) == 30 and "quit" in lines[-1] and "councild top" in lines[0],
                      "the screen at 90x30")
        stop.set()
        for t in threads:
            t.join(60)
        assert not errors, errors
        with Client(d.endpoint, seat="ops", timeout_s=30) as c:
            assert c.governor("auto").ok
        # The daemon restarts: top says it is unreachable, then follows the new process.
        assert d.stop() == 0
        log = tmp_path / "council-run.log"
        shutil.copy(d.log_path, log)  # the restart writes a new log in its place
        term.wait_for(lambda lines: "unreachable" in "\n".join(lines), "unreachable")
        d = start_daemon(tmp_path, BUNDLED_MODEL)
        term.wait_for(lambda lines: f"pid {d.proc.pid}" in "\n".join(lines) and "unreachable" not in "\n".join(lines),
                      "the restarted daemon")
        term.child.send("q")
        term.child.expect(pexpect.EOF, timeout=30)
        term.child.close()
        assert term.child.exitstatus == 0, (term.child.exitstatus, term.child.signalstatus)
    finally:
        stop.set()
        term.child.close(force=True)
        assert d.stop() == 0

    # The timeline of that run: the eviction where it happened, the council's load before it.
    tl = read_timeline(str(log))
    assert tl.notes == [], tl.notes
    fig = figure(tl)
    evict = [t for t in fig.data if t.name == "what it did: evict_head"]
    assert evict and any(before - 0.05 <= x.timestamp() <= after + 0.05 for x in evict[0].x), (before, after, evict)
    assert "operator override" in " ".join(evict[0].hovertext)
    (evicted,) = [t for t in fig.data if t.name == "head evicted"]
    assert [x for x in evicted.x if before - 0.05 <= x.timestamp() <= after + 0.05]
    (resident,) = [t for t in fig.data if t.name == "what it did: head resident"]
    assert list(resident.y[:2]) == [1.0, 0.0]  # loaded at start-up, out at the eviction
    (flight,) = [t for t in fig.data if t.name == "seats with work"]
    assert max(flight.y) == 3
    (rate,) = [t for t in fig.data if t.name == "tokens per second"]
    assert max(rate.y) > 0
    # And the command writes it.
    out = tmp_path / "council.html"
    assert timeline_main([str(log), "-o", str(out)]) == 0 and out.stat().st_size > 100_000
