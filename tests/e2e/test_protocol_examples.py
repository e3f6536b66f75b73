"""Every example frame in protocol/PROTOCOL.md against a live daemon.

The doc's session (`C:` frames a client sends, `D:` frames it receives) is replayed, frame
by frame and byte for byte as msgpack, on a raw DEALER socket to a real daemon serving the
bundled model with the default configuration. Each documented `D:` frame is matched to the
real reply of the same type (in order) and must carry the same field names at every depth,
values of the same JSON types, and the same values where they do not depend on the model
or the clock (version, seat, request ids, error codes and messages, limits, capabilities).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec
import pytest

from daemon import __version__
from daemon.paths import BUNDLED_MODEL
from protocol import messages as m

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)

DOC = (Path(m.__file__).parent / "PROTOCOL.md").read_text()
# Field names whose values are fixed by the protocol, the config defaults and the request,
# not by the model's text or the clock. Anything else is checked by name and type only.
DETERMINISTIC = {"type", "v", "seat", "request_id", "server", "capabilities", "code", "message", "retry_after_s",
                 "queue_position", "nonce", "seq", "mode", "max_frame_bytes", "max_tokens", "heartbeat_interval_s",
                 "heartbeat_timeout_s", "reasoning", "logprobs"}
ANNOTATION = re.compile(r"\s+\([^()]*\)\s*$")  # "(2 s passed while waiting)" after a frame


def example_frames(doc: str = DOC) -> list[tuple[str, dict]]:
    """(side, frame) for every `C:`/`D:` line in the doc's code blocks, continuation lines joined."""
    frames: list[tuple[str, str]] = []
    for block in re.findall(r"^```\n(.*?)^```", doc, re.S | re.M):
        for line in block.splitlines():
            if re.match(r"^[CD]: \{", line):
                frames.append((line[0], line[3:]))
            elif frames and line.startswith("    "):
                frames[-1] = (frames[-1][0], frames[-1][1] + " " + line.strip())
    return [(side, json.loads(ANNOTATION.sub("", text))) for side, text in frames]


def _kind(x) -> str:
    return {bool: "bool", int: "int", float: "float", str: "str", list: "list", dict: "map", type(None): "null"}[type(x)]


def shape_drift(doc, real, where: str = "") -> list[str]:
    """What differs between a documented frame and a real one (names, types, fixed values)."""
    if _kind(doc) != _kind(real):
        return [f"{where or 'frame'}: documented {_kind(doc)} {doc!r}, sent {_kind(real)} {real!r}"]
    out = []
    if isinstance(doc, dict):
        if set(doc) != set(real):
            out.append(f"{where or 'frame'}: documented fields {sorted(doc)}, sent {sorted(real)}")
        for k in sorted(set(doc) & set(real)):
            if k in DETERMINISTIC and doc[k] != real[k]:
                out.append(f"{where}.{k}: documented {doc[k]!r}, sent {real[k]!r}")
            else:
                out += shape_drift(doc[k], real[k], f"{where}.{k}")
    elif isinstance(doc, list) and doc and real:
        out += shape_drift(doc[0], real[0], f"{where}[0]")
    return out


@pytest.fixture(scope="module")
def replies(_bundled_daemon_session):
    """The doc's client frames sent in order, each followed by every reply it draws (on the
    session's shared daemon: bundled model, default configuration; tests/conftest.py)."""
    d = _bundled_daemon_session
    try:
        sock = d.raw_socket(timeout_ms=60000)
        got: list[dict] = []
        for side, frame in example_frames():
            if side != "C":
                continue
            sock.send(msgspec.msgpack.encode(frame))
            while True:  # until this frame's last reply: welcome, pong, or a terminal message
                reply = msgspec.msgpack.decode(sock.recv())
                got.append(reply)
                if reply["type"] in ("welcome", "pong", "error", "done", "status_reply"):
                    break
    finally:
        sock.close()
    return got


def test_the_doc_has_a_session_to_check():
    frames = example_frames()
    sides = [s for s, _ in frames]
    assert sides.count("C") >= 5 and sides.count("D") >= 8
    assert {f["type"] for s, f in frames if s == "D"} >= {"welcome", "accepted", "tokens", "done", "pong", "error"}


def test_every_documented_reply_matches_a_real_one(replies):
    pending = list(replies)
    drift = []
    for side, doc in example_frames():
        if side != "D":
            continue
        real = next((r for r in pending if r["type"] == doc["type"]), None)
        assert real is not None, f"the daemon sent no {doc['type']} frame for {doc}; it sent {replies}"
        pending.remove(real)
        drift += shape_drift(doc, real, doc["type"])
    assert not drift, "PROTOCOL.md's example session drifted from the daemon:\n" + "\n".join(drift)


def test_the_welcome_example_tells_the_real_version_and_a_context_sized_prompt_limit(replies):
    (welcome,) = [r for r in replies if r["type"] == "welcome"]
    assert welcome["server"] == f"councild {__version__}"
    context = json.loads((BUNDLED_MODEL / "config.json").read_text())
    context = context.get("text_config", context)["max_position_embeddings"]
    assert welcome["limits"]["max_prompt_tokens"] == context  # the model's context, not a fixed 32768
    # The example's model is another one, so its value cannot be compared; the doc must say
    # where the number comes from.
    assert "`limits.max_prompt_tokens` is the served model's context" in DOC


def test_drift_is_reported():
    assert shape_drift({"a": 1, "b": [1.0]}, {"a": 1, "b": [1.0]}) == []
    assert shape_drift({"a": 1}, {"a": 1, "c": 2})  # a field the doc lacks
    assert shape_drift({"a": {"x": 1}}, {"a": {"x": 1.5}})  # a type
    assert shape_drift({"code": "x"}, {"code": "y"})  # a fixed value
    assert not shape_drift({"text": "Hi"}, {"text": "Hello"})  # model output: type only
