"""Helpers for the protocol tests: hypothesis strategies derived from the message types
(via msgspec.inspect, so they follow messages.py without edits) and a fake daemon, a thread
with a real ZeroMQ ROUTER socket that speaks the protocol from a script."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable

import msgspec
import msgspec.inspect as mi
import zmq
from hypothesis import strategies as st

from protocol import messages as m
from protocol.codec import decode_client, encode

CLIENT_TYPES = list(m.ClientMessage.__args__)
DAEMON_TYPES = list(m.DaemonMessage.__args__)
ALL_TYPES = CLIENT_TYPES + DAEMON_TYPES

# ------------------------------------------------------------------ strategies from the types

_INT64_MIN, _UINT64_MAX = -(1 << 63), (1 << 64) - 1


def _int_strategy(t: mi.IntType) -> st.SearchStrategy:
    lo = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else _INT64_MIN)
    hi = t.le if t.le is not None else (t.lt - 1 if t.lt is not None else _UINT64_MAX)
    return st.integers(lo, hi)


def _float_strategy(t: mi.FloatType) -> st.SearchStrategy:
    lo = t.ge if t.ge is not None else t.gt
    hi = t.le if t.le is not None else t.lt
    return st.floats(min_value=lo, max_value=hi, exclude_min=t.gt is not None, exclude_max=t.lt is not None,
                     allow_nan=False)


def _str_strategy(t: mi.StrType) -> st.SearchStrategy:
    lo = t.min_length or 0
    hi = min(t.max_length if t.max_length is not None else 40, 40)
    if t.pattern is not None:
        return st.from_regex(t.pattern, fullmatch=True).filter(lambda s: lo <= len(s) <= (t.max_length or 1 << 30))
    return st.text(min_size=lo, max_size=max(lo, hi))


_json_leaf = st.none() | st.booleans() | st.integers(-(1 << 40), 1 << 40) | st.text(max_size=10) | st.floats(allow_nan=False)
_any_value = st.recursive(_json_leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                          max_leaves=8)


def strategy_for(t: mi.Type) -> st.SearchStrategy:
    """A strategy producing valid values of a msgspec type, bounds and patterns included."""
    if isinstance(t, mi.IntType):
        return _int_strategy(t)
    if isinstance(t, mi.FloatType):
        return _float_strategy(t)
    if isinstance(t, mi.StrType):
        return _str_strategy(t)
    if isinstance(t, mi.BoolType):
        return st.booleans()
    if isinstance(t, mi.NoneType):
        return st.none()
    if isinstance(t, mi.LiteralType):
        return st.sampled_from(t.values)
    if isinstance(t, mi.UnionType):
        return st.one_of([strategy_for(x) for x in t.types])
    if isinstance(t, mi.ListType):
        hi = min(t.max_length if t.max_length is not None else 4, 4)
        return st.lists(strategy_for(t.item_type), min_size=t.min_length or 0, max_size=hi)
    if isinstance(t, mi.DictType):  # typed keys/values where the message declares them
        keys = st.text(max_size=8) if isinstance(t.key_type, mi.AnyType) else strategy_for(t.key_type)
        values = _any_value if isinstance(t.value_type, mi.AnyType) else strategy_for(t.value_type)
        return st.dictionaries(keys, values, max_size=min(t.max_length if t.max_length is not None else 3, 3))
    if isinstance(t, mi.AnyType):
        return _any_value
    if isinstance(t, mi.StructType):
        return st.builds(t.cls, **{f.name: strategy_for(f.type) for f in t.fields if f.name != "v"})
    raise NotImplementedError(f"no strategy for {t!r}")


def message_strategy(cls: type) -> st.SearchStrategy:
    return strategy_for(mi.type_info(cls))


def all_structs() -> dict[str, mi.StructType]:
    """Every Struct reachable from the message types, by class name (nested ones included)."""
    found: dict[str, mi.StructType] = {}

    def walk(t: mi.Type) -> None:
        if isinstance(t, mi.StructType):
            if t.cls.__name__ in found:
                return
            found[t.cls.__name__] = t
            for f in t.fields:
                walk(f.type)
        elif isinstance(t, mi.UnionType):
            for x in t.types:
                walk(x)
        elif isinstance(t, mi.ListType):
            walk(t.item_type)

    for cls in ALL_TYPES:
        walk(mi.type_info(cls))
    return found


# ------------------------------------------------------------------ message helpers


def done(rid: str, text: str = "", reason: str = "stop", n: int = 0) -> m.Done:
    return m.Done(
        request_id=rid, finish_reason=reason, text=text,
        usage=m.Usage(prompt_tokens=3, completion_tokens=n),
        timings=m.Timings(queue_s=0.0, prefill_s=0.0, decode_s=0.0, ttft_s=0.0, tokens_per_s=0.0),
    )


def welcome(seat: str, interval: float, timeout: float, max_frame_bytes: int = 1 << 20) -> m.Welcome:
    return m.Welcome(
        seat=seat, server="fake 0", model="fake-model", capabilities=["stream", "cancel"],
        limits=m.Limits(max_frame_bytes=max_frame_bytes, max_tokens=4096, max_prompt_tokens=1000,
                        heartbeat_interval_s=interval, heartbeat_timeout_s=timeout),
    )


# ------------------------------------------------------------------ the fake daemon

Handler = Callable[["FakeDaemon", bytes, Any], None]


class FakeDaemon:
    """A ROUTER peer on a thread. Answers Hello, Ping, Status and GovernorCommand itself
    (unless told to stay silent) and hands Generate and Cancel to ``handler(fake, identity,
    msg)``, which replies with ``fake.send(identity, msg, delay=...)``. Everything received
    is recorded in ``received`` as (monotonic time, message)."""

    def __init__(self, endpoint: str, handler: Handler | None = None, *, interval: float = 0.05, timeout: float = 2.0,
                 answer_pings: bool = True, answer_hello: bool = True, max_frame_bytes: int = 1 << 20,
                 curve_secret: tuple[bytes, bytes] | None = None):
        self.endpoint = endpoint
        self.handler = handler
        self.interval, self.timeout = interval, timeout
        self.answer_pings, self.answer_hello = answer_pings, answer_hello
        self.max_frame_bytes = max_frame_bytes
        self.curve_secret = curve_secret
        self.received: list[tuple[float, Any]] = []
        self.state: dict[str, Any] = {}
        self._outbox: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-councild", daemon=True)

    def start(self) -> "FakeDaemon":
        self._thread.start()
        assert self._ready.wait(5)
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def send(self, identity: bytes, msg: Any, delay: float = 0.0) -> None:
        self._outbox.put((time.monotonic() + delay, identity, msg))

    def of_type(self, cls: type) -> list[Any]:
        return [msg for _, msg in self.received if isinstance(msg, cls)]

    def wait_for(self, pred: Callable[[], bool], timeout: float = 5.0) -> None:
        end = time.monotonic() + timeout
        while not pred():
            assert time.monotonic() < end, "fake daemon: condition not met in time"
            time.sleep(0.005)

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.curve_secret is not None:
            public, secret = self.curve_secret
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        sock.bind(self.endpoint)
        self._ready.set()
        pending: list[tuple[float, bytes, Any]] = []
        try:
            while not self._stop.is_set():
                if sock.poll(5, zmq.POLLIN):
                    while True:
                        try:
                            identity, frame = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        msg = decode_client(frame)
                        self.received.append((time.monotonic(), msg))
                        self._react(identity, msg)
                while True:
                    try:
                        pending.append(self._outbox.get_nowait())
                    except queue.Empty:
                        break
                now = time.monotonic()
                pending.sort(key=lambda p: p[0])
                while pending and pending[0][0] <= now:
                    _, identity, msg = pending.pop(0)
                    sock.send_multipart([identity, encode(msg)])
        finally:
            sock.close(linger=0)

    def _react(self, identity: bytes, msg: Any) -> None:
        if isinstance(msg, m.Hello):
            if self.answer_hello:
                self.send(identity, welcome(msg.seat, self.interval, self.timeout, self.max_frame_bytes))
        elif isinstance(msg, m.Ping):
            if self.answer_pings:
                self.send(identity, m.Pong(nonce=msg.nonce))
        elif isinstance(msg, m.Status):
            self.send(identity, m.StatusReply(server="fake 0", model="fake-model", uptime_s=1.5, active=0, queued=0,
                                              detail={"pid": 1}))
        elif isinstance(msg, m.GovernorCommand):
            self.send(identity, m.GovernorReply(ok=True, message=f"{msg.action} {msg.depth}", state={"depth": msg.depth}))
        elif self.handler is not None:
            self.handler(self, identity, msg)


def stream_script(chunks: list[str], reason: str = "stop") -> Handler:
    """A handler that answers each Generate with Accepted, one Tokens per chunk, and Done."""

    def handler(fake: FakeDaemon, identity: bytes, msg: Any) -> None:
        if isinstance(msg, m.Generate):
            rid = msg.request_id
            fake.send(identity, m.Accepted(request_id=rid, queue_position=0, prompt_tokens=3))
            if msg.stream:
                for i, c in enumerate(chunks):
                    fake.send(identity, m.Tokens(request_id=rid, seq=i, text=c, token_ids=[100 + i]))
            fake.send(identity, done(rid, "".join(chunks), reason, len(chunks)))

    return handler


__all__ = ["FakeDaemon", "message_strategy", "strategy_for", "all_structs", "done", "welcome", "stream_script",
           "CLIENT_TYPES", "DAEMON_TYPES", "ALL_TYPES", "msgspec"]
