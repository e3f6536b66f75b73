"""The sync Client against a fake ROUTER peer on a real ipc socket."""

from __future__ import annotations

import time

import pytest
import zmq

from proto_helpers import done, stream_script
from protocol import messages as m
from protocol.client import (
    MAX_DAEMON_FRAME_BYTES,
    Client,
    CouncilError,
    DaemonUnavailable,
    InvalidRequest,
    Overloaded,
    RequestAborted,
)

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)


def test_hello_welcome_and_socket_options(fake_daemon, endpoint):
    fake = fake_daemon(interval=0.2, timeout=3.0)
    with Client(endpoint, seat="planner", timeout_s=5) as client:
        w = client.welcome
        assert w.seat == "planner" and w.limits.heartbeat_interval_s == 0.2
        assert client.limits.heartbeat_timeout_s == 3.0
        assert fake.of_type(m.Hello)[0].seat == "planner"
        assert client._sock.getsockopt(zmq.MAXMSGSIZE) == MAX_DAEMON_FRAME_BYTES
        assert client._sock.getsockopt(zmq.LINGER) <= 200


def test_streaming_chunks_in_order(fake_daemon, endpoint):
    chunks = ["Once", " upon", "", " a", " time"]
    fake_daemon(stream_script(chunks))
    with Client(endpoint, timeout_s=5) as client:
        stream = client.generate("tell me", max_tokens=16, request_id="r-1")
        got = list(stream)
        assert got == [c for c in chunks if c]  # empty chunks are not handed out
        assert stream.request_id == "r-1"
        assert stream.accepted.prompt_tokens == 3
        assert stream.done.finish_reason == "stop"
        assert stream.text == "Once upon a time"
        assert stream.token_ids == [100, 101, 102, 103, 104]  # ids of the empty chunk are kept
        assert list(stream) == []  # exhausted


def test_generate_sends_every_argument(fake_daemon, endpoint):
    fake = fake_daemon(stream_script(["x"]))
    with Client(endpoint, timeout_s=5) as client:
        client.generate(messages=[{"role": "user", "content": "hi"}], max_tokens=7, temperature=0.5, top_p=0.9,
                        top_k=40, seed=3, stop="END", priority="background", deadline_ms=5000,
                        speculation="exact").result()
    g = fake.of_type(m.Generate)[0]
    assert g.messages == [m.ChatMessage(role="user", content="hi")] and g.prompt is None
    assert (g.max_tokens, g.temperature, g.top_p, g.top_k, g.seed) == (7, 0.5, 0.9, 40, 3)
    assert (g.stop, g.priority, g.deadline_ms, g.speculation, g.stream) == (["END"], "background", 5000, "exact", True)
    assert len(g.request_id) >= 16


def test_complete_is_not_streamed(fake_daemon, endpoint):
    fake = fake_daemon(stream_script(["a", "b", "c"]))
    with Client(endpoint, timeout_s=5) as client:
        d = client.complete(prompt_tokens=[1, 2, 3], max_tokens=3)
    assert isinstance(d, m.Done) and d.text == "abc"
    assert fake.of_type(m.Generate)[0].stream is False


def _interleaved(fake, identity, msg):
    if isinstance(msg, m.Generate):
        ids = fake.state.setdefault("ids", [])
        ids.append((identity, msg.request_id))
        if len(ids) == 2:
            (ia, a), (ib, b) = ids
            for rid in (a, b):
                fake.send(ia, m.Accepted(request_id=rid, queue_position=0, prompt_tokens=1))
            for i in range(5):
                fake.send(ia, m.Tokens(request_id=a, seq=i, text=f"a{i} ", token_ids=[i]))
                fake.send(ib, m.Tokens(request_id=b, seq=i, text=f"b{i} ", token_ids=[10 + i]))
            fake.send(ia, done(a, "".join(f"a{i} " for i in range(5))))
            fake.send(ib, done(b, "".join(f"b{i} " for i in range(5)), "length"))


def test_interleaved_streams_are_buffered_per_request(fake_daemon, endpoint):
    fake_daemon(_interleaved)
    with Client(endpoint, timeout_s=5) as client:
        a = client.generate("first")
        b = client.generate("second")
        # Consume B entirely first: A's messages arrive meanwhile and must wait in A's buffer.
        assert list(b) == [f"b{i} " for i in range(5)]
        assert b.done.finish_reason == "length"
        assert next(a) == "a0 "
        rest = list(a)
        assert rest == [f"a{i} " for i in range(1, 5)]
        assert a.token_ids == [0, 1, 2, 3, 4] and b.token_ids == [10, 11, 12, 13, 14]
        assert a.done.text == "a0 a1 a2 a3 a4 "


def test_error_becomes_exception(fake_daemon, endpoint):
    def handler(fake, identity, msg):
        if isinstance(msg, m.Generate):
            fake.send(identity, m.Error(code="overloaded", message="busy", request_id=msg.request_id, retry_after_s=1.5))

    fake_daemon(handler)
    with Client(endpoint, timeout_s=5) as client:
        stream = client.generate("x", request_id="busy-1")
        with pytest.raises(Overloaded) as info:
            list(stream)
        err = info.value
        assert isinstance(err, CouncilError)
        assert (err.code, err.message, err.retry_after_s, err.request_id) == ("overloaded", "busy", 1.5, "busy-1")
        assert stream.done is None and stream.error is err
        with pytest.raises(Overloaded):  # the stream stays failed
            next(stream)
        assert client.ping() >= 0  # the client itself is fine


def test_error_mid_stream(fake_daemon, endpoint):
    def handler(fake, identity, msg):
        if isinstance(msg, m.Generate):
            fake.send(identity, m.Accepted(request_id=msg.request_id, queue_position=0, prompt_tokens=1))
            fake.send(identity, m.Tokens(request_id=msg.request_id, seq=0, text="par", token_ids=[1]))
            fake.send(identity, m.Error(code="deadline_exceeded", message="late", request_id=msg.request_id))

    fake_daemon(handler)
    with Client(endpoint, timeout_s=5) as client:
        stream = client.generate("x", deadline_ms=10)
        assert next(stream) == "par"
        with pytest.raises(RequestAborted, match="deadline_exceeded"):
            next(stream)
        assert stream.text == "par"


def _cancellable(fake, identity, msg):
    if isinstance(msg, m.Generate):
        fake.send(identity, m.Accepted(request_id=msg.request_id, queue_position=0, prompt_tokens=1))
        fake.send(identity, m.Tokens(request_id=msg.request_id, seq=0, text="one", token_ids=[1]))
    elif isinstance(msg, m.Cancel):
        fake.send(identity, m.Tokens(request_id=msg.request_id, seq=1, text=" two", token_ids=[2]))
        fake.send(identity, done(msg.request_id, "one two", "cancelled", 2))
        # A second Cancel of the same (now finished) id: not_found, never a terminal.
        fake.send(identity, m.Error(code="not_found", message="gone", request_id=msg.request_id))


def test_cancel_sends_cancel_and_ends_with_cancelled(fake_daemon, endpoint):
    fake = fake_daemon(_cancellable)
    with Client(endpoint, timeout_s=5) as client:
        stream = client.generate("x", request_id="c-1")
        assert next(stream) == "one"
        stream.cancel()
        stream.cancel()  # idempotent
        assert list(stream) == [" two"]
        assert stream.done.finish_reason == "cancelled"
        fake.wait_for(lambda: fake.of_type(m.Cancel))
        assert [c.request_id for c in fake.of_type(m.Cancel)] == ["c-1"]
        # not_found arrives afterwards and is set aside, not raised anywhere
        client.ping()
        assert any(isinstance(x, m.Error) and x.code == "not_found" for x in client.stray)


def test_not_found_is_not_terminal_for_a_live_stream(fake_daemon, endpoint):
    def handler(fake, identity, msg):
        if isinstance(msg, m.Generate):
            rid = msg.request_id
            fake.send(identity, m.Error(code="not_found", message="no such request", request_id=rid))
            fake.send(identity, m.Tokens(request_id=rid, seq=0, text="still here", token_ids=[1]), delay=0.05)
            fake.send(identity, done(rid, "still here"), delay=0.05)

    fake_daemon(handler)
    with Client(endpoint, timeout_s=5) as client:
        stream = client.generate("x")
        assert list(stream) == ["still here"]


def test_heartbeat_pings_while_waiting(fake_daemon, endpoint):
    def slow(fake, identity, msg):
        if isinstance(msg, m.Generate):
            fake.send(identity, m.Accepted(request_id=msg.request_id, queue_position=3, prompt_tokens=1))
            fake.send(identity, done(msg.request_id, "late"), delay=2.5)

    fake = fake_daemon(slow, interval=0.1)
    # timeout_s is shorter than the wait: the Pongs keep proving the daemon alive. (With
    # slack for a busy box: a 0.4 s timeout and a 0.6 s wait once left a stall no room.)
    with Client(endpoint, timeout_s=1.0) as client:
        stream = client.generate("x")
        t0 = time.monotonic()
        assert stream.result().text == "late"
        elapsed = time.monotonic() - t0
    ping_times = [t for t, msg in fake.received if isinstance(msg, m.Ping)]
    assert len(ping_times) >= 10, ping_times
    gaps = [b - a for a, b in zip(ping_times, ping_times[1:])]
    # At every interval (0.1 s) as a rule; one gap may stretch when the machine is busy,
    # and none reached the 1 s timeout, or the stream would have failed above.
    assert sorted(gaps)[len(gaps) // 2] < 0.3, gaps
    assert elapsed >= 2.45


def test_daemon_silent_raises_unavailable(fake_daemon, endpoint):
    def swallow(fake, identity, msg):
        pass

    fake_daemon(swallow, answer_pings=False)
    with Client(endpoint, timeout_s=0.3) as client:
        _ = client.welcome  # Hello is answered; after that, nothing
        stream = client.generate("x")
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailable) as info:
            list(stream)
        assert 0.25 <= time.monotonic() - t0 < 2.0
        assert endpoint in str(info.value) and info.value.endpoint == endpoint
        with pytest.raises(DaemonUnavailable):  # the stream stays failed
            next(stream)
        # Lazy Pirate: the next call uses a fresh socket (and says Hello again)
        with pytest.raises(DaemonUnavailable):
            client.ping()


def test_no_daemon_at_all(endpoint):
    with Client(endpoint, timeout_s=0.2) as client:
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailable, match="unavailable"):
            client.status()
        assert time.monotonic() - t0 < 2.0


def test_status_ping_governor(fake_daemon, endpoint):
    fake_daemon()
    with Client(endpoint, timeout_s=5) as client:
        st = client.status()
        assert isinstance(st, m.StatusReply) and st.detail == {"pid": 1}
        rtt = client.ping()
        assert 0 <= rtt < 1
        reply = client.governor("pin_depth", depth=2)
        assert reply.ok and reply.state == {"depth": 2}
        with pytest.raises(InvalidRequest, match="invalid_request"):
            client.governor("explode")


def test_local_validation_sends_nothing(fake_daemon, endpoint):
    fake = fake_daemon(stream_script(["x"]), max_frame_bytes=4096)
    with Client(endpoint, timeout_s=5) as client:
        with pytest.raises(InvalidRequest, match="exactly one"):
            client.generate("a", prompt_tokens=[1])
        with pytest.raises(InvalidRequest, match="exactly one"):
            client.generate()
        with pytest.raises(InvalidRequest, match=r"\$\.top_p"):
            client.generate("a", top_p=0.0)
        with pytest.raises(InvalidRequest, match="request_id"):
            client.generate("a", request_id="has space")
        with pytest.raises(InvalidRequest, match="role"):
            client.generate(messages=[{"role": "wizard", "content": "x"}])
        with pytest.raises(InvalidRequest) as info:
            client.generate("y" * 5000)  # above the announced max_frame_bytes
        assert info.value.code == "frame_too_large"
        with pytest.raises(InvalidRequest, match="max_tokens"):
            client.generate("a", max_tokens=5000)
        client.ping()
    assert fake.of_type(m.Generate) == []
    with pytest.raises(InvalidRequest):
        Client(endpoint, seat="bad seat!")


def test_duplicate_request_id_is_refused_locally(fake_daemon, endpoint):
    fake_daemon(lambda *a: None)
    with Client(endpoint, timeout_s=5) as client:
        client.generate("a", request_id="same")
        with pytest.raises(InvalidRequest, match="duplicate_request"):
            client.generate("b", request_id="same")


def test_close_cancels_streams_in_flight(fake_daemon, endpoint):
    fake = fake_daemon(lambda *a: None)
    client = Client(endpoint, timeout_s=5)
    stream = client.generate("x", request_id="left-open")
    client.close()
    fake.wait_for(lambda: fake.of_type(m.Cancel))
    assert fake.of_type(m.Cancel)[0].request_id == "left-open"
    with pytest.raises(RequestAborted):
        next(stream)
    with pytest.raises(RuntimeError):
        client.status()


def test_reconnects_after_daemon_returns(fake_daemon, endpoint):
    with Client(endpoint, timeout_s=0.2) as client:
        with pytest.raises(DaemonUnavailable):
            client.ping()
        fake_daemon(stream_script(["back"]))
        assert list(client.generate("x")) == ["back"]


def test_curve(fake_daemon, endpoint):
    server_public, server_secret = zmq.curve_keypair()
    fake_daemon(stream_script(["secret"]), curve_secret=(server_public, server_secret))
    with Client(endpoint, timeout_s=5, curve_server_key=server_public) as client:
        assert list(client.generate("x")) == ["secret"]
        assert client._sock.getsockopt(zmq.MECHANISM) == zmq.CURVE
    keys = zmq.curve_keypair()
    with Client(endpoint, timeout_s=5, curve_server_key=server_public.decode(), curve_keys=keys) as client:
        assert client.ping() >= 0
    wrong_public, _ = zmq.curve_keypair()
    with Client(endpoint, timeout_s=0.3, curve_server_key=wrong_public) as client:
        with pytest.raises(DaemonUnavailable):
            client.status()


def test_daemon_restart_fails_streams_in_flight(fake_daemon, endpoint):
    # A restarted daemon answers pings but knows nothing of our request: without noticing the
    # dropped connection the stream would wait forever.
    first = fake_daemon(lambda fake, identity, msg: isinstance(msg, m.Generate) and fake.send(
        identity, m.Accepted(request_id=msg.request_id, queue_position=0, prompt_tokens=1)))
    with Client(endpoint, timeout_s=5) as client:
        stream = client.generate("x")
        first.wait_for(lambda: first.of_type(m.Generate))
        first.stop()
        second = fake_daemon(stream_script(["fresh"]))
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailable, match="lost the connection"):
            list(stream)
        assert time.monotonic() - t0 < 2.0
        assert stream.accepted is not None
        assert list(client.generate("y")) == ["fresh"]  # a fresh socket, Hello again
        assert second.of_type(m.Hello)


def test_every_error_code_has_a_family():
    from protocol.client import _FAMILIES, DaemonError, error_from_wire

    assert set(_FAMILIES) == set(m.ErrorCode.__args__)
    exc = error_from_wire(m.Error(code="internal", message="boom", request_id="r"))
    assert type(exc) is DaemonError and exc.request_id == "r" and "boom" in str(exc)
