"""The walking skeleton against a real daemon process: streaming, cancel, status, several
clients, and every kind of bad input answered with a typed error while the daemon serves on."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import zmq

from protocol import (
    Accepted,
    Cancel,
    Done,
    Error,
    Generate,
    Hello,
    Ping,
    Pong,
    Status,
    StatusReply,
    Tokens,
    Welcome,
    decode_daemon,
    encode,
)

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)


def run_request(sock: zmq.Socket, msg: Generate, cancel_after: int | None = None, settle_s: float = 0.3):
    """Send a Generate and read its whole life. Returns (accepted, chunks, terminal, extras),
    where extras are messages for this request that arrived after its terminal one."""
    sock.send(encode(msg))
    accepted, chunks, terminal = None, [], None
    while terminal is None:
        reply = decode_daemon(sock.recv())
        if getattr(reply, "request_id", None) != msg.request_id:
            continue
        if isinstance(reply, Accepted):
            accepted = reply
        elif isinstance(reply, Tokens):
            chunks.append(reply)
            if cancel_after is not None and len(chunks) == cancel_after:
                sock.send(encode(Cancel(request_id=msg.request_id)))
        else:
            terminal = reply
    extras = []
    sock.setsockopt(zmq.RCVTIMEO, int(settle_s * 1000))
    try:
        while True:
            reply = decode_daemon(sock.recv())
            if getattr(reply, "request_id", None) == msg.request_id:
                extras.append(reply)
    except zmq.Again:
        pass
    finally:
        sock.setsockopt(zmq.RCVTIMEO, 20000)
    return accepted, chunks, terminal, extras


def assert_healthy(daemon_proc) -> None:
    """The next valid request after a bad one still succeeds."""
    sock = daemon_proc.raw_socket()
    try:
        acc, chunks, term, extras = run_request(sock, Generate(request_id="after-bad", prompt="def f(x):", max_tokens=4))
        assert isinstance(term, Done) and term.usage.completion_tokens == 4 and not extras
    finally:
        sock.close()


def test_hello_and_streaming(daemon_proc):
    sock = daemon_proc.raw_socket()
    sock.send(encode(Hello(seat="planner")))
    welcome = decode_daemon(sock.recv())
    assert isinstance(welcome, Welcome) and welcome.seat == "planner" and welcome.limits.max_tokens > 0
    acc, chunks, term, extras = run_request(sock, Generate(request_id="s1", prompt="def fibonacci(n):", max_tokens=16))
    assert isinstance(acc, Accepted) and acc.prompt_tokens > 0
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert isinstance(term, Done) and term.finish_reason == "length"
    assert term.usage.completion_tokens == 16 == sum(len(c.token_ids) for c in chunks)
    assert "".join(c.text for c in chunks) == term.text
    assert term.timings.tokens_per_s > 0 and not extras
    sock.close()


def test_non_streaming_gives_only_done(daemon_proc):
    sock = daemon_proc.raw_socket()
    acc, chunks, term, _ = run_request(sock, Generate(request_id="ns", prompt="import os", max_tokens=5, stream=False))
    assert acc is not None and chunks == [] and isinstance(term, Done) and term.usage.completion_tokens == 5
    sock.close()


def test_cancel_mid_stream(daemon_proc):
    sock = daemon_proc.raw_socket()
    acc, chunks, term, extras = run_request(
        sock, Generate(request_id="c1", prompt="class A:", max_tokens=2000), cancel_after=3)
    assert isinstance(term, Done) and term.finish_reason == "cancelled"
    # Stopped within a few decode cycles of the cancel, not at max_tokens.
    # (A busy machine can delay the cancel by many cycles; 2000 would mean it was ignored.)
    assert 3 <= term.usage.completion_tokens < 500 and not extras
    # Cancelling it again: it is no longer in flight.
    sock.send(encode(Cancel(request_id="c1")))
    reply = decode_daemon(sock.recv())
    assert isinstance(reply, Error) and reply.code == "not_found"
    sock.close()


def test_status(daemon_proc):
    sock = daemon_proc.raw_socket()
    sock.send(encode(Status()))
    reply = decode_daemon(sock.recv())
    assert isinstance(reply, StatusReply) and reply.uptime_s > 0 and reply.model
    assert reply.detail["model_type"] == "qwen3_5"
    sock.send(encode(Ping(nonce=42)))
    assert decode_daemon(sock.recv()) == Pong(nonce=42)
    sock.close()


def test_two_clients_at_once(daemon_proc):
    results = {}

    def client(seat: str):
        sock = daemon_proc.raw_socket()
        sock.send(encode(Hello(seat=seat)))
        decode_daemon(sock.recv())
        results[seat] = run_request(sock, Generate(request_id="same-id", prompt=f"# {seat}\n", max_tokens=24))
        sock.close()

    threads = [threading.Thread(target=client, args=(s,)) for s in ("alpha", "beta")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for seat in ("alpha", "beta"):
        acc, chunks, term, extras = results[seat]
        assert isinstance(term, Done) and term.usage.completion_tokens == 24 and not extras
    # Both were decoded in the same span of time (time-sliced), not one after the other.
    a, b = results["alpha"][1], results["beta"][1]
    assert a and b


@pytest.mark.parametrize(
    "frames, code",
    [
        ([b"\xc1\xc1garbage"], "bad_frame"),
        ([msgspec.msgpack.encode([1, 2, 3])], "bad_frame"),
        ([msgspec.msgpack.encode({"type": "generate", "v": 99})], "unsupported_version"),
        ([msgspec.msgpack.encode({"type": "launch_missiles", "v": 1})], "unknown_type"),
        ([msgspec.msgpack.encode({"type": "generate", "v": 1, "request_id": "x", "prompt": "a", "max_tokens": -5})],
         "invalid_request"),
        ([msgspec.msgpack.encode({"type": "generate", "v": 1, "request_id": "x", "prompt": "a", "temperature": -1.0})],
         "invalid_request"),
        ([msgspec.msgpack.encode({"type": "generate", "v": 1, "request_id": "x", "prompt": ""})], "invalid_request"),
        ([msgspec.msgpack.encode({"type": "generate", "v": 1, "request_id": "x"})], "invalid_request"),
        ([msgspec.msgpack.encode({"type": "generate", "v": 1, "request_id": "x", "prompt": "a", "max_tokens": 10**9})],
         "invalid_request"),
        ([encode(Ping()), encode(Ping())], "bad_frame"),
    ],
    ids=["garbage", "not-a-map", "version", "unknown-type", "negative-max-tokens", "negative-temperature",
         "empty-prompt", "no-prompt", "max-tokens-over-limit", "multipart"],
)
def test_bad_input_gets_typed_error(daemon_proc, frames, code):
    sock = daemon_proc.raw_socket()
    sock.send_multipart(frames)
    reply = decode_daemon(sock.recv())
    assert isinstance(reply, Error) and reply.code == code, reply
    assert reply.message
    sock.close()
    assert_healthy(daemon_proc)


def test_oversized_frame(daemon_proc):
    # This daemon's max_frame_bytes is 64 KiB. Just over it: a typed error, with nothing
    # of the frame trusted (not even its request id).
    sock = daemon_proc.raw_socket()
    base = len(encode(Generate(request_id="big", prompt="")))
    frame = encode(Generate(request_id="big", prompt="x" * (65536 + 100 - base)))
    assert 65536 < len(frame) <= 65536 + 1024  # over the limit, under the socket's hard cap
    sock.send(frame)
    reply = decode_daemon(sock.recv())
    assert isinstance(reply, Error) and reply.code == "frame_too_large" and reply.request_id is None
    sock.close()
    # Far over it, past the socket's hard limit, ZeroMQ drops the connection itself.
    sock = daemon_proc.raw_socket()
    sock.send(b"\x81" + b"a" * (4 << 20))
    sock.close()
    assert_healthy(daemon_proc)


def test_duplicate_request_id_in_flight(daemon_proc):
    sock = daemon_proc.raw_socket()
    sock.send(encode(Generate(request_id="dup", prompt="def g():", max_tokens=200)))
    sock.send(encode(Generate(request_id="dup", prompt="def g():", max_tokens=5)))
    terminals, dup_errors = [], []
    deadline = time.monotonic() + 30
    last_ping = time.monotonic()
    while not terminals and time.monotonic() < deadline:
        if time.monotonic() - last_ping > 0.5:  # as PROTOCOL.md asks of a client that waits:
            sock.send(encode(Ping()))  # 200 tokens can outlast the 3 s timeout on a busy box
            last_ping = time.monotonic()
        reply = decode_daemon(sock.recv())
        if isinstance(reply, Error) and reply.code == "duplicate_request":
            dup_errors.append(reply)
        elif isinstance(reply, (Done, Error)):
            terminals.append(reply)
    assert len(dup_errors) == 1 and isinstance(terminals[0], Done) and terminals[0].usage.completion_tokens == 200
    sock.close()


def test_token_id_prompt_and_chat(daemon_proc):
    sock = daemon_proc.raw_socket()
    _, _, term, _ = run_request(sock, Generate(request_id="tok", prompt_tokens=[5, 6, 7], max_tokens=3))
    assert isinstance(term, Done) and term.usage.prompt_tokens == 3
    _, _, term, _ = run_request(sock, Generate(request_id="oov", prompt_tokens=[10**6], max_tokens=3))
    assert isinstance(term, Error) and term.code == "invalid_request"
    from protocol import ChatMessage

    _, _, term, _ = run_request(sock, Generate(request_id="chat", messages=[ChatMessage(role="user", content="hi")],
                                               max_tokens=3))
    assert isinstance(term, Done) and term.usage.prompt_tokens > 3
    sock.close()


def test_daemon_log_is_json_with_request_events(daemon_proc):
    events = daemon_proc.events()
    names = {e["event"] for e in events}
    assert {"daemon.start", "request.accepted", "request.done", "request.rejected"} <= names
    done = [e for e in events if e["event"] == "request.done"]
    assert all("request_id" in e and "seat" in e and "tokens_per_s" in e for e in done)


def test_invalid_utf8_in_a_prompt_is_an_invalid_request_with_its_id(daemon_proc):
    """Once a bad_frame without request_id: the client could not tie it to its request."""
    frame = msgspec.msgpack.encode({"type": "generate", "v": 1, "request_id": "utf8", "prompt": "x"})
    frame = frame.replace(b"\xa1x", b"\xa1\xff")  # the one-byte prompt becomes an invalid UTF-8 byte
    sock = daemon_proc.raw_socket()
    sock.send(frame)
    reply = decode_daemon(sock.recv())
    assert isinstance(reply, Error) and reply.code == "invalid_request" and reply.request_id == "utf8", reply
    assert "UTF-8" in reply.message
    sock.close()
    assert_healthy(daemon_proc)
