"""The slow-consumer grace (slow_consumer_grace_s) against a real daemon: a client whose
send queue fills is cut only if it stays full past the grace. One that pauses (a starved
machine, a GC) and reads again within it loses nothing; one that stops reading is cut with
slow_consumer once the grace has passed, and gets exactly one terminal per request."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import zmq

from e2e_harness import start_daemon
from protocol import Done, Error, Generate, Hello, Ping, Tokens, decode_daemon, encode

GRACE_S = 5.0
SEND_HWM = 32  # small, so the queue fills within seconds; the grace, not the HWM, decides
# max_active 5: the bystander and a reader's four requests decode together from the start.
# batching off: time-sliced, the five make ~a stream's rate. In one batched forward they made
# ~1,000 messages a second, and the stopped reader's backlog passed the daemon's cap (4,096
# messages: client_delivery.GRACE_BACKLOG_MIN) 4 s into the 5 s grace, which cuts it by
# design before the grace could be what decides.
CONFIG = (f"heartbeat_timeout_s = 30.0\nheartbeat_interval_s = 0.5\nclient_send_hwm = {SEND_HWM}\n"
          f"slow_consumer_grace_s = {GRACE_S}\n[scheduler]\nmax_active = 5\nbatching = false\n")
TOKENS = 2000  # the stopping reader's requests: still decoding when it is cut
# The pausing reader's: its queue is full after about 100 chunks per request (the daemon's
# queue plus the socket's buffer), so 600 leave most of each request to arrive after the
# pause, and every one of them must (a reader that pauses loses nothing).
PAUSER_TOKENS = 600


@pytest.fixture(scope="module")
def grace_daemon(tmp_path_factory, e2e_model):
    d = start_daemon(tmp_path_factory.mktemp("grace"), e2e_model, config=CONFIG)
    yield d
    assert d.stop() == 0, d.log_path.read_text()[-3000:]


def _ts(ev: dict) -> float:
    return datetime.datetime.fromisoformat(ev["timestamp"].replace("Z", "+00:00")).timestamp()


def _wait_event(d, pred, timeout_s: float, what: str, reader: "Reader | None" = None) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for ev in d.events():
            if pred(ev):
                return ev
        if reader is not None:
            reader.ping()  # not reading, but alive: the heartbeat timeout must not end its work
        time.sleep(0.05)
    raise AssertionError(f"no {what} within {timeout_s} s")


class Reader:
    """A raw client (so nothing in a library hides the protocol) that can stop reading: its
    receive queue holds one message, so the daemon's queue to it fills once it stops."""

    def __init__(self, endpoint: str, seat: str, n: int, tokens: int = TOKENS):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.RCVHWM, 1)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 200)
        self.sock.connect(endpoint)
        self.sock.send(encode(Hello(seat=seat)))
        self.rids = [f"{seat}-{i}-{time.monotonic_ns()}" for i in range(n)]
        for rid in self.rids:
            self.sock.send(encode(Generate(request_id=rid, prompt=f"def {seat}():", max_tokens=tokens)))
        self.seen: dict[str, list] = {rid: [] for rid in self.rids}
        self.pinged = 0.0

    def ping(self) -> None:
        if time.monotonic() - self.pinged > 0.5:
            self.sock.send(encode(Ping(nonce=1)))
            self.pinged = time.monotonic()

    def read(self, until, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not until() and time.monotonic() < deadline:
            self.ping()
            try:
                msg = decode_daemon(self.sock.recv())
            except zmq.Again:
                continue
            if getattr(msg, "request_id", None) in self.seen:
                self.seen[msg.request_id].append(msg)

    def started(self) -> bool:
        return all(any(isinstance(x, Tokens) for x in msgs) for msgs in self.seen.values())

    def ended(self) -> bool:
        return all(any(isinstance(x, (Done, Error)) for x in msgs) for msgs in self.seen.values())

    def check_one_terminal_each(self) -> list:
        terminals = []
        for rid, msgs in self.seen.items():
            seqs = [x.seq for x in msgs if isinstance(x, Tokens)]
            assert seqs == list(range(len(seqs))), (rid, seqs[:10])
            ends = [x for x in msgs if isinstance(x, (Done, Error))]
            assert len(ends) == 1 and msgs[-1] is ends[0], (rid, ends)
            terminals.append(ends[0])
        return terminals


def _bystander(endpoint: str, out: dict) -> None:
    from protocol import Client

    try:
        with Client(endpoint, seat="bystander", timeout_s=60) as c:
            out["done"] = c.generate("class Healthy:", max_tokens=400).result()
    except Exception as exc:  # reported by the test
        out["error"] = exc


def test_a_reader_that_pauses_within_the_grace_is_not_cut(grace_daemon):
    d = grace_daemon
    load: dict = {}
    by = threading.Thread(target=_bystander, args=(d.endpoint, load))
    by.start()  # under load: another stream decodes beside it
    r = Reader(d.endpoint, "pauser", 4, tokens=PAUSER_TOKENS)
    try:
        r.read(r.started, 60)
        assert r.started()
        # Stop reading until the daemon says this client's queue has been full for a second,
        # then pause a little more (well within the grace) and read everything.
        paused = time.time()
        backlog = _wait_event(d, lambda e: e["event"] == "client.backlog" and e["seat"] == "pauser"
                              and _ts(e) > paused, 90, "client.backlog for the pausing reader", reader=r)
        time.sleep(1.0)
        r.read(r.ended, 300)
        terminals = r.check_one_terminal_each()
    finally:
        r.sock.close()
    by.join(60)
    assert "error" not in load, load
    assert all(isinstance(t, Done) and t.usage.completion_tokens == PAUSER_TOKENS for t in terminals), terminals
    for rid, msgs in r.seen.items():  # every chunk arrived: nothing dropped during the pause
        assert sum(len(x.token_ids) for x in msgs if isinstance(x, Tokens)) == PAUSER_TOKENS, rid
    assert backlog["grace_s"] == GRACE_S
    cleared = _wait_event(d, lambda e: e["event"] == "client.backlog_cleared" and e["seat"] == "pauser"
                          and _ts(e) > _ts(backlog), 10, "client.backlog_cleared")
    assert cleared["held_s"] < GRACE_S
    assert not [e for e in d.events() if e["event"] == "client.dropped" and e.get("seat") == "pauser"]


def test_a_reader_that_stops_is_cut_after_the_grace(grace_daemon):
    d = grace_daemon
    r = Reader(d.endpoint, "stopper", 4)
    try:
        r.read(r.started, 60)
        assert r.started()
        backlog = _wait_event(d, lambda e: e["event"] == "client.backlog" and e["seat"] == "stopper", 90,
                              "client.backlog for the stopped reader", reader=r)
        dropped = _wait_event(d, lambda e: e["event"] == "client.dropped" and e.get("seat") == "stopper",
                              GRACE_S + 30, "client.dropped for the stopped reader", reader=r)
        # Reading again now: per request its chunks in order, then one slow_consumer Error.
        r.read(r.ended, 60)
        terminals = r.check_one_terminal_each()
    finally:
        r.sock.close()
    assert {t.code for t in terminals if isinstance(t, Error)} == {"slow_consumer"}
    assert all(isinstance(t, Error) for t in terminals), terminals
    assert dropped["reason"] == "slow_consumer" and sorted(dropped["requests"]) == sorted(r.rids)
    # Cut once the grace has passed, not before: held_s is the daemon's own interval on one
    # clock from when the queue filled (it cuts at the first check past the grace, so the
    # excess is a message gap: rebuilt from two log timestamps and a rounded full_s, the
    # interval once read 4.7 ms over the grace, inside those stamps' own error).
    assert dropped["held_s"] >= GRACE_S, dropped
    waited = _ts(dropped) - (_ts(backlog) - backlog["full_s"])  # the same interval from the log's clock
    assert waited < GRACE_S + 5.0, waited  # and not long after it; slack for a loaded box
    cut = [e for e in d.events() if e["event"] == "request.error" and e["request_id"] in r.rids]
    assert sorted(e["request_id"] for e in cut) == sorted(r.rids) and {e["code"] for e in cut} == {"slow_consumer"}
