"""Faults against a real daemon process: clients that die or hang mid-stream, a daemon that
is killed and restarted on the same endpoint, retried requests, consumers that stop
reading, and a model that raises mid-decode. In every case the other clients are served
and every request gets exactly one terminal message."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import zmq

from e2e_harness import REPO, start_daemon
from protocol import (
    Client,
    DaemonError,
    DaemonUnavailable,
    Done,
    Error,
    Generate,
    InvalidRequest,
    Ping,
    Status,
    StatusReply,
    Tokens,
    decode_daemon,
    encode,
)

HEARTBEAT_TIMEOUT_S = 2.0
CONFIG = f"heartbeat_timeout_s = {HEARTBEAT_TIMEOUT_S}\nheartbeat_interval_s = 0.5\n"
# A small per-client send queue, so a consumer that stops reading is cut quickly; healthy
# clients that read promptly never come near it.
SEND_HWM = 32
# Cut once the queue has stayed full this long (tests/e2e/test_slow_consumer_grace.py tests
# the grace itself): short here, so the cut below comes soon after the queue fills.
GRACE_S = 1.0

# A client that starts a long request, says so on stdout, then stops reading and sleeps:
# the test kills it (SIGKILL) or freezes it (SIGSTOP) there. argv[2] == "stream": a
# streamed request, after 3 chunks; else stream=False (nothing flows back until the Done,
# so only the heartbeat timeout can notice a frozen client), after Accepted.
_VICTIM = r"""
import sys, time, zmq
from protocol import Accepted, Generate, Hello, Tokens, decode_daemon, encode
stream = sys.argv[2] == "stream"
s = zmq.Context.instance().socket(zmq.DEALER)
s.setsockopt(zmq.RCVTIMEO, 30000)  # cut before it started (a terminal, then silence): exit, never hang the test
s.connect(sys.argv[1])
s.send(encode(Hello(seat="victim")))
s.send(encode(Generate(request_id="victim-1", prompt="def victim():", max_tokens=4000, stream=stream)))
n = 0
while n < (3 if stream else 1):
    if isinstance(decode_daemon(s.recv()), Tokens if stream else Accepted):
        n += 1
print("started", flush=True)
time.sleep(600)
"""


def _status(endpoint: str) -> StatusReply:
    with Client(endpoint, seat="ops", timeout_s=10) as c:
        return c.status()


def _events(d, name: str) -> list[dict]:
    return [e for e in d.events() if e["event"] == name]


def _wait_gone(d, rid: str, timeout_s: float) -> float:
    """Seconds until the daemon no longer holds request ``rid`` (status shows it gone)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        st = _status(d.endpoint)
        if not any(a["request_id"] == rid for a in st.detail["active_requests"]) and st.detail["in_flight"] == 0:
            return time.monotonic() - t0
        time.sleep(0.1)
    raise AssertionError(f"{rid} still in flight after {timeout_s} s: {_status(d.endpoint).detail}")


@pytest.fixture(scope="module")
def faults_daemon(tmp_path_factory, e2e_model):
    tmp = tmp_path_factory.mktemp("faults")
    d = start_daemon(tmp, e2e_model, config=CONFIG + f"client_send_hwm = {SEND_HWM}\nslow_consumer_grace_s = {GRACE_S}\n")
    yield d
    assert d.stop() == 0, d.log_path.read_text()[-3000:]


def _bystander(endpoint: str, results: dict, n: int = 120) -> None:
    """A healthy client streaming beside the fault; records its chunks' seqs and terminal."""
    try:
        with Client(endpoint, seat="bystander", timeout_s=30) as c:
            s = c.generate("class Healthy:", max_tokens=n)
            list(s)
            results["done"] = s.done
            results["tokens"] = len(s.token_ids)
    except Exception as exc:  # reported by the test
        results["error"] = exc


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["sigkill", "sigstop"])
def test_client_dies_mid_stream(faults_daemon, sig):
    """A killed client's connection closes: the next send to it fails (EHOSTUNREACH) and
    its streamed work is cancelled at once. A frozen one keeps its connection open and,
    with a non-streamed request, receives nothing: the heartbeat timeout ends its work.
    Either way within heartbeat_timeout_s (+ slack), others unaffected."""
    d = faults_daemon
    mode = "stream" if sig == signal.SIGKILL else "complete"
    victim = subprocess.Popen([sys.executable, "-c", _VICTIM, d.endpoint, mode], cwd=REPO, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert victim.stdout.readline().strip() == "started"
        results: dict = {}
        t = threading.Thread(target=_bystander, args=(d.endpoint, results))
        t.start()
        victim.send_signal(sig)
        gone_s = _wait_gone(d, "victim-1", HEARTBEAT_TIMEOUT_S + 10)
        t.join(60)
    finally:
        victim.kill()
        victim.wait()
    # Seen from here: each status poll is a fresh connection, slow on a loaded machine.
    assert gone_s < HEARTBEAT_TIMEOUT_S + 4.0, gone_s
    assert "error" not in results, results
    assert isinstance(results["done"], Done) and results["tokens"] == 120
    dropped = [e for e in _events(d, "client.dropped") if "victim-1" in e["requests"]]
    assert dropped and dropped[-1]["reason"] == "client_gone"
    if sig == signal.SIGSTOP:
        # The daemon's own clock: cut once silent past the timeout (checked every 0.25 s).
        timeouts = [e for e in _events(d, "client.timeout") if e["seat"] == "victim"]
        assert timeouts and HEARTBEAT_TIMEOUT_S <= timeouts[-1]["silent_s"] < HEARTBEAT_TIMEOUT_S + 2.0, timeouts
    ended = [e for e in _events(d, "request.error") if e["request_id"] == "victim-1"]
    assert ended and ended[-1]["code"] == "client_gone"
    assert d.proc.poll() is None


@pytest.mark.quick
def test_retried_generate_is_not_run_twice(faults_daemon):
    """A Lazy Pirate retry of the same request id on a fresh connection, in the same seat,
    while the first is still in flight: duplicate_request, and the first runs once."""
    d = faults_daemon
    rid = f"retry-{time.monotonic_ns()}"
    with Client(d.endpoint, seat="planner", timeout_s=30) as first, \
            Client(d.endpoint, seat="planner", timeout_s=30) as retry:
        # stream=False: nothing flows back until the Done, so this connection's small send
        # queue (SEND_HWM) cannot fill while the test talks to the other one.
        # Long enough to outlast the retry however slow the box (it is cancelled after it).
        s1 = first.generate("def retried():", max_tokens=4000, request_id=rid, stream=False)
        deadline = time.monotonic() + 60
        while not any(r["request_id"] == rid for r in first.status().detail["active_requests"]):
            assert time.monotonic() < deadline, "the first request never started"
            time.sleep(0.05)  # it is running
        with pytest.raises(InvalidRequest) as exc:
            retry.generate("def retried():", max_tokens=300, request_id=rid).result()
        assert exc.value.code == "duplicate_request"
        s1.cancel()
        done = s1.result()
        assert done.finish_reason == "cancelled" and 0 < done.usage.completion_tokens < 4000
        # Once the first has finished, the id is free again in the seat.
        again = retry.generate("def retried():", max_tokens=5, request_id=rid).result()
        assert again.usage.completion_tokens == 5
    accepted = [e for e in _events(d, "request.accepted") if e["request_id"] == rid]
    finished = [e for e in _events(d, "request.done") if e["request_id"] == rid]
    assert len(accepted) == 2 and len(finished) == 2  # the first and the later, legitimate reuse


def test_slow_consumer_is_cut_at_the_hwm(faults_daemon):
    """A client that stops reading (but still sends Pings, so it is alive): its requests end
    with slow_consumer when its send queue (client_send_hwm, small here) fills and stays full
    past slow_consumer_grace_s (1 s here); the daemon
    neither blocks nor grows, and delivers the terminal once the client reads again."""
    d = faults_daemon
    proc = psutil.Process(d.proc.pid)
    rss_before = proc.memory_info().rss
    slow = zmq.Context.instance().socket(zmq.DEALER)
    slow.setsockopt(zmq.RCVHWM, 1)
    slow.setsockopt(zmq.LINGER, 0)
    slow.connect(d.endpoint)
    rids = [f"slow-{i}" for i in range(4)]
    for rid in rids:
        slow.send(encode(Generate(request_id=rid, prompt="def slow():", max_tokens=4000)))
    # Alive, just not reading: a thread of its own pings every 0.2 s, so on a loaded machine
    # a slow status round trip below cannot starve the pings (the daemon would then rightly
    # end the requests with client_gone, and this test would test the wrong thing).
    stop_pinging = threading.Event()

    def keep_alive():
        while not stop_pinging.wait(0.2):
            slow.send(encode(Ping(nonce=1)))

    pinger = threading.Thread(target=keep_alive, daemon=True)
    pinger.start()
    # Meanwhile the daemon answers others at once, and a healthy stream completes.
    ping = d.raw_socket(timeout_ms=10000)
    worst_ping = 0.0
    t0 = time.monotonic()
    # First until the daemon holds the slow requests (they travel on another connection: a
    # status answered before they arrive says in_flight 0 too, and stopping the pings then
    # would let the heartbeat timeout end them as client_gone), then until they are cut.
    arrived = False
    while time.monotonic() - t0 < 30:
        t1 = time.monotonic()
        ping.send(encode(Status()))
        st = decode_daemon(ping.recv())
        worst_ping = max(worst_ping, time.monotonic() - t1)
        if not arrived:
            arrived = any(a["request_id"] in rids for a in st.detail["active_requests"])
        elif st.detail["in_flight"] == 0:
            break
        time.sleep(0.05)
    cut_s = time.monotonic() - t0
    stop_pinging.set()
    pinger.join()  # the socket is the main thread's again from here on
    assert arrived and st.detail["in_flight"] == 0, st.detail
    results: dict = {}
    _bystander(d.endpoint, results, n=50)
    assert results.get("tokens") == 50, results
    rss_after = proc.memory_info().rss
    ping.close()
    # When the slow client reads again it gets, per request, the chunks that were
    # queued (seq 0..k, no gap: later chunks of a cut request are dropped, not sent),
    # then exactly one terminal: the slow_consumer Error the daemon held for it.
    seen: dict[str, list] = {rid: [] for rid in rids}
    slow.setsockopt(zmq.RCVTIMEO, 200)
    t_read = time.monotonic()
    while time.monotonic() - t_read < 10 and not all(
            any(isinstance(x, (Done, Error)) for x in msgs) for msgs in seen.values()):
        try:
            msg = decode_daemon(slow.recv())
        except zmq.Again:
            continue
        if getattr(msg, "request_id", None) in seen:
            seen[msg.request_id].append(msg)
    slow.close()
    for rid, msgs in seen.items():
        seqs = [x.seq for x in msgs if isinstance(x, Tokens)]
        assert seqs == list(range(len(seqs))), (rid, seqs)
        terminals = [x for x in msgs if isinstance(x, (Done, Error))]
        assert len(terminals) == 1 and terminals[0].code == "slow_consumer", (rid, terminals)
        assert msgs[-1] is terminals[0]
    assert d.proc.poll() is None
    cut = [e for e in _events(d, "request.error") if e["request_id"] in rids]
    assert sorted(e["request_id"] for e in cut) == rids and {e["code"] for e in cut} == {"slow_consumer"}
    dropped = [e for e in _events(d, "client.dropped") if set(e["requests"]) & set(rids)]
    assert dropped and dropped[0]["reason"] == "slow_consumer"
    # One cancel per request, not one log line per undeliverable chunk.
    assert sum(len(e["requests"]) for e in dropped) == len(rids)
    # A daemon blocked on the slow consumer would stall for the whole 4 x 4000 tokens; the
    # bound leaves room for a machine whose cores are busy with other work.
    assert cut_s < 20 and worst_ping < 5.0, (cut_s, worst_ping)
    assert rss_after - rss_before < 64 << 20, (rss_before, rss_after)
    # Logged once the send succeeded, so it can land just after the client has read it.
    deadline = time.monotonic() + 15
    while not any(e["event"] == "client.terminal_delivered" for e in d.events()):
        assert time.monotonic() < deadline, "no client.terminal_delivered event"
        time.sleep(0.1)
    print(f"slow consumer cut after {cut_s:.2f} s; worst status round trip {worst_ping * 1000:.1f} ms; "
          f"rss {rss_before >> 20} -> {rss_after >> 20} MiB")


def test_model_failure_mid_decode(tmp_path, e2e_model):
    """debug_fail_after_tokens makes the decode raise after 20 tokens: that request ends
    with `internal`, exactly once, and the daemon serves on (shorter requests, status)."""
    d = start_daemon(tmp_path, e2e_model, config=CONFIG + "debug_fail_after_tokens = 20\n")
    try:
        with Client(d.endpoint, seat="faulty", timeout_s=30) as c:
            s = c.generate("def doomed():", max_tokens=200)
            with pytest.raises(DaemonError) as exc:
                list(s)
            assert exc.value.code == "internal" and "injected fault" in exc.value.message
            assert len(s.token_ids) == 20  # what it streamed before the failure, in order
            for i in range(3):  # the daemon serves on
                assert c.generate(f"def ok{i}():", max_tokens=10).result().usage.completion_tokens == 10
            assert c.status().detail["in_flight"] == 0
            # Several failing at once, interleaved with healthy ones.
            streams = [c.generate(f"def f{i}():", max_tokens=100 if i % 2 else 8) for i in range(6)]
            outcomes = []
            for st in streams:
                try:
                    outcomes.append(st.result().finish_reason)
                except DaemonError as e:
                    outcomes.append(e.code)
            assert outcomes == ["length", "internal"] * 3
        assert d.proc.poll() is None
    finally:
        assert d.stop() == 0
    failed = _events(d, "request.failed")
    assert len(failed) == 4 and all("InjectedFault" in e["error"] for e in failed)


def test_daemon_killed_and_restarted(tmp_path, e2e_model):
    """SIGKILL the daemon mid-stream: the client's stream fails with DaemonUnavailable well
    within its timeout; calls while it is down fail within the timeout; the stale socket
    and lock file do not block a new daemon on the same endpoint, and the same Client
    object works again once it is up."""
    timeout_s = 5.0
    d1 = start_daemon(tmp_path, e2e_model, config=CONFIG)
    sock_path = Path(d1.endpoint[len("ipc://"):])
    lock_path = sock_path.with_name(sock_path.name + ".lock")
    client = Client(d1.endpoint, seat="survivor", timeout_s=timeout_s)
    try:
        s = client.generate("def long_running():", max_tokens=4000)
        it = iter(s)
        for _ in range(3):
            next(it)
        t_kill = time.monotonic()
        d1.proc.send_signal(signal.SIGKILL)
        d1.proc.wait()
        with pytest.raises(DaemonUnavailable) as exc:
            for _ in it:
                pass
        fail_s = time.monotonic() - t_kill
        assert fail_s < timeout_s, fail_s
        assert d1.endpoint in str(exc.value)
        # Down: a call fails with DaemonUnavailable, bounded by the timeout.
        down_timeout_s = 1.5
        with Client(d1.endpoint, timeout_s=down_timeout_s) as other:
            t0 = time.monotonic()
            with pytest.raises(DaemonUnavailable):
                other.status()
            down_s = time.monotonic() - t0
        assert down_s < down_timeout_s + 1.0
        assert sock_path.exists() and lock_path.exists()  # what the crash left behind
        # Restart on the same endpoint; the same Client reconnects on its next call.
        t_restart = time.monotonic()
        d2 = start_daemon(tmp_path, e2e_model, config=CONFIG, wait=False)
        try:
            while True:
                assert d2.proc.poll() is None, d2.log_path.read_text()[-3000:]
                try:
                    # A Pong means serving (Status is answered while the model still loads).
                    client.ping()
                    break
                except DaemonUnavailable:
                    assert time.monotonic() - t_restart < 120
            recovered_s = time.monotonic() - t_restart
            st = client.status()
            assert st.detail["pid"] == d2.proc.pid
            assert client.generate("def again():", max_tokens=8).result().usage.completion_tokens == 8
        finally:
            client.close()
            assert d2.stop() == 0
    finally:
        client.close()
        if d1.proc.poll() is None:
            d1.proc.kill()
    print(f"daemon SIGKILL -> client DaemonUnavailable in {fail_s * 1000:.0f} ms; call while down failed after "
          f"{down_s:.2f} s (timeout {down_timeout_s} s); restart -> client reconnected in {recovered_s:.2f} s")
