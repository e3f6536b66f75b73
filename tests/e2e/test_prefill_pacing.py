"""The prefill pacer against a real daemon: while other streams decode, a long prompt is
prefilled in pieces sized to keep their gaps within ``decode_gap_bound`` quiet iterations
(a prompt of one chunk or less runs whole)
(engine_thread/prefill_pacer.py), and its tokens are what whole chunks give (exact, greedy:
this CPU's off-grid splits are bit-identical, the prefix cache's split probe says so)."""

from __future__ import annotations

import random
import threading
import time

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


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, e2e_model):
    """Pieces ride in the batch's decode forwards (forced on: start-up's timing leaves them
    off on this CPU); depth 0, so every batch cycle is a forward that may carry one."""
    d = start_daemon(tmp_path_factory.mktemp("mixed"), e2e_model,
                     config=CONFIG.replace("[scheduler]", '[scheduler]\nmixed_steps = "on"')
                     .replace('mode = "exact"', 'mode = "exact"\ndepth = 0'))
    yield d
    assert d.stop() == 0


class Streamers:
    """Streams decoding until told to stop (then cancelled): they decode for as long as the
    test's long prompt takes, however slow the box (streams of a fixed length could end first
    and leave nothing to pace beside)."""

    def __init__(self, endpoint: str, n: int):
        self.stop, self.started = threading.Event(), threading.Event()
        self.results: dict = {}
        self.prompts = {f"streamer-{i}": _tokens(20, i) for i in range(n)}
        self.threads = [threading.Thread(target=self._stream, args=(endpoint, seat)) for seat in self.prompts]
        for t in self.threads:
            t.start()

    def _stream(self, endpoint: str, seat: str) -> None:
        with Client(endpoint, seat=seat, timeout_s=300) as c:
            s = c.generate(prompt_tokens=self.prompts[seat], max_tokens=2000)
            for i, _ in enumerate(s):
                if i == 3:
                    self.started.set()
                if self.stop.is_set():
                    s.cancel()
            self.results[seat] = (s.result(), list(s.token_ids))

    def finish(self) -> dict:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=300)
        # Cancelled, so they decoded all along.
        assert all(done.finish_reason == "cancelled" for done, _ in self.results.values()), self.results
        return self.results


@pytest.mark.quick
def test_a_long_prompt_is_paced_beside_decoding_streams_and_decodes_what_it_would_alone(paced, whole_chunks):
    long_prompt = _tokens(700, seed=11)
    streamers = Streamers(paced.endpoint, 2)
    assert streamers.started.wait(120)
    # A prompt of less than a chunk runs whole beside them (a turn's first token first).
    _generate(paced.endpoint, "short", _tokens(100, seed=12), max_tokens=2)
    ids, done = _generate(paced.endpoint, "long", long_prompt, max_tokens=12)
    streamers.finish()
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


def test_pieces_ride_in_decode_forwards_and_every_stream_decodes_what_it_would_alone(mixed, whole_chunks):
    """scheduler.mixed_steps = "on": the long prompt's paced pieces go through the batch's
    decode forwards (status counts them), and both the prompt's tokens and the streamers'
    (exact, greedy) are the whole-chunk daemon's."""
    long_prompt = _tokens(600, seed=21)
    streamers = Streamers(mixed.endpoint, 2)
    assert streamers.started.wait(120)
    ids, _ = _generate(mixed.endpoint, "long", long_prompt, max_tokens=12)
    results = streamers.finish()
    with Client(mixed.endpoint, seat="status") as c:
        step = c.status().detail["step"]
    assert step["mixed"]["enabled"] and step["mixed"]["exact_rows"], step["mixed"]
    assert step["mixed"]["forwards"] > 0 and 0 < step["mixed"]["tokens"] <= len(long_prompt), step["mixed"]
    ready = [e for e in mixed.events() if e["event"] == "mixed_steps.ready"][-1]
    assert ready["mode"] == "on" and ready["enabled"] and ready["cost_ratio"] is None, ready
    ref_ids, _ = _generate(whole_chunks.endpoint, "long", long_prompt, max_tokens=12)
    assert ids == ref_ids
    for seat, (_, got) in results.items():
        want, _ = _generate(whole_chunks.endpoint, seat, streamers.prompts[seat], max_tokens=len(got))
        assert got == want, seat


def test_auto_prefill_together_follows_what_start_up_measured(paced):
    """prefill_together = "auto" (the default): start-up times a forward of the rows the row
    limit starts at (scheduler.start_height: 4 with max_active = "auto", the default) against
    one row's and turns sharing on only where it pays (batched_prefill.together_pays); its
    exactness covers the batch's rows (batch_rows: the ceiling, 8)."""
    from daemon.engine.prefill.batched_prefill import together_pays

    ready = [e for e in paced.events() if e["event"] == "prefill_together.ready"][-1]
    assert ready["mode"] == "auto" and ready["rows"] == 8 and ready["cost_rows"] == 4 and ready["cost_ratio"] > 0, ready
    assert ready["enabled"] == together_pays(ready["cost_ratio"], 4), ready
    # The status snapshot is the engine thread's, published between its steps: it may trail the
    # event by a refresh (seen under load, with the probe's ratio saying "pays").
    deadline = time.monotonic() + 10
    with Client(paced.endpoint, seat="status") as c:
        together = c.status().detail["step"]["together"]
        while together["enabled"] != ready["enabled"] and time.monotonic() < deadline:
            time.sleep(0.1)
            together = c.status().detail["step"]["together"]
    assert together["enabled"] == ready["enabled"], together
