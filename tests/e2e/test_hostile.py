"""Hostile conditions, each against a real daemon process: a log sink that fails
(stderr on /dev/full: every write is ENOSPC), start-up on a bad filesystem, a model load
interrupted by SIGTERM, absurd configuration, prompts sized against the model's context,
tokenization that must not stall other streams, and honest queue/prefill timings.

The flood of Generates from a client that does not read is in test_fuzz_live.py, the log
disk filling up under load in test_reliability_load.py (tools/loadtest.py)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from e2e_harness import REPO, start_daemon
from protocol import Client, Done, Error, Generate, Tokens, decode_daemon, encode
from protocol.client import CouncilError

CONTEXT = 4096  # max_position_embeddings of the random test model (daemon/engine/model/random_model.py)


def _serve(tmp: Path, model: Path, *args: str, env: dict | None = None, stdout=None, config: str | None = None):
    """`councild serve` started by hand, for the cases the harness cannot express."""
    cmd = [sys.executable, "-m", "daemon.cli", "serve", "--model", str(model), "--log-format", "json", *args]
    if config is not None:
        (tmp / "c.toml").write_text(config)
        cmd += ["--config", str(tmp / "c.toml")]
    log = tmp / "serve.log"
    out = stdout if stdout is not None else open(log, "w")
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=out, stderr=subprocess.STDOUT), log


def _exit_of(proc: subprocess.Popen, timeout: float = 60.0) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"councild serve did not exit within {timeout} s")


# ---------------------------------------------------------------------------- 1: the log sink


def test_a_log_sink_that_fails_every_write_takes_nothing_down(tmp_path, e2e_model):
    """stdout and stderr on /dev/full: every log line fails with ENOSPC. The daemon starts,
    serves streamed and unstreamed requests to their one terminal, counts the lost lines in
    status, and drains to exit 0 on SIGTERM."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    endpoint = f"ipc://{run / 'councild.sock'}"
    with open("/dev/full", "w") as full:
        proc, _ = _serve(tmp_path, e2e_model, "--endpoint", endpoint, stdout=full)
    try:
        from protocol.readiness import wait_until_answering

        wait_until_answering(endpoint, proc, timeout_s=90.0)
        with Client(endpoint, seat="full-disk", timeout_s=30) as c:
            for i in range(3):
                s = c.generate(f"def f{i}():", max_tokens=6)
                text = "".join(s)
                assert s.done.usage.completion_tokens == 6 and text == s.done.text
                assert c.complete("x = ", max_tokens=4).usage.completion_tokens == 4
            with pytest.raises(CouncilError) as exc:  # an Error terminal goes out too
                c.generate(prompt_tokens=[10**6], max_tokens=2).result()
            assert exc.value.code == "invalid_request"
            detail = c.status().detail
        assert detail["in_flight"] == 0
        assert detail["log_lines_dropped"] > 10, detail  # every line since start-up
        proc.send_signal(signal.SIGTERM)
        assert _exit_of(proc) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------------------- 5: start-up filesystem faults


def _refused(tmp: Path, model: Path, *args: str, env: dict | None = None) -> tuple[int, str]:
    proc, log = _serve(tmp, model, *args, env=env)
    code = _exit_of(proc, timeout=60)
    return code, log.read_text()


def test_socket_path_that_is_a_directory_is_refused(tmp_path, e2e_model):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    (run / "councild.sock").mkdir()
    code, out = _refused(tmp_path, e2e_model, "--endpoint", f"ipc://{run / 'councild.sock'}")
    assert code == 78, out
    assert "is a directory" in out and "Traceback" not in out, out
    assert (run / "councild.sock").is_dir()


def test_regular_file_at_the_socket_path_is_refused_and_kept(tmp_path, e2e_model):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    (run / "councild.sock").write_text("someone's notes")
    code, out = _refused(tmp_path, e2e_model, "--endpoint", f"ipc://{run / 'councild.sock'}")
    assert code == 78, out
    assert "is a regular file" in out and "Traceback" not in out, out
    assert (run / "councild.sock").read_text() == "someone's notes"


def test_runtime_dir_that_cannot_be_created(tmp_path, e2e_model):
    """The default endpoint's folder under a regular file: exit 78 with the folder named."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    code, out = _refused(tmp_path, e2e_model, env={"COUNCILD_RUNTIME_DIR": str(blocker / "councild"),
                                                   "COUNCILD_ENDPOINT": ""})
    assert code == 78, out
    assert "cannot create the runtime folder" in out and "Traceback" not in out, out


@pytest.fixture
def full_tmpfs(tmp_path):
    """A 64 KiB tmpfs filled to the last block (needs mount rights: root here)."""
    where = tmp_path / "tiny"
    where.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(where)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root); the /dev/full test covers the log sink")
    try:
        fd = os.open(where / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_full_runtime_dir_is_a_temporary_failure(tmp_path, e2e_model, full_tmpfs):
    code, out = _refused(tmp_path, e2e_model, "--endpoint", f"ipc://{full_tmpfs / 'councild.sock'}")
    assert code == 75, out
    assert "disk is full" in out and "Traceback" not in out, out


def test_unusable_cache_dir_does_not_block_start_up(tmp_path, e2e_model):
    """COUNCILD_CACHE_DIR is a regular file: the daemon warns (cache.unavailable) and serves.
    The same daemon has max_prompt_tokens above the model's context: it is clamped to it."""
    cache = tmp_path / "cache-is-a-file"
    cache.write_text("")
    d = start_daemon(tmp_path, e2e_model, config="max_prompt_tokens = 100000\n",
                     env={"COUNCILD_CACHE_DIR": str(cache)})
    try:
        with Client(d.endpoint, seat="t", timeout_s=30) as c:
            assert c.complete("def ok():", max_tokens=3).usage.completion_tokens == 3
            assert c.welcome.limits.max_prompt_tokens == CONTEXT
            for kwargs in ({"prompt_tokens": [5] * (CONTEXT + 1)},
                           {"prompt": "word " * (CONTEXT * 40)}):  # over 32 characters per allowed token
                with pytest.raises(CouncilError) as exc:
                    c.generate(max_tokens=1, **kwargs).result()
                assert exc.value.code == "prompt_too_long", exc.value
                assert ("characters" in exc.value.message) == ("prompt" in kwargs), exc.value.message
        events = d.events()
        assert any(e["event"] == "cache.unavailable" for e in events)
        clamped = [e for e in events if e["event"] == "config.clamped"]
        assert clamped and clamped[0]["configured"] == 100000 and clamped[0]["used"] == CONTEXT
    finally:
        assert d.stop() == 0, d.log_path.read_text()[-3000:]


# ---------------------------------------------------------------------------- 4: config bounds, signals in a load


@pytest.mark.parametrize("line", ["[scheduler]\nmax_active = 100000\n", "[scheduler]\nmax_queued = 10000000\n",
                                  "client_send_hwm = 1000000000\n", "max_frame_bytes = 1099511627776\n",
                                  "max_prompt_tokens = 2000000\n"])
def test_absurd_sizes_are_refused_at_once(tmp_path, e2e_model, line):
    t0 = time.monotonic()
    proc, log = _serve(tmp_path, e2e_model, "--endpoint", f"ipc://{tmp_path / 'x.sock'}", config=line)
    assert _exit_of(proc, timeout=30) == 78
    key = line.split("=")[0].split("\n")[-1].strip()
    assert key in log.read_text(), log.read_text()
    assert time.monotonic() - t0 < 30


def test_sigterm_during_the_model_load_exits_promptly(tmp_path, e2e_model):
    """The model's config.json is a FIFO nobody writes: the load blocks forever (as a huge
    model's load would for minutes). SIGTERM must still end the process, with 0."""
    model = tmp_path / "model"
    shutil.copytree(e2e_model, model)
    (model / "config.json").unlink()
    os.mkfifo(model / "config.json")
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    proc, log = _serve(tmp_path, model, "--endpoint", f"ipc://{run / 'councild.sock'}")
    try:
        deadline = time.monotonic() + 60
        while '"daemon.loading"' not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        time.sleep(0.5)  # well inside the (endless) load
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert _exit_of(proc, timeout=20) == 0, log.read_text()
        assert time.monotonic() - t0 < 20
        assert '"during_load": true' in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------------------- 3: prompts and the context


def test_prompt_limit_follows_the_models_context(daemon_proc):
    with Client(daemon_proc.endpoint, seat="ctx", timeout_s=30) as c:
        assert c.welcome.limits.max_prompt_tokens == CONTEXT  # no max_prompt_tokens configured
        for kwargs in ({"prompt_tokens": [5] * (CONTEXT + 1)},  # refused before tokenizing
                       {"messages": [{"role": "user", "content": "hi"}] * 1024}):  # 22 KB -> ~7,000 tokens
            with pytest.raises(CouncilError) as exc:
                c.generate(max_tokens=1, **kwargs).result()
            assert exc.value.code == "prompt_too_long", (list(kwargs), exc.value)
        assert c.complete(prompt_tokens=[5] * 200, max_tokens=2).usage.prompt_tokens == 200


def test_tokenizing_a_huge_prompt_does_not_stall_other_streams(tmp_path, e2e_model):
    """A 2 MB prompt takes seconds to tokenize. Meanwhile another request keeps streaming:
    the tokenizing happens off the engine thread."""
    d = start_daemon(tmp_path, e2e_model, config="max_prompt_tokens = 65536\nmax_prompt_tokens_beyond_context = true\n")
    try:
        sock = d.raw_socket(timeout_ms=60000)
        sock.send(encode(Generate(request_id="steady", prompt="def steady():", max_tokens=4000,
                                  speculation="off")))
        chunks = 0
        while chunks < 3:
            msg = decode_daemon(sock.recv())
            chunks += isinstance(msg, Tokens)
        huge = "hello world " * 170_000  # 2 MB of text, ~340k tokens: refused only after tokenizing
        sock.send(encode(Generate(request_id="huge", prompt=huge, max_tokens=1)))
        t_sent = time.monotonic()
        during = 0
        while True:
            msg = decode_daemon(sock.recv())
            if getattr(msg, "request_id", None) == "huge":
                assert isinstance(msg, Error) and msg.code == "prompt_too_long", msg
                break
            if isinstance(msg, Tokens):
                during += len(msg.token_ids)
        waited = time.monotonic() - t_sent
        from protocol import Cancel

        sock.send(encode(Cancel(request_id="steady")))
        while not isinstance(msg := decode_daemon(sock.recv()), (Done, Error)) or msg.request_id != "steady":
            pass
        sock.close()
        # Seconds of tokenizing: an engine thread doing it would have produced nothing then
        # (a few chunks already in flight at most).
        assert waited > 0.5 and during >= 20, (waited, during)
    finally:
        assert d.stop() == 0, d.log_path.read_text()[-3000:]


# ---------------------------------------------------------------------------- 7: telemetry


def test_batched_prefill_is_not_reported_as_queue_time(daemon_proc):
    """A lone speculation-off request joins the continuous batch, whose add() prefills: that
    time is prefill_s. Nothing else is queued, so queue_s is the loop's hand-off only."""
    with Client(daemon_proc.endpoint, seat="timing", timeout_s=60) as c:
        done = c.complete(prompt_tokens=[(7 * i) % 500 + 3 for i in range(1500)], max_tokens=2, speculation="off")
    t = done.timings
    assert t.prefill_s > t.queue_s, t
    assert abs(t.ttft_s - (t.queue_s + t.prefill_s)) < 0.05, t
    events = [e for e in daemon_proc.events() if e["event"] == "batch.ready"]
    assert events, "the daemon has no continuous batch: this test would not exercise batch.add"
