"""Speculation inside the continuous batch, through a real daemon on the bundled model: a
council's concurrent greedy exact requests decode as rows of one batch and still speculate,
each producing the tokens of the same prompt decoded alone."""

from __future__ import annotations

import pytest
from e2e_harness import start_daemon

from daemon.paths import BUNDLED_MODEL
from protocol.client import Client

PROMPTS = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n", "import os\n\n\ndef walk(path):\n",
           "# sort a list\ndef quicksort(items):\n"]
TOKENS = 40


@pytest.fixture
def council_daemon(bundled_daemon):
    """The session's daemon on the bundled model with the default configuration (conftest.py):
    these tests need nothing else, and its per-test check leaves no pinned depth or live
    request behind. Events are picked out by request id, as other tests share its log."""
    return bundled_daemon


@pytest.mark.quick
def test_four_concurrent_exact_requests_batch_and_speculate(council_daemon):
    d = council_daemon
    with Client(d.endpoint, seat="council", timeout_s=120) as c:
        alone = {p: c.complete(p, max_tokens=TOKENS, speculation="off").text for p in PROMPTS}
        assert c.governor("pin_depth", 2).ok
        streams = [c.generate(p, max_tokens=TOKENS, speculation="exact") for p in PROMPTS]
        dones = [s.result() for s in streams]
        assert c.governor("auto").ok
    for p, done in zip(PROMPTS, dones):
        assert done.text == alone[p], p
        sp = done.speculation
        assert sp is not None and sp.mode == "exact" and sp.drafted > 0 and sp.accepted > 0, sp
        assert sp.drafted == sum(sp.drafted_by_position) and sp.accepted == sum(sp.accepted_by_position), sp
    ids = {s.request_id for s in streams}
    ended = {e["request_id"]: e for e in d.events() if e.get("event") == "request.done" and e["request_id"] in ids}
    assert len(ended) == 4
    # They decoded as rows of the batch (a request that began alone moved in: batch.joined).
    assert all(e["batched"] for e in ended.values()), ended
    assert all(e["speculation"]["drafted"] > 0 for e in ended.values())
    ready = [e for e in d.events() if e.get("event") == "batch.ready"]
    assert ready and ready[0]["speculates"] and ready[0]["exact_rows_batch"]
    # The batched steps and verifies ran through the compiled forward (its self-check passed).
    assert ready[0]["batch_decode_path"] == "compiled"
    with Client(d.endpoint, seat="council", timeout_s=30) as c:
        assert c.status().detail["batch_decode_path"] == "compiled"


def test_a_running_solo_request_moves_into_the_batch_when_another_arrives(council_daemon):
    d = council_daemon
    long_prompt, other = PROMPTS[0], PROMPTS[1]
    with Client(d.endpoint, seat="council", timeout_s=120) as c:
        alone = c.complete(long_prompt, max_tokens=160, speculation="off").text
        assert c.governor("pin_depth", 2).ok
        first = c.generate(long_prompt, max_tokens=160, speculation="exact")
        it = iter(first)
        next(it)  # it is decoding, alone (solo speculation)
        second = c.generate(other, max_tokens=TOKENS, speculation="exact")
        done1, done2 = first.result(), second.result()
        assert c.governor("auto").ok
    assert done1.text == alone and done1.speculation.drafted > 0
    assert done2.speculation.drafted > 0
    joined = [e for e in d.events() if e.get("event") == "batch.joined" and e["request_id"] == first.request_id]
    assert len(joined) == 1 and 0 < joined[0]["completion_tokens"] < 160, joined


def test_concurrent_requests_at_depth_zero_batch_and_stay_serial(council_daemon):
    """Depth pinned to 0 (the governor's call under load): concurrent exact requests decode
    as rows of the speculating batch at depth 0, whose cycles are queued ahead of the host's
    read (batch_spec._step_ahead) and undone as rows join and leave; each request's text is
    still the one it decodes alone."""
    d = council_daemon
    with Client(d.endpoint, seat="council", timeout_s=120) as c:
        alone = {p: c.complete(p, max_tokens=TOKENS, speculation="off").text for p in PROMPTS}
        assert c.governor("pin_depth", 0).ok
        try:
            streams = [c.generate(p, max_tokens=TOKENS + 8 * i, speculation="exact") for i, p in enumerate(PROMPTS)]
            dones = [s.result() for s in streams]
            cycles = c.status().detail["step"]["batch_cycles"]
        finally:
            assert c.governor("auto").ok
    for p, done in zip(PROMPTS, dones):
        assert done.text.startswith(alone[p]), p  # rows leave at different times: max_tokens differ
        assert done.speculation is None or done.speculation.drafted == 0
    ids = {s.request_id for s in streams}
    ended = [e for e in d.events() if e.get("event") == "request.done" and e["request_id"] in ids]
    assert len(ended) == 4 and sum(e["batched"] for e in ended) >= 3, ended
    # speculation.batch_lookup is "auto" by default, which is off on the CPU (a wider verify
    # costs its positions here); requests alone still draft lookup blocks.
    assert cycles["cycles"] > 0 and cycles["lookup"] == 0, cycles


def test_drafting_cycles_built_ahead_keep_each_request_exact(tmp_path):
    """``speculation.build_ahead = true`` (what CUDA gets by default): the speculating batch
    builds each drafting cycle before the host reads the one before, and a council's
    concurrent exact requests still get the text each gets alone; the status view counts the
    cycles built ahead, and the ones undone as rows left. Raw prompts and chat messages (a
    council's usual request) alike."""
    # Prompt lookup off: these prompts' answers repeat their text, and lookup cycles (which
    # are never built ahead) would take nearly every cycle from the head's drafting.
    d = start_daemon(tmp_path, BUNDLED_MODEL, config="[speculation]\nbuild_ahead = true\nprompt_lookup = false\n")
    chats = [[{"role": "system", "content": "You write short Python."},
              {"role": "user", "content": f"Write a function that {what}."}]
             for what in ("adds two numbers", "reverses a list")]
    asks = [{"prompt": p} for p in PROMPTS] + [{"messages": m} for m in chats]
    try:
        with Client(d.endpoint, seat="council", timeout_s=120) as c:
            alone = [c.complete(**a, max_tokens=TOKENS, speculation="off").text for a in asks]
            assert c.governor("pin_depth", 2).ok
            streams = [c.generate(**a, max_tokens=TOKENS + 6 * i, speculation="exact") for i, a in enumerate(asks)]
            dones = [s.result() for s in streams]
            cycles = c.status().detail["step"]["batch_cycles"]
        for a, want, done in zip(asks, alone, dones):
            assert done.text.startswith(want), a  # rows leave at different times: max_tokens differ
            assert done.speculation.drafted > 0
        assert cycles["drafting_ahead"] > 0 and cycles["drafting_undone"] > 0, cycles
    finally:
        assert d.stop() == 0


def test_concurrent_requests_that_repeat_their_context_verify_lookup_blocks_in_the_batch(tmp_path):
    """Four concurrent exact requests whose text repeats what they hold (code a council copies),
    at depth 0 (where the governor keeps a busy batch of the bundled model): they decode as
    rows of the batch, which verifies their prompt-lookup blocks in its forwards, and each
    request's text is still the one it decodes alone. (``batch_lookup = true``: ``auto``, the
    default, leaves it to CUDA.)"""
    d = start_daemon(tmp_path, BUNDLED_MODEL, config="[speculation]\nbatch_lookup = true\n")
    asks = ["def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\ndef add(",
            "| x | y |\n| 1 | 2 |\n| 3 | 4 |\n| 1 | 2 |\n| 3 |",
            "import os\nimport sys\nimport os\nimport sys\nimport",
            "for i in range(3):\n    print(i)\nfor i in range(3):\n    print("]
    with Client(d.endpoint, seat="council", timeout_s=120) as c:
        alone = {p: c.complete(p, max_tokens=64, speculation="off").text for p in asks}
        before = c.status().detail["step"]["batch_cycles"]
        assert c.governor("pin_depth", 0).ok
        try:
            streams = [c.generate(p, max_tokens=64 + 8 * i, speculation="exact") for i, p in enumerate(asks)]
            dones = [s.result() for s in streams]
            after = c.status().detail["step"]["batch_cycles"]
        finally:
            assert c.governor("auto").ok
    for p, done in zip(asks, dones):
        assert done.text.startswith(alone[p]), p
    ids = {s.request_id for s in streams}
    ended = [e for e in d.events() if e.get("event") == "request.done" and e["request_id"] in ids]
    assert d.stop() == 0
    batched = [e for e in ended if e["batched"]]
    assert len(batched) >= 3, ended
    assert sum(e["speculation"]["lookup_accepted"] for e in batched) > 0, batched
    assert after["lookup"] > before["lookup"] and after["lookup_accepted"] > before["lookup_accepted"], (before, after)
