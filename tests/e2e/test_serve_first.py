"""Serve first, improve after (daemon/engine_thread/warming.py), through a real daemon.

A daemon with an empty cache folder answers as soon as its model is loaded, while its
start-up checks (the compiled step, the exactness and cost probes, the warm-up) still run
between requests. These tests hold it to its promises: exact requests served during that
time give a fully warmed daemon's tokens; the parts it switches in are the ones a start that
waited chose (the same verdicts, read back from the same verdicts file); a check that fails
leaves its path out and says why; a stop mid-way ends every accepted request once.
"""

from __future__ import annotations

import signal
import time
from collections import Counter

from e2e_harness import start_daemon
from protocol.client import Client

from daemon.paths import BUNDLED_MODEL

# A small chunk keeps the chunk-split probe cheap (it prefills 2 * chunk + 9 tokens 3 times)
# and prefill_lengths' 31 forwards and prefill_depths' 16 chunks ("auto" leaves those parts to
# GPUs; "on" runs them here).
CONFIG = "warm_prefill_lengths = \"on\"\nwarm_prefill_depths = \"on\"\n[scheduler]\nprefill_chunk = 32\nmax_active = 4\n"
PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main(argv):\n", "class Council:\n    def __init__(self):\n",
           "for i in range(10):\n"]
PARTS = ("compiled_step", "verify", "splits", "batch", "prefill_together", "mixed_steps", "warmup", "prefill_depths",
         "prefill_lengths")


def _pending(c: Client) -> list[str]:
    return list(c.status().detail["warming"].get("pending") or ())


def _round(c: Client, speculation: str) -> list[list[int]]:
    """The four prompts at once (so a warmed daemon batches them), greedy, 12 tokens each."""
    streams = [c.generate(p, max_tokens=12, speculation=speculation, temperature=0.0) for p in PROMPTS]
    for s in streams:
        s.result()
    return [list(s.token_ids) for s in streams]


def _warm_events(d) -> dict[str, dict]:
    return {e["part"]: e for e in d.events() if e["event"] == "engine.warm"}


def test_exact_requests_during_warm_up_match_a_slow_start_which_reads_the_same_verdicts(tmp_path):
    cache = {"COUNCILD_CACHE_DIR": str(tmp_path / "cache")}  # empty: every check runs
    (tmp_path / "fast").mkdir()
    d = start_daemon(tmp_path / "fast", BUNDLED_MODEL, env=cache, config=CONFIG, warmed=False)
    during: list[tuple[str, list[list[int]]]] = []
    try:
        with Client(d.endpoint, seat="early", timeout_s=120) as c:
            assert _pending(c), "the start-up checks ran before ready"
            assert c.status().detail["decode_path"].startswith("eager")  # the safe path first
            while _pending(c) and len(during) < 8:
                for mode in ("exact", "off"):
                    during.append((mode, _round(c, mode)))
            deadline = time.monotonic() + 120
            while _pending(c) and time.monotonic() < deadline:  # prefill_lengths runs only at idle
                time.sleep(0.2)
            warm = c.status().detail["warming"]
            assert warm["pending"] == [] and set(warm["parts"]) == set(PARTS)
            assert c.status().detail["decode_path"] == "compiled"
    finally:
        assert d.stop() == 0
    assert len(during) >= 2  # rounds were served while the checks ran
    fast = _warm_events(d)
    assert set(fast) == set(PARTS)
    assert all(e["longest_piece_ms"] < 5000 for e in fast.values())  # pieces, not one block
    # 1..31 but light's 16: a count a piece (and the empty one before the first)
    assert fast["prefill_lengths"]["lengths"] == 31 and fast["prefill_lengths"]["pieces"] == 32
    # one prompt 16 chunks deep, a chunk a piece (and the empty one before the first)
    assert fast["prefill_depths"]["tokens"] == 16 * 32 and fast["prefill_depths"]["pieces"] == 17
    assert {p: e.get("verdict") for p, e in fast.items() if "verdict" in e} == \
        {p: "probed" for p, e in fast.items() if "verdict" in e}

    # A start that waits for every check before ready, on the same cache folder: each verdict
    # is read back (the same key: the same decode path, kernels, engine) and switches in alike.
    (tmp_path / "slow").mkdir()
    slow = start_daemon(tmp_path / "slow", BUNDLED_MODEL, env=cache, config="warm_in_background = false\n" + CONFIG)
    try:
        with Client(slow.endpoint, seat="late", timeout_s=120) as c:
            assert _pending(c) == []
            want = {mode: _round(c, mode) for mode in ("exact", "off")}
    finally:
        assert slow.stop() == 0
    names = [e["event"] for e in slow.events()]
    assert names.index("engine.warmed") < names.index("daemon.start")  # all of it before ready
    late = _warm_events(slow)
    # A slow start checks the compiled step as it loads (its self-check's verdict read back).
    (loaded,) = [e for e in slow.events() if e["event"] == "model.loaded"]
    assert fast["compiled_step"]["switched_in"] is True and loaded["decode_path"] == "compiled"
    assert loaded["compile_check"] == "cached" and loaded["batch_compile_check"] == "cached"
    assert {p: e["switched_in"] for p, e in late.items()} == \
        {p: e["switched_in"] for p, e in fast.items() if p != "compiled_step"}
    assert all(e["verdict"] == "cached" for e in late.values() if "verdict" in e)
    for mode, got in during:
        assert got == want[mode], f"{mode} request served during warm-up differs from the warmed daemon's"


def test_a_check_that_fails_leaves_its_path_out_and_says_why(tmp_path):
    d = start_daemon(tmp_path, BUNDLED_MODEL, config='debug_fail_warm = ["compiled_step", "batch"]\n' + CONFIG)
    try:
        with Client(d.endpoint, seat="s", timeout_s=120) as c:
            detail = c.status().detail
            parts = detail["warming"]["parts"]
            assert parts["compiled_step"]["switched_in"] is False and parts["batch"]["switched_in"] is False
            assert parts["verify"]["switched_in"] is True
            assert detail["decode_path"] == "eager: check forced to fail (debug_fail_warm): the path stays out"
            got = _round(c, "exact")  # exact rows still exact: alone and eager
    finally:
        assert d.stop() == 0
    ev = _warm_events(d)
    for part in ("compiled_step", "batch"):
        assert ev[part]["switched_in"] is False and "debug_fail_warm" in ev[part]["reason"]
    assert not [e for e in d.events() if e["event"] == "batch.ready"]  # its verdict was not applied
    (done,) = [e for e in d.events() if e["event"] == "engine.warmed"]
    assert set(done["left_out"]) >= {"compiled_step", "batch"}
    assert all(len(t) == 12 for t in got)


def test_a_stop_during_warm_up_exits_cleanly_and_ends_every_request_once(tmp_path):
    cache = {"COUNCILD_CACHE_DIR": str(tmp_path / "cache")}  # empty: the checks take seconds
    d = start_daemon(tmp_path, BUNDLED_MODEL, env=cache, config=CONFIG, warmed=False)
    with Client(d.endpoint, seat="s", timeout_s=120) as c:
        assert _pending(c)
        streams = [c.generate(p, max_tokens=40, speculation="exact") for p in PROMPTS]
        time.sleep(0.3)
        d.proc.send_signal(signal.SIGTERM)
        outcomes = []
        for s in streams:
            try:
                outcomes.append(s.result().finish_reason)
            except Exception as exc:  # noqa: BLE001 - an Error terminal (shutting_down) is an answer too
                outcomes.append(type(exc).__name__)
    assert d.proc.wait(timeout=60) == 0
    assert len(outcomes) == len(PROMPTS)
    events = d.events()
    terminals = Counter(e["request_id"] for e in events if e["event"] in ("request.done", "request.error"))
    accepted = {e["request_id"] for e in events if e["event"] == "request.accepted"}
    assert accepted and all(terminals[r] == 1 for r in accepted)
    names = [e["event"] for e in events]
    assert "daemon.stop" in names and "engine.crashed" not in names
    assert "engine.warmed" not in names  # the stop came mid-way


def test_a_prompt_served_before_the_verify_verdict_leaves_snapshots_that_speculating_requests_resume(tmp_path):
    """An exact request that starts before the verify verdict decodes serially, but its prompt's
    snapshots and its continuation still carry the head's history, so a speculating exact
    request after the verdict (a council's second turn) resumes from them instead of
    prefilling its whole prompt, or its seat's last reply, again."""
    cache = {"COUNCILD_CACHE_DIR": str(tmp_path / "cache")}  # empty: every check runs
    d = start_daemon(tmp_path, BUNDLED_MODEL, env=cache, config=CONFIG, warmed=False)
    shared = "".join(f"line {i}: the council weighs the motion, seat by seat.\n" for i in range(24))
    try:
        with Client(d.endpoint, seat="first", timeout_s=120) as c:
            # session "keep": its continuation is stored whether or not the split verdict is in.
            first = c.generate(shared + "Seat one:", max_tokens=4, speculation="exact", temperature=0.0,
                               session="keep")
            first.result()
            while _pending(c):
                time.sleep(0.2)
            second = c.generate(shared + "Seat two, in turn:", max_tokens=4, speculation="exact", temperature=0.0)
            second.result()
    finally:
        assert d.stop() == 0
    events = d.events()
    names = [(e["event"], e.get("part")) for e in events]
    done = [e for e in events if e["event"] == "request.done"]
    assert len(done) == 2
    # The premise: the first request was accepted before the verify verdict, so it decoded
    # serially; or, where the verdict came during its prefill, as the exact request it is
    # (decode_paths.begin_decode looks again), from the history its prefill primed.
    assert names.index(("request.accepted", None)) < names.index(("engine.warm", "verify"))
    assert done[0]["speculation"] is None or done[0]["speculation"]["mode"] == "exact"
    assert done[1]["speculation"] is not None and done[1]["speculation"]["mode"] == "exact"
    assert done[1]["cached_tokens"] >= 32 * 8, done[1]  # resumed from the first prompt's snapshots
    # Its serial decode kept the head's history too: the continuation a next turn of the same
    # seat resumes from carries it (a speculating request takes no snapshot without it).
    (kept,) = [e for e in events if e["event"] == "prefix_cache.continuation"
               and e["request_id"] == done[0]["request_id"]]
    # Serial decode's cache holds every token it decoded; a speculative cycle's holds what its
    # forwards took in, so the last token (the verify's own, not yet forwarded) may be left out:
    # a continuation is the prefix the cache holds (prefix_cache_use.keep_continuation). Which
    # branch runs depends on how soon the verify verdict comes (since 2026-12-07 the compiled
    # step's checks run on the layer-kinds view, so here it often comes during the prefill).
    full = done[0]["prompt_tokens"] + done[0]["completion_tokens"]
    assert done[0]["completion_tokens"] == 4 and kept["head"] is True
    assert kept["tokens"] == full if done[0]["speculation"] is None else full - 1 <= kept["tokens"] <= full


def test_a_turn_before_the_splits_verdict_leaves_a_continuation_the_verdict_makes_exact(tmp_path):
    """A fresh council's first turn comes before the chunk-split verdict: its continuation is
    kept pending, and when the verdict says splits are exact (this CPU) it is promoted, so the
    seat's next exact turn resumes at its exact end (not a grid point up to a chunk before it)
    and gives the tokens a cold prefill gives (a daemon with no prefix cache to resume from)."""
    cache = {"COUNCILD_CACHE_DIR": str(tmp_path / "cache")}  # empty: every check runs
    first = [(7 * i) % 3000 + 5 for i in range(75)]  # two 32-token chunks and then some
    more = [(11 * i) % 3000 + 5 for i in range(20)]
    (tmp_path / "fresh").mkdir()
    d = start_daemon(tmp_path / "fresh", BUNDLED_MODEL, env=cache, config=CONFIG, warmed=False)
    try:
        with Client(d.endpoint, seat="s", timeout_s=120) as c:
            one = c.generate(prompt_tokens=first, max_tokens=6, speculation="exact", temperature=0.0)
            one.result()
            waiting = c.status().detail["prefix_cache"]
            while _pending(c):
                time.sleep(0.2)
            after = c.status().detail["prefix_cache"]
            two = c.generate(prompt_tokens=first + list(one.token_ids) + more, max_tokens=8, speculation="exact",
                             temperature=0.0)
            two.result()
    finally:
        assert d.stop() == 0
    events = d.events()
    names = [(e["event"], e.get("part")) for e in events]
    # The premise: the first turn ended before the splits verdict (it comes after the compiled
    # step's, verify's and batch's checks, seconds after ready here).
    assert names.index(("request.done", None)) < names.index(("engine.warm", "splits")), names
    assert waiting["splits_pending"] and waiting["pending"] >= 1, waiting
    (ready,) = [e for e in events if e["event"] == "prefix_cache.ready"]
    assert ready["splits_exact"] and ready["promoted"] == ready["pending_snapshots"] >= 1
    assert after["pending"] == 0 and after["promoted"] == ready["promoted"] and not after["splits_pending"]
    done = [e for e in events if e["event"] == "request.done"]
    held = len(first) + len(one.token_ids) - 1  # the decoder's cache holds all but its last token
    assert done[1]["cached_tokens"] >= held > 64, done[1]  # its exact end, past the grid point (64)

    (tmp_path / "cold").mkdir()
    cold = start_daemon(tmp_path / "cold", BUNDLED_MODEL, env=cache, config=CONFIG + "[prefix_cache]\nenabled = false\n")
    try:
        with Client(cold.endpoint, seat="s", timeout_s=120) as c:
            ref = c.generate(prompt_tokens=first + list(one.token_ids) + more, max_tokens=8, speculation="exact",
                             temperature=0.0)
            ref.result()
    finally:
        assert cold.stop() == 0
    assert list(ref.token_ids) == list(two.token_ids)


def test_a_splits_probe_that_fails_leaves_pending_snapshots_inexact(tmp_path):
    """The chunk-split check forced to fail in the background: the cache stops waiting
    (nothing pending), nothing is promoted, snapshots off the grid stay inexact, and the
    event says the verdict failed."""
    cache = {"COUNCILD_CACHE_DIR": str(tmp_path / "cache")}
    d = start_daemon(tmp_path, BUNDLED_MODEL, env=cache, config='debug_fail_warm = ["splits"]\n' + CONFIG,
                     warmed=False)
    try:
        with Client(d.endpoint, seat="s", timeout_s=120) as c:
            c.generate(prompt_tokens=[(7 * i) % 3000 + 5 for i in range(75)], max_tokens=6, speculation="exact",
                       temperature=0.0).result()
            while _pending(c):
                time.sleep(0.2)
            pc = c.status().detail["prefix_cache"]
    finally:
        assert d.stop() == 0
    assert not pc["splits_pending"] and not pc["splits_exact"] and pc["pending"] == 0 and pc["promoted"] == 0, pc
    assert "chunk grid" in pc["exact_reuse"] and "until" not in pc["exact_reuse"]
    (ready,) = [e for e in d.events() if e["event"] == "prefix_cache.ready"]
    assert ready["verdict"] == "failed" and not ready["splits_exact"] and ready["promoted"] == 0
    assert _warm_events(d)["splits"]["switched_in"] is False
