"""Field by field over the raw ZeroMQ socket: every client message (Hello, Generate, Cancel,
Status, Ping, GovernorCommand), valid, with one field (or one nested field) replaced by a
string that is not valid UTF-8 (a msgpack str whose bytes are a CESU-8 surrogate, an overlong
form, a cut sequence, a code point past U+10FFFF, a stray continuation byte), a value of the
wrong msgpack type, an extreme number, or an extreme size (long strings and arrays, within and
past max_frame_bytes). The daemon's answer must be the one the protocol's own decoder predicts:
an Error with that decoder's code, carrying the frame's request_id when the frame has a
readable one (a Generate's Error is its terminal), or the right reply. Meanwhile a bystander
connection keeps sending greedy Generates: each gets exactly one Done, tokens in order, and
the same text as the first, so nothing another client does is disturbed.

test_fuzz_live.py fuzzes envelopes, random bytes and whole-message garbage; this file walks
the fields. Short run in the suite; 10,000 cases in the slow tier:

    COUNCILD_PROTOCOL_FUZZ_EXAMPLES=10000 PYTHONPATH=$PWD .venv/bin/python -m pytest -q -s -m slow \\
        tests/e2e/test_fuzz_fields.py
"""

from __future__ import annotations

import collections
import copy
import os
import time

import msgspec
import pytest
import zmq
from e2e_harness import start_daemon
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol import Done, Error, GovernorReply, Pong, ProtocolError, StatusReply, Welcome, decode_client, decode_daemon
from protocol import messages as m
from protocol.codec import peek_request_id

MAX_FRAME = 16384
CONFIG = f"max_frame_bytes = {MAX_FRAME}\nmax_tokens = 8\nmax_prompt_tokens = 64\nheartbeat_timeout_s = 60.0\n"
HARD_LIMIT = MAX_FRAME + 1024  # the daemon's ZeroMQ MAXMSGSIZE: past it the connection is dropped
SHORT_EXAMPLES = 300
BYSTANDER_EVERY = 25


class BadStr(bytes):
    """A msgpack str whose bytes are written as they are (not valid UTF-8)."""


def pack(value) -> bytes:
    """msgpack, with BadStr values (and keys) spliced in as str."""
    if isinstance(value, BadStr):
        n = len(value)
        head = bytes([0xA0 | n]) if n < 32 else b"\xd9" + bytes([n]) if n < 256 else b"\xda" + n.to_bytes(2, "big")
        return head + bytes(value)
    if isinstance(value, dict):
        n = len(value)
        head = bytes([0x80 | n]) if n < 16 else b"\xde" + n.to_bytes(2, "big")
        return head + b"".join(pack(k) + pack(v) for k, v in value.items())
    if isinstance(value, list):
        n = len(value)
        head = bytes([0x90 | n]) if n < 16 else b"\xdc" + n.to_bytes(2, "big")
        return head + b"".join(pack(v) for v in value)
    return msgspec.msgpack.encode(value)


RID = "RIDPLACEHOLDER00"  # swapped for a unique id of the same length before sending
_ids = iter(range(10**15))

# One valid message of each type, with every str field the protocol has.
TEMPLATES = {
    "hello": {"type": "hello", "v": 1, "seat": "fuzzseat", "client": "fuzzer"},
    "generate": {"type": "generate", "v": 1, "request_id": RID, "max_tokens": 2, "stream": True,
                 "messages": [{"role": "system", "content": "Be brief."},
                              {"role": "assistant", "content": "", "tool_calls": [
                                  {"id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}]},
                              {"role": "tool", "content": "sunny", "tool_call_id": "call_1", "name": "get_weather"},
                              {"role": "user", "content": "Hi"}],
                 "stop": ["\n\n"], "priority": "normal", "speculation": "exact", "session": "keep",
                 "chat_template_kwargs": {"enable_thinking": False},
                 "tools": [{"name": "get_weather", "description": "Weather.",
                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}],
                 "tool_choice": "auto"},
    "generate_prompt": {"type": "generate", "v": 1, "request_id": RID, "prompt": "def f(", "max_tokens": 2,
                        "constraint": {"kind": "regex", "value": "[a-z]+"}, "temperature": 0.5, "seed": 7},
    "generate_tokens": {"type": "generate", "v": 1, "request_id": RID, "prompt_tokens": [1, 2, 3], "max_tokens": 1,
                        "logit_bias": {5: -1.0}, "logprobs": True, "top_logprobs": 2},
    "cancel": {"type": "cancel", "v": 1, "request_id": RID},
    "status": {"type": "status", "v": 1},
    "ping": {"type": "ping", "v": 1, "nonce": 5},
    "governor": {"type": "governor", "v": 1, "action": "auto"},
}

INVALID_UTF8 = st.sampled_from([BadStr(b"\xed\xb3\xbf"), BadStr(b"a\xed\xa0\x80b"), BadStr(b"\xc0\xaf"),
                                BadStr(b"\xe6\x97"), BadStr(b"\xf4\x90\x80\x80"), BadStr(b"\x80"), BadStr(b"\xff\xfe"),
                                BadStr(b"ok\xf0\x9f\x99"), BadStr(b"\xf8\x88\x80\x80\x80")])
WRONG_TYPES = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(),
                        st.binary(max_size=8), st.lists(st.integers(0, 5), max_size=3),
                        st.dictionaries(st.sampled_from(["a", "role", "name"]), st.integers(-(2**63), 2**64 - 1),
                                        max_size=2),
                        st.text(max_size=8))
EXTREME = st.one_of(
    st.sampled_from([2**64 - 1, 2**63, -(2**63), 2**31, -1, 0, 1e308, -1e308, float("nan"), float("inf"), -0.0]),
    st.integers(100, 200_000).map(lambda n: "x" * n),  # within and past max_frame_bytes
    st.integers(100, 100_000).map(lambda n: "日" * (n // 3)),
    st.integers(100, 20_000).map(lambda n: [1] * n),
    st.integers(20, 2_000).map(lambda n: [{"role": "user", "content": "a"}] * n),
    st.integers(17, 400).map(lambda n: ["s"] * n))


def _paths(value, prefix=()):
    """Every (path to a value) in a template, keys included as ("key", k) steps."""
    out = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        if prefix == () and k in ("type", "v"):
            continue  # the envelope is test_fuzz_live's business
        out.append(prefix + (k,))
        if isinstance(value, dict):
            out.append(prefix + (("key", k),))
        out += _paths(v, prefix + (k,))
    return out


@st.composite
def cases(draw):
    kind = draw(st.sampled_from(sorted(TEMPLATES)))
    msg = copy.deepcopy(TEMPLATES[kind])
    paths = _paths(msg)
    what = "valid"
    if paths and draw(st.integers(0, 9)) > 0:
        path = paths[draw(st.integers(0, len(paths) - 1))]
        new = draw(st.one_of(INVALID_UTF8, INVALID_UTF8, WRONG_TYPES, EXTREME))
        parent = msg
        for step in path[:-1]:
            parent = parent[step]
        last = path[-1]
        if isinstance(last, tuple):  # the key itself: rename it to an invalid or wrong-typed one
            key = last[1]
            bad_key = new if isinstance(new, (BadStr, int, bytes)) and not isinstance(new, bool) else BadStr(b"\xff")
            parent[bad_key] = parent.pop(key)
            what = f"key {path}"
        else:
            parent[last] = new
            what = f"{path} = {type(new).__name__}"
    return kind, what, pack(msg)


class Conn:
    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.sock = None
        self.fresh()

    def fresh(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 30_000)
        self.sock.connect(self.endpoint)

    def recv(self):
        return decode_daemon(self.sock.recv())


def _unique(frame: bytes) -> bytes:
    return frame.replace(RID.encode(), f"r{next(_ids):015d}".encode())


def check_case(conn: Conn, frame: bytes, what: str, stats: collections.Counter) -> None:
    frame = _unique(frame)
    ctx = f"[{what}] {frame[:160]!r}"
    conn.sock.send(frame)
    if len(frame) > HARD_LIMIT:  # ZeroMQ drops the connection: a new one
        stats["dropped"] += 1
        conn.fresh()
        return
    try:
        msg = decode_client(frame, MAX_FRAME)
    except ProtocolError as exc:
        reply = conn.recv()
        assert isinstance(reply, Error) and reply.code == exc.code, (ctx, reply)
        rid = peek_request_id(frame)
        if rid is not None and exc.code == "invalid_request":  # routed to its request: the terminal
            assert reply.request_id == rid, (ctx, reply)
        stats[f"Error {reply.code}"] += 1
        return
    if isinstance(msg, m.Generate):  # exactly one terminal with its id, tokens in order
        seq = 0
        while True:
            reply = conn.recv()
            assert getattr(reply, "request_id", None) == msg.request_id, (ctx, reply)
            if isinstance(reply, m.Tokens):
                assert reply.seq == seq, (ctx, reply)
                seq += 1
            elif isinstance(reply, (Done, Error)):
                break
        stats[f"Generate {type(reply).__name__}" + (f" {reply.code}" if isinstance(reply, Error) else "")] += 1
        if isinstance(reply, Error):
            assert reply.code in ("invalid_request", "prompt_too_long", "overloaded"), (ctx, reply)
        return
    reply = conn.recv()
    if isinstance(msg, m.Cancel):
        assert isinstance(reply, Error) and reply.code == "not_found" and reply.request_id == msg.request_id, reply
    else:
        want = {m.Hello: Welcome, m.Status: StatusReply, m.Ping: Pong, m.GovernorCommand: GovernorReply}[type(msg)]
        assert isinstance(reply, want), (ctx, reply)
    stats[type(reply).__name__] += 1


class Bystander:
    """Another connection's greedy Generates, one at a time among the fuzz cases: each is read
    to its end when the next is sent (so its queue at the daemon never fills)."""

    def __init__(self, endpoint: str):
        self.conn = Conn(endpoint)
        self.conn.sock.send(pack({"type": "hello", "v": 1, "seat": "bystander"}))
        assert isinstance(self.conn.recv(), Welcome)
        self.texts: list[str] = []
        self.open: str | None = None

    def send(self) -> None:
        self.finish()
        self.open = f"b{len(self.texts):06d}"
        self.conn.sock.send(pack({"type": "generate", "v": 1, "request_id": self.open, "prompt": "def fibonacci(n):",
                                  "max_tokens": 8, "temperature": 0.0}))

    def finish(self) -> None:
        """Read the open Generate: tokens in order, then exactly one Done."""
        if self.open is None:
            return
        seq = 0
        while True:
            reply = self.conn.recv()
            assert reply.request_id == self.open, reply
            if isinstance(reply, m.Tokens):
                assert reply.seq == seq, reply
                seq += 1
            elif not isinstance(reply, m.Accepted):
                assert isinstance(reply, Done) and reply.usage.completion_tokens > 0, reply
                self.texts.append(reply.text)
                self.open = None
                return

    def check(self) -> int:
        self.finish()
        assert len(set(self.texts)) == 1, self.texts  # greedy: the same answer every time
        self.conn.sock.close(linger=0)
        return len(self.texts)


@pytest.fixture(scope="module")
def fields_daemon(tmp_path_factory, e2e_model):
    d = start_daemon(tmp_path_factory.mktemp("fuzz-fields"), e2e_model, config=CONFIG)
    yield d
    assert d.stop() == 0, d.log_path.read_text()[-3000:]


def run(d, n: int) -> None:
    conn, bystander = Conn(d.endpoint), Bystander(d.endpoint)
    stats: collections.Counter = collections.Counter()
    t0 = time.monotonic()

    @settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=cases())
    def prop(case):
        kind, what, frame = case
        if sum(stats.values()) % BYSTANDER_EVERY == 0:
            bystander.send()
        check_case(conn, frame, f"{kind} {what}", stats)

    try:
        prop()
        served = bystander.check()
        conn.sock.send(pack({"type": "governor", "v": 1, "action": "auto"}))
        assert isinstance(conn.recv(), GovernorReply)
        conn.sock.send(pack({"type": "status", "v": 1}))
        status = conn.recv()
        assert isinstance(status, StatusReply) and status.detail["in_flight"] == 0, status
    finally:
        conn.sock.close(linger=0)
    bad = [e for e in d.events() if e["event"] in ("server.handler_failed", "engine.crashed", "daemon.engine_died")]
    assert d.proc.poll() is None and not bad, bad[:5]
    print(f"\nprotocol field fuzz: {sum(stats.values())} frames in {time.monotonic() - t0:.1f} s, bystander "
          f"{served} Generates undisturbed; " + ", ".join(f"{k}: {v}" for k, v in stats.most_common()))


def test_fields_short(fields_daemon):
    run(fields_daemon, SHORT_EXAMPLES)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_fields_long(fields_daemon):
    run(fields_daemon, int(os.environ.get("COUNCILD_PROTOCOL_FUZZ_EXAMPLES", "10000")))
