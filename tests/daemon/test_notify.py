"""daemon.socket_side.notify against a real AF_UNIX datagram socket standing in for systemd."""

from __future__ import annotations

import os
import socket
import time
import uuid

import pytest

from daemon.socket_side.notify import Notifier, WatchdogPacer, watchdog_interval_s

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)


class FakeManager:
    """Receives sd_notify datagrams the way systemd does."""

    def __init__(self, address: str | bytes) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)
        self.sock.settimeout(2.0)

    def recv(self) -> dict[str, str]:
        data = self.sock.recv(4096).decode()
        return dict(line.split("=", 1) for line in data.split("\n"))

    def pending(self) -> list[dict[str, str]]:
        out = []
        self.sock.setblocking(False)
        try:
            while True:
                data = self.sock.recv(4096).decode()
                out.append(dict(line.split("=", 1) for line in data.split("\n")))
        except BlockingIOError:
            pass
        finally:
            self.sock.settimeout(2.0)
        return out

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def manager(tmp_path):
    path = str(tmp_path / "notify.sock")
    m = FakeManager(path)
    yield m, path
    m.close()


def test_messages_reach_the_socket(manager):
    m, path = manager
    n = Notifier({"NOTIFY_SOCKET": path})
    assert n.enabled
    assert n.ready("serving")
    assert m.recv() == {"READY": "1", "STATUS": "serving"}
    assert n.status("loading\nmodel   x")
    assert m.recv() == {"STATUS": "loading model x"}  # one line, never a second assignment
    assert n.watchdog()
    assert m.recv() == {"WATCHDOG": "1"}
    assert n.stopping()
    assert m.recv() == {"STOPPING": "1"}
    assert n.extend_timeout(2.5)
    assert m.recv() == {"EXTEND_TIMEOUT_USEC": "2500000"}
    assert n.extend_timeout(120, status="loading x: 40%")
    assert m.recv() == {"EXTEND_TIMEOUT_USEC": "120000000", "STATUS": "loading x: 40%"}  # one datagram
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert n.reloading()
    msg = m.recv()
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert msg["RELOADING"] == "1"
    assert before <= int(msg["MONOTONIC_USEC"]) <= after
    n.close()


def test_abstract_socket_name():
    name = f"councild-test-{uuid.uuid4().hex}"
    m = FakeManager(b"\0" + name.encode())
    try:
        n = Notifier({"NOTIFY_SOCKET": "@" + name})
        assert n.ready()
        assert m.recv() == {"READY": "1"}
    finally:
        m.close()


def test_unset_socket_is_a_no_op():
    n = Notifier({})
    assert not n.enabled
    assert n.ready() is False
    assert n.watchdog() is False
    assert n.status("x") is False
    assert WatchdogPacer(n, 30).tick() is False


def test_send_failure_never_raises(tmp_path):
    # The socket path does not exist (manager gone): logged, False, no exception.
    n = Notifier({"NOTIFY_SOCKET": str(tmp_path / "missing.sock")})
    assert n.enabled
    assert n.ready() is False
    assert n.watchdog() is False
    # ...and it recovers when the manager comes (back).
    m = FakeManager(str(tmp_path / "missing.sock"))
    try:
        assert n.watchdog() is True
        assert m.recv() == {"WATCHDOG": "1"}
    finally:
        m.close()


def test_unsupported_address_is_disabled():
    assert not Notifier({"NOTIFY_SOCKET": "vsock:2:1234"}).enabled
    assert not Notifier({"NOTIFY_SOCKET": "relative/path"}).enabled


def test_unset_environment(monkeypatch, manager):
    _, path = manager
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    n = Notifier(unset_environment=True)
    assert n.enabled and n.watchdog_interval_s() == 30.0
    assert "NOTIFY_SOCKET" not in os.environ and "WATCHDOG_USEC" not in os.environ


def test_watchdog_interval_from_env():
    pid = os.getpid()
    assert watchdog_interval_s({}) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000"}) == 30.0
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(pid)}) == 30.0
    # Inherited by a process it was not meant for.
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(pid + 1)}) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "soon"}) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "1000", "WATCHDOG_PID": "x"}) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "5000000", "WATCHDOG_PID": "42"}, pid=42) == 5.0


def test_pacer_rate_limits_to_half_the_interval(manager):
    m, path = manager
    now = [100.0]
    n = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "30000000"})
    pacer = WatchdogPacer(n, clock=lambda: now[0])
    assert pacer.enabled and pacer.period_s == 15.0
    sent = []
    # A busy decode loop: a tick every 10 ms for 60 simulated seconds.
    for _ in range(6000):
        sent.append(pacer.tick())
        now[0] += 0.01
    assert sum(sent) == len(m.pending()) == pacer.sent
    # 60 s / 15 s = 4 sends (t=100, 115, 130, 145), not 6000.
    assert pacer.sent == 4
    # A loop that stalls longer than the period sends on its next tick.
    now[0] += 100
    assert pacer.tick() is True
    assert m.recv() == {"WATCHDOG": "1"}
    # progress() is the same call (the server's engine hook uses that name).
    now[0] += 15
    assert pacer.progress() is True and pacer.progress() is False
    assert m.recv() == {"WATCHDOG": "1"}


def test_pacer_with_real_clock(manager):
    m, path = manager
    n = Notifier({"NOTIFY_SOCKET": path})
    seen: list[float] = []

    def clock() -> float:  # the real clock, its readings kept
        seen.append(time.monotonic())
        return seen[-1]

    pacer = WatchdogPacer(n, interval_s=0.2, clock=clock)  # period 0.1 s
    deadline = time.monotonic() + 0.35
    sent_at = []
    while time.monotonic() < deadline:
        if pacer.tick():
            sent_at.append(seen[-1])
    assert len(m.pending()) == len(sent_at) >= 2
    # Each send came at the first tick at least a period after the one before (whatever
    # the scheduler allowed between ticks on a busy box), never earlier.
    for prev, at in zip(sent_at, sent_at[1:]):
        assert at - prev >= 0.1
        assert not [t for t in seen if prev + 0.1 <= t < at], (prev, at)


def test_pacer_disabled_without_watchdog(manager):
    _, path = manager
    pacer = WatchdogPacer(Notifier({"NOTIFY_SOCKET": path}))
    assert not pacer.enabled
    assert pacer.tick() is False
