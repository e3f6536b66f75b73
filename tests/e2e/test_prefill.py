"""Chunked prefill against a real daemon: a long prompt is prefilled in chunks (or the prefill
pacer's smaller pieces) that take turns with other streams' decode cycles, and cancel and
deadlines land between them."""

from __future__ import annotations

import random
import threading
import time

import pytest
from e2e_harness import start_daemon

from protocol.client import Client, RequestAborted

CHUNK = 16
CONFIG = f"""
heartbeat_interval_s = 0.5
heartbeat_timeout_s = 10.0
[scheduler]
prefill_chunk = {CHUNK}
"""


@pytest.fixture(scope="module")
def prefill_daemon(tmp_path_factory, e2e_model):
    d = start_daemon(tmp_path_factory.mktemp("prefill"), e2e_model, config=CONFIG)
    yield d
    assert d.stop() == 0


def long_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 500) for _ in range(n)]


def _prefill_progress(c: Client, request_id: str) -> dict | None:
    for a in c.status().detail["active_requests"]:
        if a["request_id"] == request_id:
            return a.get("prefill")
    return None


def test_cancel_during_a_long_prefill_lands_between_chunks_while_others_stream(prefill_daemon):
    received = {"n": 0}
    stop = threading.Event()

    def stream_other():
        with Client(prefill_daemon.endpoint, seat="other", timeout_s=120) as c:
            s = c.generate("def other():", max_tokens=4000)
            for _ in s:
                received["n"] = len(s.token_ids)
                if stop.is_set():
                    s.cancel()
                    break
            try:
                s.result()
            except RequestAborted:
                pass

    other = threading.Thread(target=stream_other)
    other.start()
    try:
        with Client(prefill_daemon.endpoint, seat="long", timeout_s=120) as c:
            deadline = time.monotonic() + 60
            while received["n"] == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            prompt = long_prompt(3000, seed=1)
            s = c.generate(prompt_tokens=prompt, max_tokens=4)
            rid = s.request_id
            progress = None
            while time.monotonic() < deadline:
                progress = _prefill_progress(c, rid)
                if progress and progress["done"] >= 2 * CHUNK:
                    break
                time.sleep(0.02)
            assert progress and progress["total"] == len(prompt) - 1, progress
            # The other seat keeps streaming while this prompt is being prefilled.
            n0, p0 = received["n"], progress["done"]
            while time.monotonic() < deadline:
                progress = _prefill_progress(c, rid)
                if received["n"] > n0 and progress and progress["done"] > p0:
                    break
                time.sleep(0.02)
            assert received["n"] > n0 and progress["done"] > p0 and progress["done"] < progress["total"]
            before_cancel = progress["done"]
            s.cancel()
            done = s.result()
            assert done.finish_reason == "cancelled" and done.usage.completion_tokens == 0
    finally:
        stop.set()
        other.join(60)
    ev = [e for e in prefill_daemon.events() if e["event"] == "request.done" and e["request_id"] == rid]
    assert len(ev) == 1
    prefilled = ev[0]["prefilled_tokens"]
    # Answered mid-prefill: the cancel did not wait for the remaining chunks. (How far
    # the prefill got between our last status read and the cancel reaching the engine
    # depends on this machine's load, so this bound is loose; the engine checks its
    # commands after every chunk.)
    assert before_cancel <= prefilled < len(prompt) - 1, (before_cancel, prefilled)
    # Between pieces: whole chunks, or the pacer's smaller pieces while the other seat
    # decoded (then more forwards than whole chunks would take).
    assert prefilled % CHUNK == 0 or ev[0]["prefill_forwards"] > prefilled // CHUNK, ev[0]


def test_deadline_mid_prefill(prefill_daemon):
    with Client(prefill_daemon.endpoint, seat="long", timeout_s=60) as c:
        s = c.generate(prompt_tokens=long_prompt(3000, seed=2), max_tokens=4, deadline_ms=400)
        with pytest.raises(RequestAborted) as err:
            s.result()
    assert err.value.code == "deadline_exceeded" and "mid-prefill" in err.value.message, err.value.message


@pytest.mark.quick
def test_chunked_prefill_is_the_one_shot_computation(prefill_daemon, e2e_model):
    """Served in 16-token chunks that take turns with other work, a prompt decodes (exact
    greedy) exactly as serial decode after an in-process prefill of the same chunk size.
    (The chunk size itself is part of the numerics: see OPERATIONS.md, Chunked prefill.)"""
    from daemon.engine.model.loading import load_model
    from daemon.engine.decoders.sampling import Sampler
    from daemon.engine.decoders.serial import serial_decode
    from daemon.engine.prefill.prefill import prefill
    from daemon.engine.types import SamplingParams

    prompt = long_prompt(300, seed=3)
    with Client(prefill_daemon.endpoint, seat="x", timeout_s=60) as c:
        s = c.generate(prompt_tokens=prompt, max_tokens=24, speculation="exact")
        assert s.result().usage.completion_tokens == 24
        served = list(s.token_ids)
    lm = load_model(e2e_model)
    cache = lm.make_cache()
    last = prefill(lm, prompt, cache, CHUNK)
    gen = serial_decode(lm, [last.item()], Sampler(SamplingParams()), cache=cache)
    reference = [next(gen).tokens[0] for _ in range(24)]
    gen.close()
    assert served == reference
