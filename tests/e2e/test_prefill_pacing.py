"""The prefill pacer against a real daemon: while other streams decode, a long prompt is
prefilled in pieces sized to keep their gaps within ``decode_gap_bound`` quiet iterations
(a prompt of one chunk or less runs whole)
(engine_thread/prefill_pacer.py), and its tokens are what whole chunks give (exact, greedy:
this CPU's off-grid splits are bit-identical, the prefix cache's split probe says so)."""

from __future__ import annotations

import random
import threading

import pytest
from e2e_harness import start_daemon

from protocol.client import Client

CHUNK = 128
CONFIG = f"""
heartbeat_interval_s = 0.5
governor_enabled = false
[speculation]
mode = "exact"
[scheduler]
prefill_chunk = {CHUNK}
[prefix_cache]
enabled = true
"""


@pytest.fixture(scope="module")
def paced(tmp_path_factory, e2e_model):
    d = start_daemon(tmp_path_factory.mktemp("paced"), e2e_model, config=CONFIG)
    yield d
    assert d.stop() == 0


@pytest.fixture(scope="module")
def whole_chunks(tmp_path_factory, e2e_model):
    d = start_daemon(tmp_path_factory.mktemp("unpaced"), e2e_model,
                     config=CONFIG.replace("[scheduler]", "[scheduler]\ndecode_gap_bound = 0"))
    yield d
    assert d.stop() == 0


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 500) for _ in range(n)]


def _generate(endpoint: str, seat: str, prompt: list[int], max_tokens: int) -> tuple[list[int], object]:
    with Client(endpoint, seat=seat, timeout_s=300) as c:
        s = c.generate(prompt_tokens=prompt, max_tokens=max_tokens)
        done = s.result()
        return list(s.token_ids), done


@pytest.mark.quick
def test_a_long_prompt_is_paced_beside_decoding_streams_and_decodes_what_it_would_alone(paced, whole_chunks):
    long_prompt = _tokens(700, seed=11)
    streams: dict = {}
    started = threading.Event()

    def stream(seat: str, seed: int) -> None:
        with Client(paced.endpoint, seat=seat, timeout_s=300) as c:
            s = c.generate(prompt_tokens=_tokens(20, seed), max_tokens=160)
            for i, _ in enumerate(s):
                if i == 3:
                    started.set()
            streams[seat] = s.result()

    threads = [threading.Thread(target=stream, args=(f"streamer-{i}", i)) for i in range(2)]
    for t in threads:
        t.start()
    assert started.wait(120)
    # A prompt of less than a chunk runs whole beside them (a turn's first token first).
    _generate(paced.endpoint, "short", _tokens(100, seed=12), max_tokens=2)
    ids, done = _generate(paced.endpoint, "long", long_prompt, max_tokens=12)
    for t in threads:
        t.join(timeout=300)
    assert all(d.finish_reason == "length" for d in streams.values()), streams
    with Client(paced.endpoint, seat="status") as c:
        pacing = c.status().detail["step"]["pacing"]
    assert pacing["bound"] == 3.0 and pacing["paced_iterations"] > 0 and pacing["quiet_ms"] > 0, pacing
    ev = [e for e in paced.events() if e["event"] == "request.done" and e["seat"] == "long"][-1]
    assert ev["prefill_forwards"] > -(-(len(long_prompt) - 1) // CHUNK), ev
    short = [e for e in paced.events() if e["event"] == "request.done" and e["seat"] == "short"][-1]
    assert short["prefill_forwards"] == 1, short  # cut into smaller pieces while others decoded
    # The same prompt on a daemon that prefills whole chunks (decode_gap_bound = 0): the
    # same tokens.
    ref_ids, ref_done = _generate(whole_chunks.endpoint, "long", long_prompt, max_tokens=12)
    assert ref_done.usage.cached_tokens == 0 and ids == ref_ids
    ref = [e for e in whole_chunks.events() if e["event"] == "request.done" and e["seat"] == "long"][-1]
    assert ref["prefill_forwards"] == -(-(len(long_prompt) - 1) // CHUNK)


def test_auto_prefill_together_follows_what_start_up_measured(paced):
    """prefill_together = "auto" (the default): start-up times a forward of max_active rows
    against one row's and turns sharing on only where it pays (batched_prefill.together_pays)."""
    from daemon.engine.batched_prefill import together_pays

    ready = [e for e in paced.events() if e["event"] == "prefill_together.ready"][-1]
    assert ready["mode"] == "auto" and ready["rows"] == 4 and ready["cost_ratio"] > 0, ready
    assert ready["enabled"] == together_pays(ready["cost_ratio"], 4), ready
    with Client(paced.endpoint, seat="status") as c:
        together = c.status().detail["step"]["together"]
    assert together["enabled"] == ready["enabled"], together
