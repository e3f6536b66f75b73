"""Property-based fuzzing of the HTTP front, route by route, against a real front and daemon.

Bodies come from each route's own request fields and are then mutated
(tests/e2e/http_fuzz_bodies.py): wrong types, extreme numbers, unusual and invalid Unicode
(lone surrogates as escapes and as raw bytes, bytes that are not UTF-8), nesting up to 5,000
levels, huge strings on both sides of the size limit, missing and extra fields, broken JSON.
Every answer must be a 2xx (a whole JSON body, or a stream that ends with its route's
terminal event) or a 4xx in the route's own error shape (OpenAI's, or Anthropic's on
/v1/messages*); never a 500 or plain text. Afterwards every route still serves, nothing is
left running at the daemon, and neither log holds a traceback.

The daemon caps max_tokens at 4 and prompts at 256 tokens, so a body that generates costs
milliseconds and most mutated ones are refused at validation. The short run (SHORT_EXAMPLES
bodies a route, ~30 s with the daemon's start) is in the full suite; `make check` has the
contract cases instead (test_http_front.py: a lone surrogate, deep nesting, a body over the
limit, on every route). The long run is slow, its count from COUNCILD_HTTP_FUZZ_EXAMPLES
(default 10,000 a route; with COUNCILD_HTTP_FUZZ_PROGRESS=DIR each route writes its counts so
far to DIR/<route>.json every 200 bodies):

    COUNCILD_HTTP_FUZZ_EXAMPLES=10000 PYTHONPATH=$PWD .venv/bin/python -m pytest -q -s -m slow \\
        tests/e2e/test_http_fuzz.py
"""

from __future__ import annotations

import collections
import json
import os
import time
from pathlib import Path

import httpx
import pytest
from e2e_harness import start_daemon
from hypothesis import HealthCheck, given, settings
from http_fuzz_bodies import ROUTES, mutated
from http_harness import start_front

from protocol import Client

SHORT_EXAMPLES = 30
MAX_BODY = 256 * 1024  # the front's http.max_body_bytes here: huge strings land on both sides of it
# A patient heartbeat: beside other suites the box starves, and a front whose pings came late
# had its requests ended client_gone (a 500) after the fast harness timeout's 3 s.
DAEMON_CONFIG = "heartbeat_timeout_s = 60.0\nmax_tokens = 4\nmax_prompt_tokens = 256\n"
STREAM_END = {"chat": "[DONE]", "completions": "[DONE]", "messages": "message_stop",
              "responses": ("response.completed", "response.incomplete")}
FULL_OBJECT = {"chat": ("object", "chat.completion"), "completions": ("object", "text_completion"),
               "messages": ("type", "message"), "responses": ("object", "response")}


@pytest.fixture(scope="module")
def fuzz_stack(tmp_path_factory, e2e_model):
    tmp = tmp_path_factory.mktemp("http-fuzz")
    d = start_daemon(tmp, e2e_model, config=DAEMON_CONFIG)
    # The probe's patience raised: on a starved box (this suite beside others) a status answer
    # can take seconds, and a 503 for an unreachable daemon is not what this test is about.
    front = start_front(tmp, d.endpoint, f"max_body_bytes = {MAX_BODY}\ndaemon_probe_timeout_s = 30.0\n")
    yield d, front
    front.stop()
    assert d.stop() == 0, d.log_path.read_text()[-3000:]


def _error_shape_ok(shape: str, body) -> bool:
    if shape == "anthropic":
        return (isinstance(body, dict) and body.get("type") == "error" and set(body) == {"type", "error"}
                and isinstance(body["error"], dict) and set(body["error"]) == {"type", "message"}
                and isinstance(body["error"]["type"], str) and isinstance(body["error"]["message"], str)
                and body["error"]["message"] != "")
    err = body.get("error") if isinstance(body, dict) and set(body) == {"error"} else None
    return (isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}
            and isinstance(err["message"], str) and err["message"] != "" and isinstance(err["type"], str)
            and (err["param"] is None or isinstance(err["param"], str))
            and (err["code"] is None or isinstance(err["code"], str)))


def _sse_last(route: str, text: str):
    """The last event's name (Anthropic's, Responses) or data ("[DONE]") of a stream, after
    checking every data line is JSON (or [DONE]) and none is an error."""
    last = None
    for line in text.splitlines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            last = data
            continue
        event = json.loads(data)
        assert "error" not in event and event.get("type") not in ("error", "response.failed"), event
        last = event.get("type") if route in ("messages", "responses") else "data"
    return last


def check_answer(route: str, resp: httpx.Response, data: bytes, what: str, body) -> str:
    """Assert the answer is a 2xx or a well-formed 4xx; return a label for the statistics."""
    _, _, shape = ROUTES[route]
    ctx = f"{route} [{what}] -> {resp.status_code} {resp.text[:400]!r}; sent {data[:300]!r}"
    kind = resp.headers.get("content-type", "")
    if 200 <= resp.status_code < 300:
        if kind.startswith("text/event-stream"):
            last = _sse_last(route, resp.text)
            ends = STREAM_END[route]
            assert last in (ends if isinstance(ends, tuple) else (ends,)), ctx
            return "200 stream"
        assert kind.startswith("application/json"), ctx
        out = resp.json()
        if route == "count_tokens":
            assert isinstance(out.get("input_tokens"), int) and out["input_tokens"] > 0, ctx
        else:
            key, value = FULL_OBJECT[route]
            assert out.get(key) == value, ctx
        return "200"
    assert kind.startswith("application/json"), ctx  # never plain text
    out = resp.json()
    assert _error_shape_ok(shape, out), ctx
    if resp.status_code == 504:  # a deadline the body itself set, too short to meet
        assert isinstance(body, dict) and "deadline_ms" in body, ctx
        return "504 deadline"
    assert 400 <= resp.status_code < 500, ctx
    code = out["error"].get("code") if shape == "openai" else out["error"]["type"]
    return f"{resp.status_code} {code}"


def _assert_serving(d, front) -> None:
    """Every route answers a plain request; nothing is left running; no log has a traceback."""
    assert d.proc.poll() is None and front.proc.poll() is None
    valid = {
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        "/v1/completions": {"prompt": "def f(", "max_tokens": 2},
        "/v1/messages": {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        "/v1/messages/count_tokens": {"model": "m", "messages": [{"role": "user", "content": "Hi"}]},
        "/v1/responses": {"input": "Hi", "max_output_tokens": 2},
    }
    with httpx.Client(base_url=front.url, timeout=120) as http:
        for path, body in valid.items():
            r = http.post(path, json=body)
            assert r.status_code == 200, (path, r.text)
    deadline = time.monotonic() + 30
    with Client(d.endpoint, seat="fuzz-check", timeout_s=30) as c:
        while (st := c.status()).detail["in_flight"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert st.detail["in_flight"] == 0, st.detail
    front_log = front.log_path.read_text()
    assert "Traceback" not in front_log and "http.unexpected_error" not in front_log, front_log[-4000:]
    bad = [e for e in d.events() if e["event"] in ("server.handler_failed", "engine.crashed", "daemon.engine_died")]
    assert not bad, bad[:5]


def run_fuzz(stack, route: str, n: int) -> collections.Counter:
    d, front = stack
    stats: collections.Counter = collections.Counter()
    t0 = time.monotonic()
    path = ROUTES[route][0]
    progress = Path(os.environ["COUNCILD_HTTP_FUZZ_PROGRESS"]) if os.environ.get("COUNCILD_HTTP_FUZZ_PROGRESS") else None
    with httpx.Client(base_url=front.url, timeout=120) as http:

        @settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(case=mutated(route, MAX_BODY))
        def prop(case):
            data, what, body = case
            resp = http.post(path, content=data, headers={"content-type": "application/json"})
            stats[check_answer(route, resp, data, what, body)] += 1
            if progress and sum(stats.values()) % 200 == 0:  # a long run's counts so far, for whoever watches
                (progress / f"{route}.json").write_text(json.dumps({"seconds": round(time.monotonic() - t0),
                                                                   "bodies": sum(stats.values()), **stats}))

        prop()
    _assert_serving(d, front)
    total = sum(stats.values())
    print(f"\nhttp fuzz {route}: {total} bodies in {time.monotonic() - t0:.1f} s, no 5xx; "
          + ", ".join(f"{k}: {v}" for k, v in stats.most_common()))
    return stats


@pytest.mark.parametrize("route", list(ROUTES))
def test_http_fuzz_short(fuzz_stack, route):
    run_fuzz(fuzz_stack, route, SHORT_EXAMPLES)


@pytest.mark.slow
@pytest.mark.timeout(7200)
@pytest.mark.parametrize("route", list(ROUTES))
def test_http_fuzz_long(fuzz_stack, route):
    stats = run_fuzz(fuzz_stack, route, int(os.environ.get("COUNCILD_HTTP_FUZZ_EXAMPLES", "10000")))
    assert sum(v for k, v in stats.items() if k.startswith("200")) > 0, stats  # some bodies did generate
