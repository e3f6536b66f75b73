"""Speculation and the governor through a real daemon on the bundled model, with the
client library and the CLI as a council process would use them."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from daemon.paths import BUNDLED_MODEL
from protocol.client import Client

from e2e_harness import REPO

PROMPTS = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n", "import os\n\n\ndef walk(path):\n"]


# bundled_daemon: the session's shared daemon on the bundled model (tests/conftest.py).


def test_exact_speculation_streams_the_serial_text_at_every_depth(bundled_daemon):
    with Client(bundled_daemon.endpoint, seat="fidelity", timeout_s=60) as c:
        serial = {p: c.complete(p, max_tokens=40, speculation="off").text for p in PROMPTS}
        for depth in (1, 2, 3, 4):
            reply = c.governor("pin_depth", depth)
            assert reply.ok and reply.state["depth"] == depth, reply
            for p in PROMPTS:
                stream = c.generate(p, max_tokens=40, speculation="exact")
                text = "".join(stream)
                assert text == serial[p], f"depth {depth} diverged on {p!r}"
                spec = stream.done.speculation
                assert spec.mode == "exact" and spec.drafted > 0
                assert spec.drafted_by_position[depth - 1] > 0  # it really drafted that deep
        assert c.governor("auto").ok


@pytest.mark.quick
def test_depth_by_batch_height_is_in_status_and_a_pin_sets_every_height(bundled_daemon):
    with Client(bundled_daemon.endpoint, seat="heights", timeout_s=60) as c:
        table = c.status().detail["governor"]["depth_by_height"]
        assert [r["heights"] for r in table] == ["1", "2", "3-4", "5-8", "9+"]
        assert c.governor("pin_depth", 2).ok
        gov = c.status().detail["governor"]
        assert [r["depth"] for r in gov["depth_by_height"]] == [2] * 5
        assert [h["heights"] for h in gov["cost_model"]["heights"]] == ["2", "3-4", "5-8", "9+"]
        env = {"COUNCILD_ENDPOINT": bundled_daemon.endpoint, "PATH": "/usr/bin:/bin"}
        out = subprocess.run([sys.executable, "-m", "daemon.cli", "status"], cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=60)  # fmt: skip
        assert "depth by batch height" in out.stdout and "3-4: 2" in out.stdout, out.stdout + out.stderr
        assert c.governor("auto").ok


def test_prompt_lookup_drafts_through_the_daemon_and_stays_exact(bundled_daemon):
    from daemon.measure.fidelity import load_quoting_prompts

    with Client(bundled_daemon.endpoint, seat="lookup", timeout_s=60) as c:
        for p in load_quoting_prompts()[1:3]:  # a class and a table the output copies
            serial = c.complete(p, max_tokens=48, speculation="off").text
            done = c.complete(p, max_tokens=48, speculation="exact")
            assert done.text == serial
            sp = done.speculation
            assert sp.lookup_drafted > 0 and sp.lookup_cycles > 0, sp  # lookup blocks ran
            # The head's drafts and lookup's are counted apart; the by-position arrays sum to the head's.
            assert sp.drafted == sum(sp.drafted_by_position) and sp.accepted == sum(sp.accepted_by_position), sp


@pytest.mark.quick
def test_trained_head_is_accepted_through_the_daemon(bundled_daemon):
    with Client(bundled_daemon.endpoint, seat="accept", timeout_s=60) as c:
        c.governor("pin_depth", 1)
        done = c.complete(PROMPTS[0], max_tokens=64, speculation="fast")
        c.governor("auto")
    spec = done.speculation
    # The bundled head was trained for this: most first-position drafts are accepted.
    assert spec.drafted > 0 and spec.accepted / spec.drafted >= 0.5, spec


@pytest.mark.quick
def test_evict_and_reload_head_while_serving(bundled_daemon):
    with Client(bundled_daemon.endpoint, seat="ops", timeout_s=60) as c:
        assert c.status().detail["head_resident"]
        reply = c.governor("evict_head")
        assert reply.ok, reply
        status = c.status()
        assert not status.detail["head_resident"] and status.detail["depth"] == 0
        done = c.complete(PROMPTS[1], max_tokens=16, speculation="exact")
        # No head drafts (prompt lookup may still verify blocks: it needs no head).
        assert done.usage.completion_tokens == 16
        assert done.speculation is None or not any(done.speculation.drafted_by_position)
        assert c.governor("load_head").ok
        deadline = time.monotonic() + 30
        while not c.status().detail["head_resident"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert c.status().detail["head_resident"]
        c.governor("pin_depth", 2)
        done = c.complete(PROMPTS[1], max_tokens=16, speculation="exact")
        assert done.speculation is not None and done.speculation.drafted > 0
        assert c.governor("auto").ok
    events = [e["event"] for e in bundled_daemon.events()]
    assert "head.evicted" in events and events.count("head.loaded") >= 2


def test_bad_override_is_refused(bundled_daemon):
    with Client(bundled_daemon.endpoint, seat="ops", timeout_s=30) as c:
        reply = c.governor("pin_depth", None)
        assert not reply.ok and "depth" in reply.message


@pytest.mark.quick
def test_cli_generate_and_status(bundled_daemon):
    env = {"COUNCILD_ENDPOINT": bundled_daemon.endpoint, "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "daemon.cli", "generate", "def add(a, b):", "--max-tokens", "8"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() and "8 tokens" in out.stderr
    st = subprocess.run([sys.executable, "-m", "daemon.cli", "status", "--json"], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=60)
    assert st.returncode == 0, st.stderr
    reply = json.loads(st.stdout)
    assert reply["type"] == "status_reply" and reply["model"] == "tiny-qwen35"
    table = subprocess.run([sys.executable, "-m", "daemon.cli", "status"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=60)
    assert "MTP head" in table.stdout and "governor" in table.stdout


def test_cli_reports_an_absent_daemon_clearly(tmp_path):
    env = {"COUNCILD_ENDPOINT": f"ipc://{tmp_path}/nobody.sock", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "daemon.cli", "status", "--timeout", "1"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "nobody.sock" in out.stderr


def test_streamed_and_final_text_are_the_decoding_of_the_token_ids(bundled_daemon):
    """On the fidelity prompts, in every decode path (serial, exact and fast speculation,
    the continuous batch), the streamed chunks, Done.text and the decoding of the committed
    ids are one and the same text: no leading space lost, nothing added."""
    from transformers import AutoTokenizer

    from daemon.measure.fidelity import load_prompts

    tok = AutoTokenizer.from_pretrained(str(BUNDLED_MODEL))
    prompts = load_prompts()
    begins_with_space = 0

    def check(stream, chunks):
        done = stream.done
        assert "".join(chunks) == done.text
        assert len(stream.token_ids) == done.usage.completion_tokens
        assert done.text == tok.decode(stream.token_ids), (stream.request_id, done.text)
        return tok.decode(stream.token_ids)[:1] == " "

    with Client(bundled_daemon.endpoint, seat="text", timeout_s=60) as c:
        for depth, mode in ((0, "off"), (1, "exact"), (2, "fast")):
            assert c.governor("pin_depth", depth).ok
            for p in prompts:
                stream = c.generate(p, max_tokens=24, speculation=mode)
                begins_with_space += check(stream, list(stream))
        assert c.governor("pin_depth", 0).ok
        # Several at once: they share the batched forward.
        streams = [c.generate(p, max_tokens=24, speculation="off") for p in prompts[:4]]
        for s in streams:
            check(s, list(s))
        assert c.governor("auto").ok
    assert begins_with_space > 0, "no completion began with a space: the test lost its point"


def _councild(*argv, endpoint=None, shell_pipe=None):
    cmd = [sys.executable, "-m", "daemon.cli", *argv] + (["--endpoint", endpoint] if endpoint else [])
    if shell_pipe:
        import shlex

        line = "set -o pipefail; " + " ".join(map(shlex.quote, cmd)) + " | " + shell_pipe
        return subprocess.run(["bash", "-c", line], cwd=REPO, capture_output=True, text=True, timeout=60)
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)


def test_operator_commands_say_what_they_did_and_never_trace_back(bundled_daemon):
    ep = bundled_daemon.endpoint
    too_deep = _councild("governor", "pin", "17", endpoint=ep)
    assert too_deep.returncode == 2 and "not a depth from 0 to 16" in too_deep.stderr
    above_max = _councild("governor", "pin", "9", endpoint=ep)
    assert above_max.returncode == 1 and "governor.max_depth = 4" in above_max.stdout, above_max
    pinned = _councild("governor", "pin", "2", endpoint=ep)
    assert pinned.returncode == 0 and pinned.stdout.startswith("depth pinned to 2"), pinned
    released = _councild("governor", "auto", endpoint=ep)
    assert released.returncode == 0 and "override released" in released.stdout, released
    for out in (too_deep, above_max, pinned, released):
        assert "Traceback" not in out.stderr and "SetDepth" not in out.stdout
    garbage = _councild("status", endpoint="garbage")
    assert garbage.returncode == 2 and "cannot connect to 'garbage'" in garbage.stderr
    assert "Traceback" not in garbage.stderr
    piped = _councild("status", endpoint=ep, shell_pipe="head -1")
    assert piped.stdout.startswith("server") and "Traceback" not in piped.stderr, piped.stderr


@pytest.mark.quick
def test_every_line_the_bundled_daemon_logs_is_json(bundled_daemon):
    """Loading the bundled model makes transformers warn about rope_parameters keys; that
    line once reached stderr as plain text in the middle of the JSON stream."""
    lines = [line for line in bundled_daemon.log_path.read_text().splitlines() if line.strip()]
    events = [json.loads(line) for line in lines]  # every line, not just most
    assert "model.loaded" in {e["event"] for e in events}
    assert all({"event", "level", "timestamp"} <= e.keys() for e in events)
    # A library's sentence is a message under one event name, not an event name of its own.
    library = [e for e in events if e.get("logger", "").startswith("transformers")]
    assert library and all(e["event"] == "library.log" and "rope_parameters" in e["message"] for e in library), library
