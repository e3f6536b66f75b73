"""The request-body contract of every generating route (front/body.py; docs/OPERATIONS.md,
"Request bodies"): a lone UTF-16 surrogate (as a JSON escape, as raw bytes, in a key), bytes
that are not UTF-8, nesting past 64 levels, a body over http.max_body_bytes and broken JSON
each get a 4xx in the route's own error shape naming what is wrong; never a 500 or plain text.
test_http_fuzz.py generates such bodies at random; these are the cases named in the contract."""

from __future__ import annotations

import httpx
import pytest
from http_harness import start_front

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)

MAX_BODY = 64 * 1024
# Each route's body, with its main text field holding TEXT (a placeholder, replaced as bytes).
TEXT = b"__TEXT__"
ROUTES = {
    "/v1/chat/completions": (b'{"messages": [{"role": "user", "content": "__TEXT__"}], "max_tokens": 1}',
                             "messages[0].content", "openai"),
    "/v1/completions": (b'{"prompt": "__TEXT__", "max_tokens": 1}', "prompt", "openai"),
    "/v1/messages": (b'{"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "__TEXT__"}]}',
                     "messages[0].content", "anthropic"),
    "/v1/messages/count_tokens": (b'{"model": "m", "messages": [{"role": "user", "content": "__TEXT__"}]}',
                                  "messages[0].content", "anthropic"),
    "/v1/responses": (b'{"input": "__TEXT__", "max_output_tokens": 1}', "input", "openai"),
}


@pytest.fixture(scope="module")
def front(tmp_path_factory, daemon_proc):
    """The session's shared daemon behind a front with a 64 KiB body limit."""
    f = start_front(tmp_path_factory.mktemp("http-bodies"), daemon_proc.endpoint, f"max_body_bytes = {MAX_BODY}\n")
    yield f
    f.stop()
    log = f.log_path.read_text()
    assert "Traceback" not in log, log[-3000:]


def _error(path: str, r: httpx.Response) -> tuple[str, str | None, str | None]:
    """(message, param, code) of an error answer, after checking it is JSON in the route's shape."""
    assert r.headers["content-type"].startswith("application/json"), (r.status_code, r.text)
    body = r.json()
    if ROUTES[path][2] == "anthropic":
        assert set(body) == {"type", "error"} and body["type"] == "error", body
        assert set(body["error"]) == {"type", "message"}, body
        return body["error"]["message"], None, body["error"]["type"]
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]["message"], body["error"]["param"], body["error"]["code"]


def _post(http: httpx.Client, path: str, data: bytes) -> httpx.Response:
    return http.post(path, content=data, headers={"content-type": "application/json"})


@pytest.mark.parametrize("path", list(ROUTES))
def test_text_that_is_not_valid_unicode_is_a_400_naming_the_field(front, path):
    template, field, shape = ROUTES[path]
    with httpx.Client(base_url=front.url, timeout=60) as http:
        for text, what in ((rb"a\udcffb", "lone UTF-16 surrogate (\\udcff at character 1)"),
                           (rb"\ud83d", "lone UTF-16 surrogate (\\ud83d at character 0)"),  # half an emoji, at the end
                           (b"a\xed\xb3\xbfb", "not valid UTF-8 (byte 0xed"),  # a surrogate as raw (CESU-8) bytes
                           (b"a\xffb", "not valid UTF-8 (byte 0xff at character 1)")):
            r = _post(http, path, template.replace(TEXT, text))
            assert r.status_code == 400, (text, r.text)
            message, param, code = _error(path, r)
            assert message.startswith(f"{field}: the string ") and what in message, message
            if shape == "openai":
                assert (param, code) == (field, "invalid_unicode"), r.text
            else:
                assert code == "invalid_request_error"
        # In an object key, deeper in the body: the path names the object.
        r = _post(http, path, template.replace(b"{", b'{"metadata": {"k\\udcff": 1}, ', 1).replace(TEXT, b"Hi"))
        assert r.status_code == 400 and _error(path, r)[0].startswith("metadata: an object key holds a lone"), r.text
        # A surrogate pair is one character: accepted.
        r = _post(http, path, template.replace(TEXT, rb"\ud83d\ude00"))
        assert r.status_code == 200, r.text


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize("path", list(ROUTES))
def test_nesting_past_64_levels_is_a_400(front, path):
    template, _, shape = ROUTES[path]
    with httpx.Client(base_url=front.url, timeout=60) as http:
        for depth in (5000, 64):  # the body is level 1: 64 nested inside it is 65
            r = _post(http, path, template.replace(b"{", b'{"metadata": ' + _nested(depth) + b", ", 1).replace(TEXT, b"Hi"))
            assert r.status_code == 400, r.text
            message, _, code = _error(path, r)
            assert message == "the request body nests objects and arrays more than 64 levels deep", message
            assert code == ("json_too_deep" if shape == "openai" else "invalid_request_error")
        r = _post(http, path, _nested(5000))  # not an object either: the depth is what is said
        assert r.status_code == 400 and "64 levels" in _error(path, r)[0]
        # 64 levels in all is within the limit: what is said next is about the field, not the nesting.
        r = _post(http, path, template.replace(b"{", b'{"metadata": ' + _nested(63) + b", ", 1).replace(TEXT, b"Hi"))
        assert r.status_code in (200, 400) and "levels" not in r.text, r.text


@pytest.mark.parametrize("path", list(ROUTES))
def test_a_body_over_max_body_bytes_is_a_413(front, path):
    template, _, shape = ROUTES[path]
    base = len(template.replace(TEXT, b""))
    with httpx.Client(base_url=front.url, timeout=60) as http:
        r = _post(http, path, template.replace(TEXT, b"x" * (MAX_BODY - base + 1)))
        assert r.status_code == 413, r.text
        message, _, code = _error(path, r)
        assert f"larger than {MAX_BODY} bytes" in message and "http.max_body_bytes" in message, message
        assert code == "request_too_large"
        # At the limit the body is read: what comes back is about the prompt (too long for the daemon), not the size.
        r = _post(http, path, template.replace(TEXT, b"x" * (MAX_BODY - base)))
        assert r.status_code != 413 and r.status_code < 500, r.text


@pytest.mark.parametrize("path", list(ROUTES))
def test_broken_json_is_a_400_in_the_routes_shape(front, path):
    template, _, shape = ROUTES[path]
    good = template.replace(TEXT, b"Hi")
    with httpx.Client(base_url=front.url, timeout=60) as http:
        for data, says in ((b"", "empty"), (b"{not json", "not valid JSON"), (good + b"x", "trailing characters"),
                           (good[:-1] + b', "temperature": NaN}', "not valid JSON"),
                           (good[:-1] + b', "max_tokens": 1e400}', "out of range"),
                           (b"\xef\xbb\xbf" + good, "not valid JSON")):
            r = _post(http, path, data)
            assert r.status_code == 400, (data, r.text)
            message, _, code = _error(path, r)
            assert says in message, (data, message)
            assert code == ("invalid_json" if shape == "openai" else "invalid_request_error")


def test_unknown_paths_and_methods_answer_json(front):
    with httpx.Client(base_url=front.url, timeout=60) as http:
        r = http.get("/v1/chat/completions")
        assert r.status_code == 405 and _error("/v1/chat/completions", r)[0] == "Method Not Allowed"
        assert r.headers["allow"] == "POST"
        r = http.get("/v1/messages")
        assert r.status_code == 405 and _error("/v1/messages", r)[2] == "invalid_request_error"
        r = http.post("/v1/nothing-here", json={})
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
