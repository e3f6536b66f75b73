"""Property-based fuzzing of a LIVE daemon: random bytes, truncated and oversized frames,
multipart garbage, envelopes with wrong versions and types, valid envelopes with invalid
fields (huge numbers, very long or deeply nested values, wrong types), prompts longer than
max_prompt_tokens. For every case: the daemon answers with the typed reply the protocol's
own decoder predicts (the same error code, or the right reply type, or for a Generate
exactly one terminal message), and afterwards it is still alive and serving.

The short run (a few hundred cases) is in the default suite; the full run (>= 10,000 cases)
is marked slow: `pytest -m slow tests/e2e/test_fuzz_live.py`.
"""

from __future__ import annotations

import collections
import sys
import time

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from e2e_harness import REPO, start_daemon
from protocol import (
    Done,
    Error,
    GovernorReply,
    Pong,
    ProtocolError,
    StatusReply,
    Welcome,
    decode_client,
    decode_daemon,
)
from protocol import messages as m

sys.path.insert(0, str(REPO / "tools"))
import loadtest  # noqa: E402  (its flooding client)

MAX_FRAME = 16384
MAX_TOKENS = 16
MAX_PROMPT_TOKENS = 64
CONFIG = f"""
max_frame_bytes = {MAX_FRAME}
max_tokens = {MAX_TOKENS}
max_prompt_tokens = {MAX_PROMPT_TOKENS}
heartbeat_timeout_s = 60.0
# The floods below test the cut and what is held after it: cut as soon as the queue is full,
# as with no grace (tests/e2e/test_slow_consumer_grace.py tests the grace).
slow_consumer_grace_s = 0.0
"""
# The daemon's ZeroMQ MAXMSGSIZE: above it the connection is dropped without a reply.
HARD_LIMIT = MAX_FRAME + 1024
GENERATE_CODES = {"invalid_request", "prompt_too_long", "deadline_exceeded", "overloaded", "duplicate_request"}

enc = msgspec.msgpack.encode
STATS: collections.Counter = collections.Counter()

# ---------------------------------------------------------------------------- strategies

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.sampled_from([0, -1, 1, 2**31, 2**53 + 1, 2**63 - 1, 2**64 - 1, -(2**63)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.binary(max_size=40),
    st.sampled_from(["x" * 129, "é" * 300, "a" * 5000, "\x00\ud7ff\U0010ffff", "../../etc/passwd", "$(rm -rf /)"]),
)
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                       st.dictionaries(st.text(max_size=10), inner, max_size=5)),
                      max_leaves=20)

CLIENT_TYPES = ["hello", "generate", "cancel", "status", "ping", "governor"]
FIELDS = {
    "hello": ["seat", "client"],
    "generate": ["request_id", "prompt", "messages", "prompt_tokens", "max_tokens", "temperature", "top_p", "top_k",
                 "seed", "stop", "stream", "priority", "deadline_ms", "speculation"],
    "cancel": ["request_id"],
    "status": [],
    "ping": ["nonce"],
    "governor": ["action", "depth"],
}
# Strategies must not depend on external state (hypothesis replays them), so they write
# this fixed-length placeholder; check_case swaps in a unique id of the same length before
# sending, so the msgpack stays valid and no id is ever reused.
_PLACEHOLDER = "RIDPLACEHOLDER00"
_ids = iter(range(10**15))


def _rid() -> str:
    return _PLACEHOLDER


def _unique(frame: bytes) -> bytes:
    return frame.replace(_PLACEHOLDER.encode(), f"r{next(_ids):015d}".encode())


@st.composite
def envelope_garbage(draw):
    """A map with a type and a v, either of which may be wrong, and random fields."""
    t = draw(st.one_of(st.sampled_from(CLIENT_TYPES + ["welcome", "done", "", "GENERATE"]), st.text(max_size=20),
                       scalars))
    v = draw(st.one_of(st.just(1), st.sampled_from([0, 2, -1, 2**63 - 1, "1", None, 1.0]), scalars))
    body = {"type": t, "v": v}
    names = FIELDS.get(t, []) if isinstance(t, str) else []
    for name in draw(st.lists(st.sampled_from(names + ["evil", "__class__", "type"]) if names else st.text(max_size=8),
                              max_size=4)):
        body[name] = draw(values)
    return enc(body)


@st.composite
def valid_generate(draw) -> dict:
    body: dict = {"type": "generate", "v": 1, "request_id": _rid(), "max_tokens": draw(st.integers(1, 4))}
    kind = draw(st.sampled_from(["prompt", "prompt_tokens", "messages"]))
    if kind == "prompt":
        body["prompt"] = draw(st.text(min_size=1, max_size=60))
    elif kind == "prompt_tokens":
        body["prompt_tokens"] = draw(st.lists(st.integers(0, 511), min_size=1, max_size=20))
    else:
        body["messages"] = [{"role": draw(st.sampled_from(["system", "user", "assistant", "tool"])),
                             "content": draw(st.text(max_size=40))}]
    if draw(st.booleans()):
        body["stream"] = draw(st.booleans())
    if draw(st.booleans()):
        body["temperature"] = draw(st.floats(0, 2))
        body["seed"] = draw(st.integers(0, 2**63 - 1))
    if draw(st.booleans()):
        body["stop"] = draw(st.lists(st.text(min_size=1, max_size=5), max_size=3))
    return body


@st.composite
def mutated_generate(draw):
    """A valid Generate with one field replaced by something hostile."""
    body = draw(valid_generate())
    field = draw(st.sampled_from(FIELDS["generate"] + ["extra"]))
    body[field] = draw(st.one_of(values, st.sampled_from([
        2**63 - 1, 2**64 - 1, -(2**63), MAX_TOKENS + 1, 10**6, 4096, 1e308, float("nan"), -0.0,
        "x" * 200, [10**6], [-1], [2**31], list(range(MAX_PROMPT_TOKENS + 1)), [], "", [""], ["s"] * 17,
        [{"role": "user"}], [{"role": "root", "content": "x"}], [{"role": "user", "content": "x", "evil": 1}],
    ])))
    return enc(body)


@st.composite
def too_long_prompt(draw):
    n = draw(st.integers(MAX_PROMPT_TOKENS + 1, 4 * MAX_PROMPT_TOKENS))
    if draw(st.booleans()):
        body = {"type": "generate", "v": 1, "request_id": _rid(), "prompt_tokens": [5] * n, "max_tokens": 2}
    else:
        body = {"type": "generate", "v": 1, "request_id": _rid(), "prompt": "word " * (n * 2), "max_tokens": 2}
    return enc(body)


@st.composite
def truncated(draw):
    frame = draw(st.one_of(valid_generate().map(enc), envelope_garbage()))
    return frame[: draw(st.integers(0, max(0, len(frame) - 1)))]


@st.composite
def deeply_nested(draw):
    depth = draw(st.integers(50, 5000))
    head = enc({"type": "generate", "v": 1, "request_id": _rid()})
    # Add one more key to the map (fixmap of 3 -> 4) whose value is [[[...nil...]]].
    return bytes([head[0] + 1]) + head[1:] + enc(draw(st.sampled_from(["prompt", "messages", "evil"]))) + \
        b"\x91" * depth + b"\xc0", "deep"


@st.composite
def oversized(draw):
    size = draw(st.one_of(st.integers(MAX_FRAME + 1, HARD_LIMIT), st.integers(HARD_LIMIT + 1, 4 * HARD_LIMIT)))
    base = enc({"type": "generate", "v": 1, "request_id": _rid(), "prompt": ""})
    return enc({"type": "generate", "v": 1, "request_id": _rid(), "prompt": "y" * max(1, size - len(base))})


def _simple_valid(draw_type: str) -> bytes:
    return enc({"hello": {"type": "hello", "v": 1, "seat": "fuzz"},
                "status": {"type": "status", "v": 1},
                "ping": {"type": "ping", "v": 1, "nonce": 42},
                "cancel": {"type": "cancel", "v": 1, "request_id": _rid()}}[draw_type])


cases = st.one_of(
    st.binary(max_size=256).map(lambda b: ("bytes", [b])),
    st.lists(st.binary(max_size=64), min_size=2, max_size=4).map(lambda fs: ("multipart", fs)),
    values.map(lambda v: ("value", [enc(v)])),
    envelope_garbage().map(lambda f: ("envelope", [f])),
    mutated_generate().map(lambda f: ("mutated", [f])),
    mutated_generate().map(lambda f: ("mutated", [f])),
    valid_generate().map(lambda b: ("valid_generate", [enc(b)])),
    too_long_prompt().map(lambda f: ("too_long", [f])),
    truncated().map(lambda f: ("truncated", [f])),
    deeply_nested().map(lambda fk: (fk[1], [fk[0]])),
    oversized().map(lambda f: ("oversized", [f])),
    st.sampled_from(["hello", "status", "ping", "cancel"]).map(lambda t: ("simple", [_simple_valid(t)])),
)

# ---------------------------------------------------------------------------- the oracle


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
        self.sock.setsockopt(zmq.RCVTIMEO, 20000)
        self.sock.connect(self.endpoint)

    def recv(self):
        return decode_daemon(self.sock.recv())


def _expect(frames: list[bytes]) -> tuple[str, object]:
    """What the daemon must answer, from the protocol's own decoder."""
    if len(frames) != 1:
        return "error", {"bad_frame"}
    frame = frames[0]
    if len(frame) > HARD_LIMIT:
        return "dropped", None
    try:
        msg = decode_client(frame, MAX_FRAME)
    except ProtocolError as exc:
        return "error", {exc.code}
    except RecursionError:
        return "error", {"bad_frame"}
    if isinstance(msg, m.Generate):
        return "terminal", msg.request_id
    if isinstance(msg, m.Cancel):
        return "not_found", msg.request_id
    return "reply", {m.Hello: Welcome, m.Status: StatusReply, m.Ping: Pong, m.GovernorCommand: GovernorReply}[type(msg)]


def check_case(conn: Conn, kind: str, frames: list[bytes]) -> None:
    frames = [_unique(f) for f in frames]
    what, arg = _expect(frames)
    if kind == "deep" and what == "error":  # msgspec's nesting limit depends on the stack it runs on
        arg = {"bad_frame", "invalid_request"}
    conn.sock.send_multipart(frames)
    STATS[kind] += 1
    if what == "dropped":
        STATS["answer:dropped"] += 1
        conn.fresh()  # ZeroMQ dropped this connection (MAXMSGSIZE); a new one
        return
    if what == "error":
        reply = conn.recv()
        assert isinstance(reply, Error) and reply.code in arg, (kind, frames[0][:80], reply)
        STATS[f"answer:{reply.code}"] += 1
    elif what == "reply":
        reply = conn.recv()
        assert isinstance(reply, arg), (kind, reply)
        STATS[f"answer:{arg.__name__}"] += 1
    elif what == "not_found":
        reply = conn.recv()
        assert isinstance(reply, Error) and reply.code == "not_found" and reply.request_id == arg, reply
        STATS["answer:not_found"] += 1
    else:  # a Generate: exactly one terminal with its id, tokens in order, nothing after
        seq = 0
        while True:
            reply = conn.recv()
            assert getattr(reply, "request_id", None) == arg, (kind, reply)
            if isinstance(reply, m.Tokens):
                assert reply.seq == seq
                seq += 1
            elif isinstance(reply, (Done, Error)):
                break
        if isinstance(reply, Error):
            assert reply.code in GENERATE_CODES, reply
            STATS[f"answer:{reply.code}"] += 1
        else:
            STATS["answer:Done"] += 1


def _assert_serving(d, conn: Conn) -> None:
    assert d.proc.poll() is None, d.log_path.read_text()[-3000:]
    check_case(conn, "health", [enc({"type": "generate", "v": 1, "request_id": _rid(), "prompt": "def f():",
                                     "max_tokens": 4})])
    conn.sock.send(enc({"type": "status", "v": 1}))
    st_reply = conn.recv()
    assert isinstance(st_reply, StatusReply) and st_reply.detail["in_flight"] == 0


@pytest.fixture(scope="module")
def fuzz_daemon(tmp_path_factory, e2e_model):
    d = start_daemon(tmp_path_factory.mktemp("fuzz"), e2e_model, config=CONFIG)
    yield d
    assert d.stop() == 0, d.log_path.read_text()[-3000:]


def _run(d, n: int) -> None:
    conn = Conn(d.endpoint)
    STATS.clear()
    t0 = time.monotonic()

    @settings(max_examples=n, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(case=cases)
    def prop(case):
        kind, frames = case
        check_case(conn, kind, frames)

    try:
        prop()
        _assert_serving(d, conn)
    finally:
        conn.sock.close(linger=0)
    crashed = d.proc.poll() is not None
    errors = [e for e in d.events() if e["event"] in ("server.handler_failed", "engine.crashed", "daemon.engine_died")]
    cases_run = sum(v for k, v in STATS.items() if not k.startswith("answer:") and k != "health")
    print(f"\nfuzz: {cases_run} cases in {time.monotonic() - t0:.1f} s, crashes {int(crashed)}, internal errors "
          f"{len(errors)}; " + ", ".join(f"{k} {v}" for k, v in sorted(STATS.items())))
    assert not crashed and not errors, errors[:5]


def test_fuzz_live_short(fuzz_daemon):
    _run(fuzz_daemon, 400)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_fuzz_live_full(fuzz_daemon):
    _run(fuzz_daemon, 10_000)


# ---------------------------------------------------------------------------- a client that floods without reading


def _flood(endpoint: str, n: int, read_after_s: float = 3.0) -> dict:
    """tools/loadtest.py's flooding client, in this process; fails on any violation."""
    result = loadtest.flood_client(endpoint, n, read_after_s=read_after_s, over_max_tokens=MAX_TOKENS + 1)
    counts, violations = loadtest.check_flood(result)
    assert not violations, violations[:10]
    return counts


def test_flood_without_reading(fuzz_daemon):
    """10,000 Generates from a connection that reads nothing for 3 s (its queue at the
    daemon holds 1,000): every one gets exactly one terminal, in order after its chunks; no
    Accepted goes unanswered; the daemon serves on."""
    d = fuzz_daemon
    counts = _flood(d.endpoint, 10_000)
    print(f"\nflood 10,000: {counts}")
    assert counts["discarded"] == 0  # under the hold bound (16 x client_send_hwm): no exception used
    assert counts["slow_consumer"] > 0 and counts["overloaded"] > 0 and counts["accepted"] > 0, counts
    # Whether an accepted Generate ends Done or slow_consumer is a race between decoding and
    # the cut (beside a CPU burner none finished first); each got exactly one (check_flood).
    assert counts.get("Done", 0) + counts["slow_consumer"] >= counts["accepted"], counts
    conn = Conn(d.endpoint)
    try:
        _assert_serving(d, conn)
    finally:
        conn.sock.close(linger=0)


def test_flood_past_the_hold_bound(tmp_path, e2e_model):
    """With client_send_hwm = 8 the daemon holds at most 128 rejections for a cut connection:
    a 3,000-Generate flood gets one terminal each up to there, and one id-less slow_consumer
    Error counting the rest, none of which was accepted."""
    d = start_daemon(tmp_path, e2e_model, config=CONFIG + "client_send_hwm = 8\n")
    try:
        counts = _flood(d.endpoint, 3_000, read_after_s=2.0)
        print(f"\nflood 3,000 past the bound: {counts}")
        assert counts["discarded"] > 0, counts
        assert d.proc.poll() is None
        lost = [e for e in d.events() if e["event"] == "client.terminal_lost"]
        assert len(lost) == 1, lost  # logged once per episode, not once per Generate
    finally:
        assert d.stop() == 0, d.log_path.read_text()[-3000:]
