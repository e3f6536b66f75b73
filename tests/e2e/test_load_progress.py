"""A model load is visible: progress events in the log, status answering "loading" while it
lasts, and systemd's start timeout extended through NOTIFY_SOCKET (a real datagram socket
standing in for systemd)."""

from __future__ import annotations

import socket
import threading
import time

from protocol import decode_daemon, encode
from protocol import messages as m

from e2e_harness import HeldLoad, start_daemon, wait_ready


def test_load_progress_status_and_systemd_timeout(tmp_path, e2e_model):
    notify_path = str(tmp_path / "notify.sock")
    manager = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    manager.bind(notify_path)
    manager.settimeout(0.05)
    states, datagrams, refused = [], [], None
    listening = threading.Event()
    listening.set()

    def listen() -> None:
        """Read the datagrams as they come, as systemd does: the kernel queues only
        net.unix.max_dgram_qlen (10 here) of them, and a load of the small test model sends
        ~30 within a millisecond, which a reader between status polls lost (EAGAIN)."""
        while listening.is_set():
            try:
                datagrams.append(manager.recv(4096).decode())
            except (socket.timeout, BlockingIOError):
                pass

    reader = threading.Thread(target=listen, daemon=True)
    reader.start()
    # The load is held at its first read of config.json until the test has its answers from
    # "during the load": the small model loads in ~0.3 s, and a Generate sent at a "loading"
    # answer raced the load's end (CI failed on it twice, 2026-12-02).
    held = HeldLoad(tmp_path, e2e_model)
    d = start_daemon(tmp_path, held.path, env={"NOTIFY_SOCKET": notify_path}, wait=False)
    sock = d.raw_socket(timeout_ms=200)
    sock.send(encode(m.Generate(request_id="early", prompt="x", max_tokens=1)))  # held until the daemon binds
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and "serving" not in states:
            if refused is not None and "loading" in states:
                held.release()
            sock.send(encode(m.Status()))
            try:
                while True:  # this Status's answer, and the early Generate's where it comes first
                    reply = decode_daemon(sock.recv())
                    if getattr(reply, "request_id", None) == "early":
                        refused = reply
                        continue
                    states.append(reply.detail["state"])
                    break
            except Exception:  # zmq.Again: the socket is not bound yet, or no answer yet
                pass
        # The first "serving" answer means it: a request sent at once is accepted, not refused
        # as "still loading" (start-up's last steps ran between the two once: a front that
        # read "serving" passed a request through to a 429).
        first = None
        if states and states[-1] == "serving":
            sock.send(encode(m.Generate(request_id="first", prompt="x", max_tokens=1)))
            while first is None:
                got = decode_daemon(sock.recv())
                if getattr(got, "request_id", None) == "first" and not isinstance(got, m.Tokens):
                    first = got
        wait_ready(d)
        time.sleep(0.3)
    finally:
        held.close()
        sock.close()
        listening.clear()
        reader.join(5)
        manager.close()
        assert d.stop() == 0
    assert states and states[0] == "loading" and states[-1] == "serving", states
    assert isinstance(first, (m.Accepted, m.Done)), first
    # A request sent during the load is refused with a retry hint, never queued half-loaded.
    assert isinstance(refused, m.Error), refused
    assert refused.code == "overloaded" and "still loading" in refused.message and refused.retry_after_s
    progress = [e for e in d.events() if e["event"] == "model.load_progress"]
    percents = [e["percent"] for e in progress]
    assert percents == sorted(percents) and percents[-1] == 100 and len(percents) >= 10, percents
    assert progress[-1]["bytes_loaded"] == progress[-1]["bytes_total"] > 0
    extends = [i for i, g in enumerate(datagrams) if "EXTEND_TIMEOUT_USEC=120000000" in g]
    ready = [i for i, g in enumerate(datagrams) if "READY=1" in g]
    assert len(extends) >= 2 and ready and max(extends) < ready[0], datagrams
    assert any("STATUS=loading" in g and "100%" in g for g in datagrams), "\n".join(datagrams)
