"""A two-rank tensor-parallel daemon on the bundled model (ring backend over loopback)
serves what the single-process daemon serves at temperature 0: token for token except where
the single process's top two logits are within a near-tie (a row-parallel layer sums its
ranks' partial products, another rounding than one full product: at a 1-ulp tie the argmax
may flip, as between any two numerics), and its exact speculation is its own serial decode,
token for token."""

from __future__ import annotations

import time

import pytest

from daemon.paths import BUNDLED_MODEL
from protocol.client import Client

from group_harness import start_group

PROMPTS = ["def fibonacci(n):\n", "The council met at dawn to decide"]
TOKENS = 24
# Longer than one exchange's slot (4 KiB) once tokenized: its request (the client's message
# with the text, ~2,000 bytes, and the prompt's ~900 token ids) crosses in the overflow round.
LONG = "".join(f"def step_{i}(x):\n    return x + {i}\n\n" for i in range(60))


def _tokens(c: Client, prompt: str, **kw) -> tuple[list[int], object]:
    stream = c.generate(prompt, max_tokens=TOKENS, **kw)
    text = "".join(stream)
    assert text == stream.done.text
    return list(stream.token_ids), stream.done


# Two bf16 ulps of a logit near 10: a top-2 margin this small is a near-tie.
NEAR_TIE = 0.13


@pytest.fixture(scope="module")
def single(_bundled_daemon_session) -> dict[str, tuple[list[int], list[float]]]:
    """Serial greedy tokens from the single-process daemon (the session's shared one on the
    bundled model, tests/conftest.py) and, per token, the margin between its top two
    log-probabilities (= the logits' margin)."""
    out = {}
    with Client(_bundled_daemon_session.endpoint, seat="group-ref", timeout_s=60) as c:
        for p in PROMPTS + [LONG]:
            done = c.complete(p, max_tokens=TOKENS, speculation="off", logprobs=True, top_logprobs=2)
            margins = [t.top_logprobs[0].logprob - t.top_logprobs[1].logprob for t in done.logprobs]
            out[p] = ([t.token_id for t in done.logprobs], margins)
    return out


@pytest.fixture(scope="module")
def reference(group, single) -> dict[str, list[int]]:
    """The group's own serial greedy tokens: what its exact speculation must reproduce. They
    are the single process's up to the first near-tie, where a flip is allowed."""
    with Client(group.endpoint, seat="group-ref", timeout_s=60) as c:
        ref = {p: _tokens(c, p, speculation="off")[0] for p in PROMPTS + [LONG]}
    for p, tokens in ref.items():
        want, margins = single[p]
        i = next((i for i, (a, b) in enumerate(zip(tokens, want)) if a != b), None)
        assert i is None or margins[i] <= NEAR_TIE, (p, i, margins[i] if i is not None else None)
    return ref


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    g = start_group(tmp_path_factory.mktemp("group"), BUNDLED_MODEL, 2)
    yield g
    codes = g.stop()
    assert codes == [0, 0], (codes, g.tail(0), g.tail(1))
    assert any(e["event"] == "group.stopped" for e in g.events(1)), g.tail(1)


def test_greedy_output_is_the_single_process_output_up_to_a_near_tie_and_exact_mode_is_its_own_serial(group, reference):
    with Client(group.endpoint, seat="fidelity", timeout_s=60) as c:
        status = c.status().detail
        assert status["exact_decode"] == "speculate"  # the exactness probe ran across the group
        for p in PROMPTS:
            assert _tokens(c, p, speculation="off")[0] == reference[p], p
        for depth in (1, 2):
            assert c.governor("pin_depth", depth).ok
            for p in PROMPTS:
                tokens, done = _tokens(c, p, speculation="exact")
                assert tokens == reference[p], (depth, p)
                assert done.speculation.mode == "exact" and done.speculation.drafted > 0
        assert c.governor("auto").ok


def test_sampled_and_concurrent_requests_keep_the_ranks_in_lockstep(group, reference):
    """Sampling without a seed, batched rows and a cancel: rank 0 checks every rank's token
    digest at each exchange and would exit (group.diverged) on any difference."""
    with Client(group.endpoint, seat="mix", timeout_s=60) as c:
        streams = [c.generate(p, max_tokens=TOKENS, temperature=0.9, speculation=s)
                   for p in PROMPTS for s in ("off", "fast")]
        cut = c.generate(PROMPTS[0], max_tokens=400, temperature=0.7)
        next(iter(cut))
        cut.cancel()
        for s in streams:
            "".join(s)
            assert s.done.usage.completion_tokens > 0
        assert _tokens(c, PROMPTS[1], speculation="exact")[0] == reference[PROMPTS[1]]
        detail = c.status().detail
    g = detail["group"]
    assert g["size"] == 2 and g["backend"] == "ring"
    assert [r["rank"] for r in g["ranks"]] == [0, 1]
    assert all(r["memory"]["active_bytes"] > 0 and r["host"] for r in g["ranks"])
    assert group.procs[0].poll() is None and group.procs[1].poll() is None


def test_a_head_eviction_and_reload_happen_on_every_rank(group, reference):
    with Client(group.endpoint, seat="ops", timeout_s=60) as c:
        assert c.governor("evict_head").ok
        assert not c.status().detail["head_resident"]
        # The follower applies the eviction at the next exchange; a request then runs serially on both.
        assert _tokens(c, PROMPTS[0], speculation="exact")[0] == reference[PROMPTS[0]]
        evicted = [e for e in group.events(1) if e["event"] == "head.evicted"]
        assert evicted and evicted[-1]["reason"] == "rank 0 evicted it", group.tail(1)
        assert c.governor("pin_depth", 1).ok  # loads the head (on a loader thread on rank 0)
        deadline = time.monotonic() + 60
        while not c.status().detail["head_resident"]:
            assert time.monotonic() < deadline, "the head did not come back"
            time.sleep(0.2)
        tokens, done = _tokens(c, PROMPTS[0], speculation="exact")
        assert tokens == reference[PROMPTS[0]] and done.speculation.drafted > 0
        loaded = [e for e in group.events(1) if e["event"] == "head.loaded"]
        assert loaded and loaded[-1]["reason"] == "rank 0 loaded it", group.tail(1)
        assert c.governor("auto").ok


def test_a_prompt_larger_than_an_exchange_slot_crosses_in_the_overflow_round(group, reference):
    with Client(group.endpoint, seat="long", timeout_s=120) as c:
        before = c.status().detail["group"]["overflow_exchanges"]
        tokens, done = _tokens(c, LONG, speculation="exact")
        assert done.usage.prompt_tokens > 800
        assert tokens == reference[LONG]
        deadline = time.monotonic() + 10  # rank 0 republishes its status at its own pace
        while c.status().detail["group"]["overflow_exchanges"] <= before:
            assert time.monotonic() < deadline, "no overflow round counted"
            time.sleep(0.1)


def test_every_rank_warms_up_at_rank_0s_mode_after_the_hello(group, reference):
    """The warm-up's forwards run on every rank (their collectives must line up): the ranks
    log the same stages at rank 0's resolved mode, after the group formed."""
    ranks = [[e for e in group.events(r) if e["event"].startswith(("warmup.", "group."))] for r in (0, 1)]
    done = [next(e for e in evs if e["event"] == "warmup.done") for evs in ranks]
    assert done[0]["mode"] == done[1]["mode"] == "light"  # auto on a CPU
    assert set(done[0]["stages"]) == set(done[1]["stages"]) >= {"prefill", "decode", "speculate", "batch"}
    names0, names1 = ([e["event"] for e in evs] for evs in ranks)
    assert names0.index("warmup.done") < names0.index("group.ready")  # before serving
    assert names1.index("warmup.done") < names1.index("group.following")
