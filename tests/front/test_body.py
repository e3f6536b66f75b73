"""front/body.py in-process: the decoder's limits and messages, and the front's catch-all
(an exception no route expected still answers JSON in the route's shape). The same rules
against a live front and daemon: tests/e2e/test_http_bodies.py and test_http_fuzz.py."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from front.app import Front
from front.body import MAX_DEPTH, decode_json
from front.config import HttpConfig
from front.errors import HTTPError
from protocol import messages as m

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)


def _refused(raw: bytes) -> HTTPError:
    with pytest.raises(HTTPError) as exc:
        decode_json(raw)
    assert exc.value.status == 400
    return exc.value


def _nested(depth: int) -> bytes:
    return b"[" * (depth - 1) + b"{}" + b"]" * (depth - 1)


def test_nesting_is_counted_from_the_body_itself():
    assert decode_json(_nested(MAX_DEPTH)) is not None
    for depth in (MAX_DEPTH + 1, 1000, 100_000):
        err = _refused(_nested(depth))
        assert err.code == "json_too_deep" and f"more than {MAX_DEPTH} levels" in err.message
    # Long arrays of scalars (token ids) beside deep-enough objects are still walked right.
    assert decode_json(json.dumps({"p": list(range(1000)), "q": json.loads(_nested(MAX_DEPTH - 1))}).encode())
    assert _refused(json.dumps({"p": list(range(1000)), "q": json.loads(_nested(MAX_DEPTH))}).encode()).code \
        == "json_too_deep"


@pytest.mark.parametrize("raw, path, says", [
    (rb'{"messages": [{"role": "user", "content": "a\udcffb"}]}', "messages[0].content",
     "lone UTF-16 surrogate (\\udcff at character 1)"),
    (rb'{"prompt": "\ud83d"}', "prompt", "(\\ud83d at character 0)"),  # msgspec says "truncated" here
    (rb'{"prompt": "ok", "metadata": {"\udfff": 1}}', "metadata", "an object key holds a lone UTF-16 surrogate"),
    (b'{"input": [{"role": "user", "content": "x\xed\xa0\x80"}]}', "input[0].content", "not valid UTF-8 (byte 0xed"),
    (b'{"a b": ["\xff"]}', '["a b"][0]', "not valid UTF-8 (byte 0xff at character 0)"),
])
def test_text_that_is_not_unicode_is_refused_naming_the_field(raw, path, says):
    err = _refused(raw)
    assert err.code == "invalid_unicode" and err.param == path and err.message.startswith(f"{path}: "), err.message
    assert says in err.message, err.message


def test_pairs_and_unusual_but_valid_text_pass():
    value = decode_json('{"t": "\\ud83d\\ude00 \\u0000 \\ufeff \\uffff \U0010ffff e\u0301"}'.encode())
    assert value["t"] == "\U0001f600 \x00 \ufeff \uffff \U0010ffff e\u0301"


@pytest.mark.parametrize("raw, says", [
    (b"", "empty"), (b"  \n", "empty"), (b"{", "not valid JSON"), (b'{"a": NaN}', "not valid JSON"),
    (b'{"a": 1e400}', "out of range"), (b'{"a": ' + b"9" * 5000 + b"}", "out of range"),
    (b"{} x", "trailing characters"), (b"\xef\xbb\xbf{}", "not valid JSON"), (b"\xff{}", "not valid JSON"),
])
def test_broken_json_is_refused_with_the_decoders_reason(raw, says):
    err = _refused(raw)
    assert err.code == "invalid_json" and says in err.message, err.message


def test_big_integers_and_duplicate_keys_decode_as_json_allows():
    assert decode_json(b'{"seed": 123456789012345678901234567890, "a": 1, "a": 2}') == {
        "seed": 123456789012345678901234567890, "a": 2}


@pytest.fixture
def front_client(monkeypatch):
    front = Front(HttpConfig(), "ipc:///nonexistent/councild.sock")

    def broken(request):
        raise RuntimeError("a bug")

    monkeypatch.setattr(front, "seat_for", broken)
    # The lifespan (the daemon probe) is not started: no daemon is needed to reach the bug.
    return TestClient(front.app, raise_server_exceptions=False)


@pytest.mark.parametrize("path, shape", [("/v1/chat/completions", "openai"), ("/v1/completions", "openai"),
                                         ("/v1/responses", "openai"), ("/v1/messages", "anthropic"),
                                         ("/v1/messages/count_tokens", "anthropic")])
def test_an_unexpected_exception_is_still_a_json_error_in_the_routes_shape(front_client, path, shape):
    r = front_client.post(path, json={"model": "m"})
    assert r.status_code == 500 and r.headers["content-type"].startswith("application/json"), r.text
    if shape == "anthropic":
        assert r.json() == {"type": "error", "error": {"type": "api_error", "message": r.json()["error"]["message"]}}
    else:
        assert r.json()["error"]["code"] == "internal" and r.json()["error"]["type"] == "server_error"
    assert "RuntimeError" in r.text


class _FailingStream:
    """A generation whose next message is a bug of the front's own (not a daemon error)."""

    request_id = "r1"

    def __init__(self):
        self.cancelled = False

    async def next_message(self):
        raise RuntimeError("a bug")

    async def cancel(self):
        self.cancelled = True


@pytest.mark.parametrize("path, body, error_line", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True},
     'data: {"error":{"message":"the front failed mid-stream (RuntimeError); it is logged"'),
    ("/v1/messages", {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True},
     'data: {"type":"error","error":{"type":"api_error","message":"the front failed mid-stream (RuntimeError)"}}'),
])
def test_a_fault_mid_stream_ends_the_stream_with_one_error_event_and_stops_the_work(monkeypatch, path, body,
                                                                                     error_line):
    front = Front(HttpConfig(), "ipc:///nonexistent/councild.sock")
    stream = _FailingStream()
    limits = m.Limits(max_frame_bytes=1 << 20, max_tokens=64, max_prompt_tokens=64, heartbeat_interval_s=1.0,
                      heartbeat_timeout_s=5.0)

    async def connected(seat):
        return None, m.Welcome(seat=seat, server="test", model="m", capabilities=[], limits=limits)

    async def start(request, client, gen, stream_it, route, seat):
        return stream, m.Accepted(request_id="r1", queue_position=0, prompt_tokens=3)

    monkeypatch.setattr(front, "connected_client", connected)
    monkeypatch.setattr(front, "start_generation", start)
    r = TestClient(front.app, raise_server_exceptions=False).post(path, json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    data = [line for line in r.text.splitlines() if line.startswith("data: ")]
    assert data[-1].startswith(error_line), data
    assert sum("error" in line for line in data) == 1 and stream.cancelled
