"""The prefix cache's disk tier and continuations against real daemons (bundled model,
exact greedy): a restarted daemon serves a seat's next turn from disk with a cold run's
tokens; corrupt, truncated and foreign files are misses that keep serving; a full or
unusable disk degrades to RAM only; a finished turn's continuation is reused past the end
of its prompt."""

from __future__ import annotations

import hashlib
import json
import struct
import time
from pathlib import Path

import pytest
from e2e_harness import start_daemon

from daemon.engine.caches import prefix_disk
from daemon.paths import BUNDLED_MODEL
from protocol.client import Client

# These tests are about a backend whose off-grid splits change the numbers (as expected on
# CUDA), where exact snapshots sit on the chunk grid only: this CPU's agree
# (engine/caches/prefix_cache.py), so debug_inexact_splits stands in for such a backend (reuse at
# any token is tests/e2e/test_prefix_cache_served.py's). Prompts just past one chunk:
# every turn is a prefill on this CPU's reference matmuls (~1.4 s for 300 tokens).
CHUNK = 128
PROMPT = 140
SNAP = (PROMPT - 1) // CHUNK * CHUNK  # the longest chunk-aligned prefix a turn-1 snapshot holds
BASE = f"""
heartbeat_interval_s = 0.5
governor_enabled = false
debug_inexact_splits = true
[speculation]
mode = "exact"
depth = 2
[scheduler]
prefill_chunk = {CHUNK}
"""


def _encode(text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(BUNDLED_MODEL / "tokenizer.json")).encode(text).ids


def _turn1(i: int) -> list[int]:
    text = "".join(f"def seat{i}_f{j}(x):\n    return x * {j} + {i}\n\n" for j in range(40))
    ids = _encode(text)[:PROMPT]
    assert len(ids) == PROMPT
    return ids


NEW = _encode("\n\nclass Council:\n    def __init__(self):\n")


def _run(endpoint: str, seat: str, prompt: list[int], speculation: str = "exact", max_tokens: int = 24):
    with Client(endpoint, seat=seat, timeout_s=180) as c:
        s = c.generate(prompt_tokens=prompt, max_tokens=max_tokens, speculation=speculation)
        done = s.result()
        return list(s.token_ids), done


def _files(tmp: Path) -> list[Path]:
    return sorted((tmp / "cache" / "prefix").glob("*/*.snap"))


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("cold"), BUNDLED_MODEL, config=BASE + "[prefix_cache]\nenabled = false\n")
    yield d
    assert d.stop() == 0


def _foreign(path: Path) -> None:
    """Rewrite a snapshot as another model's: well formed, valid checksum, other fingerprint."""
    data = path.read_bytes()
    m = len(prefix_disk.MAGIC)
    (hlen,) = struct.unpack("<Q", data[m : m + 8])
    header = json.loads(data[m + 8 : m + 8 + hlen])
    header["fingerprint"] = "0" * len(header["fingerprint"])
    h = json.dumps(header).encode()
    body = prefix_disk.MAGIC + struct.pack("<Q", len(h)) + h + data[m + 8 + hlen : -prefix_disk.DIGEST]
    path.write_bytes(body + hashlib.blake2b(body, digest_size=prefix_disk.DIGEST).digest())


def test_a_restarted_daemon_serves_good_files_from_disk_and_misses_bad_ones(tmp_path, cold):
    """One daemon writes four seats' first turns, then its restart serves them: seat-a's next
    turn from disk, with a cold run's tokens; the other three seats' files were made corrupt,
    truncated and foreign in between, and each is a miss (a cold prefill, same tokens) that
    replaces the bad file with a good one. (One pair of daemons for both: each start costs
    seconds, and the four seats' prompts share no prefix.)"""
    turn1 = _turn1(0)
    prompts = [_turn1(i) for i in (1, 2, 3)]
    d = start_daemon(tmp_path, BUNDLED_MODEL, config=BASE)
    ids1, done1 = _run(d.endpoint, "seat-a", turn1)
    assert done1.usage.cached_tokens == 0
    answers = [_run(d.endpoint, f"seat-{i}", p)[0] for i, p in enumerate(prompts)]
    assert d.stop() == 0  # SIGTERM: queued writes are flushed before the engine exits
    names = [p.name for p in _files(tmp_path)]
    assert f"{(len(turn1) - 1) // CHUNK * CHUNK}-{prefix_disk.token_digest(turn1[:SNAP])}-h-x.snap" in names

    by_digest = {p.name.split("-")[1]: p for p in _files(tmp_path)}
    victims = [by_digest[prefix_disk.token_digest(p[:SNAP])] for p in prompts]
    flipped = bytearray(victims[0].read_bytes())
    flipped[len(flipped) // 2] ^= 0x40
    victims[0].write_bytes(bytes(flipped))  # one bit, mid-payload
    victims[1].write_bytes(victims[1].read_bytes()[:-1000])  # a torn write
    _foreign(victims[2])

    turn2 = turn1 + ids1 + NEW
    d2 = start_daemon(tmp_path, BUNDLED_MODEL, config=BASE)
    try:
        ids2, done2 = _run(d2.endpoint, "seat-a", turn2)
        missed = []
        for i, (p, a) in enumerate(zip(prompts, answers)):
            bad_turn2 = p + a + NEW
            missed.append((bad_turn2, *_run(d2.endpoint, f"seat-{i}", bad_turn2)))
    finally:
        assert d2.stop() == 0
    assert done2.usage.cached_tokens == SNAP
    hits = [e for e in d2.events() if e["event"] == "prefix_cache.disk_hit"]
    assert len(hits) == 1 and hits[0]["tokens"] == SNAP and hits[0]["head"] is True
    cold_ids, cold_done = _run(cold.endpoint, "seat-a", turn2)
    assert cold_done.usage.cached_tokens == 0
    assert ids2 == cold_ids  # token-identical in exact greedy mode

    for i, (bad_turn2, ids, done) in enumerate(missed):
        assert done.usage.cached_tokens == 0
        assert ids == _run(cold.endpoint, f"seat-{i}", bad_turn2)[0]
    bad = [e for e in d2.events() if e["event"] == "prefix_cache.disk_corrupt"]
    assert len(bad) == 3
    reasons = " ".join(e["error"] for e in bad)
    assert "checksum" in reasons and "another model" in reasons
    # Each bad file was dropped; the turn's own cold prefill stored that prefix again,
    # so what is there now is a good file of this daemon's.
    for v, p in zip(victims, prompts):
        prefix_disk.decode(v.read_bytes(), v.parent.name, p[:SNAP])


@pytest.mark.parametrize("how", ["full", "unusable"])
def test_a_full_or_unusable_disk_degrades_to_ram(tmp_path, how, cold):
    if how == "full":  # no filesystem has this much free: every write is skipped
        extra = "[prefix_cache]\ndisk_min_free_bytes = 70368744177664\n"
        event = "prefix_cache.disk_full"
    else:  # a folder that cannot be made (under a regular file)
        (tmp_path / "blocker").write_text("")
        extra = f"[prefix_cache]\ndisk_dir = \"{tmp_path / 'blocker' / 'prefix'}\"\n"
        event = "prefix_cache.disk_unusable"
    turn1 = _turn1(4)
    d = start_daemon(tmp_path, BUNDLED_MODEL, config=BASE + extra)
    try:
        ids1, _ = _run(d.endpoint, "seat-a", turn1)
        turn2 = turn1 + ids1 + NEW
        ids2, done2 = _run(d.endpoint, "seat-a", turn2)
        assert done2.usage.cached_tokens == SNAP  # RAM still serves hits
        assert ids2 == _run(cold.endpoint, "seat-a", turn2)[0]
    finally:
        assert d.stop() == 0
    assert any(e["event"] == event for e in d.events())
    assert not _files(tmp_path)


@pytest.fixture(scope="module")
def inexact(tmp_path_factory):
    """A daemon with inexact_reuse, shared by both modes (each its own seat and prompt)."""
    d = start_daemon(tmp_path_factory.mktemp("inexact"), BUNDLED_MODEL,
                     config=BASE + "[prefix_cache]\ninexact_reuse = true\n")
    yield d
    assert d.stop() == 0, d.log_path.read_text()[-3000:]


@pytest.mark.parametrize("mode,prompt", [("off", 5), ("exact", 7)])
def test_a_continuation_is_reused_past_the_prompt(inexact, mode, prompt, cold):
    """inexact_reuse: the finished turn's state (prompt + answer) is kept, and the seat's
    next turn resumes after the answer. Where splits are not exact (debug_inexact_splits
    here) such a hit is not promised to be a cold run's; the tokens here still are."""
    d, seat = inexact, f"seat-{mode}"
    turn1 = _turn1(prompt)
    ids1, _ = _run(d.endpoint, seat, turn1, speculation=mode)
    cont = [e for e in d.events() if e["event"] == "prefix_cache.continuation" and e["seat"] == seat]
    assert len(cont) == 1 and cont[0]["tokens"] > len(turn1)
    turn2 = turn1 + ids1 + NEW
    ids2, done2 = _run(d.endpoint, seat, turn2, speculation=mode)
    if cont[0]["tokens"] <= len(turn1) + len(ids1):  # the cache did not run past the answer
        assert done2.usage.cached_tokens == cont[0]["tokens"] > len(turn1)
    else:  # a speculative cycle committed past max_tokens: the prompt's end serves instead
        assert done2.usage.cached_tokens == len(turn1) - 1
    assert ids2 == _run(cold.endpoint, seat, turn2, speculation=mode)[0]


def test_a_session_kept_then_dropped(tmp_path):
    """Default config (exact reuse only): session "keep" still keeps the seat's continuation
    (pinned, on disk); session "drop" forgets it, RAM and disk."""
    turn1 = _turn1(6)
    d = start_daemon(tmp_path, BUNDLED_MODEL, config=BASE)
    try:
        with Client(d.endpoint, seat="seat-k", timeout_s=180) as c:
            s = c.generate(prompt_tokens=turn1, max_tokens=16, speculation="off", session="keep")
            s.result()
            ids1 = list(s.token_ids)
            deadline = time.monotonic() + 10  # status is republished at most every 100 ms
            while c.status().detail["prefix_cache"].get("pinned_seats") != 1:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        kept = [e for e in d.events() if e["event"] == "prefix_cache.continuation"]
        assert len(kept) == 1 and kept[0]["seat"] == "seat-k" and kept[0]["tokens"] > len(turn1)
        with Client(d.endpoint, seat="seat-k", timeout_s=180) as c:
            c.generate(prompt_tokens=turn1 + ids1 + NEW, max_tokens=4, speculation="off", session="drop").result()
    finally:
        assert d.stop() == 0
    dropped = [e for e in d.events() if e["event"] == "prefix_cache.session_dropped"]
    assert len(dropped) == 1 and dropped[0]["snapshots"] == 1
    cont_tokens = kept[0]["tokens"]
    assert not [p for p in _files(tmp_path) if p.name.startswith(f"{cont_tokens}-")]
    assert [p for p in _files(tmp_path) if p.name.startswith(f"{SNAP}-")]  # shared prefixes stay
