"""The engine step against a real daemon: the warm-up runs its stages before the
daemon answers, and a prefix-cache hit is prefilled ahead of a long cold prompt of its class
(its remainder fits one chunk, so it goes first in the prefill phase)."""

from __future__ import annotations

import random
import threading
import time

import pytest
from e2e_harness import start_daemon

from protocol.client import Client

CHUNK = 32
CONFIG = f"""
heartbeat_interval_s = 0.5
warmup = "light"
[scheduler]
prefill_chunk = {CHUNK}
# One chunk per iteration: the order of the chunks is all that decides who finishes first.
step_token_budget = 1
[prefix_cache]
enabled = true
"""


@pytest.fixture(scope="module")
def step_daemon(tmp_path_factory, e2e_model):
    d = start_daemon(tmp_path_factory.mktemp("step"), e2e_model, config=CONFIG)
    yield d
    assert d.stop() == 0


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 500) for _ in range(n)]


def test_warmup_logs_its_stages_after_the_daemon_answers(step_daemon):
    events = step_daemon.events()
    names = [e["event"] for e in events]
    for stage in ("warmup.prefill", "warmup.decode", "warmup.batch", "warmup.done"):
        assert stage in names, names
    # Serve first: the warm-up runs after ready, between requests, a start-up part
    # (engine_thread/warming.py), after the engine's one step before ready. (Not ordered against
    # daemon.start: the socket loop logs that on its own thread, racing the engine's first part.)
    assert min(i for i, n in enumerate(names) if n.startswith("warmup.")) > names.index("engine.first_step")
    # After the start-up probes it warms up.
    assert names.index("batch.ready") < names.index("warmup.prefill")
    (part,) = [e for e in events if e["event"] == "engine.warm" and e["part"] == "warmup"]
    assert part["switched_in"] is True and names.index("engine.warmed") > names.index("warmup.done")
    done = next(e for e in events if e["event"] == "warmup.done")
    assert done["mode"] == "light" and set(done["stages"]) >= {"prefill", "decode", "batch"}
    prefill = next(e for e in events if e["event"] == "warmup.prefill")
    assert prefill["seconds"] >= 0 and prefill["tokens"] == [16]
    with Client(step_daemon.endpoint, seat="status") as c:
        detail = c.status().detail
    assert detail["warmup"]["mode"] == "light" and detail["warmup"]["stages"] == done["stages"]
    assert detail["step"]["budget"] == 1


def test_a_hit_is_served_ahead_of_a_cold_long_prefill(step_daemon):
    shared = tokens(200, seed=7)
    with Client(step_daemon.endpoint, seat="warm", timeout_s=120) as c:
        c.generate(prompt_tokens=shared, max_tokens=2, speculation="off").result()  # stores a snapshot at 192

    first_cold: dict[str, float] = {}
    cold_started = threading.Event()

    def cold() -> None:
        with Client(step_daemon.endpoint, seat="cold", timeout_s=300) as c:
            s = c.generate(prompt_tokens=tokens(3000, seed=8), max_tokens=2, speculation="off")
            cold_started.set()
            for _ in s:
                first_cold.setdefault("t", time.monotonic())
            first_cold["done"] = s.result()

    th = threading.Thread(target=cold)
    th.start()
    try:
        with Client(step_daemon.endpoint, seat="hit", timeout_s=120) as c:
            assert cold_started.wait(60)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # the cold prompt is being prefilled
                queue = c.status().detail["step"].get("prefill_queue", [])
                if any(q["seat"] == "cold" for q in queue):
                    break
                time.sleep(0.02)
            else:
                pytest.fail("the cold prompt never showed in the prefill queue")
            s = c.generate(prompt_tokens=shared + tokens(10, seed=9), max_tokens=4, speculation="off")
            done = s.result()
            hit_done_at = time.monotonic()
            # While the cold prompt is still prefilling (it has ~90 chunks to go, one an
            # iteration): the hit's 17-token tail went first, not after the cold prompt.
            queue = c.status().detail["step"]["prefill_queue"]
    finally:
        th.join(300)
    # At least the chunk-aligned snapshot (192); the prefix cache may hold the warm prompt's end too.
    assert 192 <= done.usage.cached_tokens < 200 and done.usage.completion_tokens == 4
    assert "t" in first_cold and first_cold["t"] > hit_done_at
    assert [q["seat"] for q in queue] == ["cold"] and queue[0]["left"] > 0
    assert first_cold["done"].usage.cached_tokens == 0
