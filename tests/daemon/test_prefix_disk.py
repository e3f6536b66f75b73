"""The prefix cache's disk tier on real (random-weight) model caches: a snapshot written
and read back continues exactly as the live cache; a damaged, foreign or mislabelled file
is a miss and is deleted; the byte budget and the free-space floor hold; a discarded
snapshot is gone from disk; a finished decoder's cache is kept as a continuation."""

from __future__ import annotations

import random
from pathlib import Path

import mlx.core as mx
import pytest

from daemon.engine.caches import prefix_disk
from daemon.engine.caches.prefix_cache import PrefixCache
from daemon.engine.decoders.sampling import Sampler
from daemon.engine.decoders.serial import serial_decode
from daemon.engine.types import SamplingParams
from daemon.logs import get_logger

from model_helpers import next_logits, prefilled

LOG = get_logger("test.prefix_disk")


@pytest.fixture(scope="module")
def lm(random_model_path):
    from daemon.engine.model.loading import load_model

    return load_model(random_model_path, compile_decode=False)


def _tier(root: Path, **kw) -> prefix_disk.DiskTier:
    return prefix_disk.DiskTier(root, "fp", kw.pop("max_bytes", 1 << 30), LOG, **kw)


def _cache(lm, root: Path, **kw) -> PrefixCache:
    return PrefixCache(1 << 30, 16, make_cache=lm.make_cache, disk=_tier(root, **kw))


def _prompt(seed: int, n: int = 70) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 500) for _ in range(n)]


@pytest.mark.quick
def test_a_file_read_back_continues_as_the_live_cache(lm, tmp_path):
    prompt = _prompt(0)
    pc = _cache(lm, tmp_path)
    live = prefilled(lm, prompt[:48], 16)
    assert pc.store(prompt[:48], live, None) is not None
    pc.disk.flush()
    assert pc.disk.stats()["files"] == 1
    ref = next_logits(lm, live, prompt[48])
    fresh = _cache(lm, tmp_path)  # a restarted daemon: nothing in RAM
    snap, n = fresh.lookup(prompt, want_head=False)
    assert n == 48 and fresh.disk_hits == 1
    cache, _ = fresh.restore(snap, prompt[48], head=None)
    assert mx.array_equal(next_logits(lm, cache, prompt[48]), ref).item()
    assert fresh.lookup(prompt, want_head=True) == (None, 0)  # no head history was stored


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "bitflip":
        data[len(data) // 2] ^= 1
    elif how == "truncated":
        data = data[: len(data) // 3]
    elif how == "empty":
        data = bytearray()
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["bitflip", "truncated", "empty", "foreign", "mislabelled"])
def test_a_bad_file_is_a_miss_and_is_deleted(lm, tmp_path, how):
    prompt = _prompt(1)
    pc = _cache(lm, tmp_path)
    pc.store(prompt[:32], prefilled(lm, prompt[:32], 16), None)
    pc.disk.flush()
    (path,) = list((tmp_path / "fp").glob("*.snap"))
    if how == "foreign":  # a whole, valid file of another configuration
        other = tmp_path / "other"
        pc2 = PrefixCache(1 << 30, 16, make_cache=lm.make_cache, disk=prefix_disk.DiskTier(tmp_path, "other", 1 << 30, LOG))
        pc2.store(prompt[:32], prefilled(lm, prompt[:32], 16), None)
        pc2.disk.flush()
        path.write_bytes(next(other.glob("*.snap")).read_bytes())
    elif how == "mislabelled":  # a whole file of this configuration under another prefix's name
        pc.store(_prompt(2)[:32], prefilled(lm, _prompt(2)[:32], 16), None)
        pc.disk.flush()
        src = next(p for p in (tmp_path / "fp").glob("*.snap") if p != path)
        path.write_bytes(src.read_bytes())
    else:
        _damage(path, how)
    fresh = _cache(lm, tmp_path)
    assert fresh.lookup(prompt, want_head=False) == (None, 0)
    assert fresh.disk.stats()["corrupt"] == 1 and not path.exists()


def test_the_disk_budget_and_the_free_space_floor(lm, tmp_path):
    prompts = [_prompt(10 + i) for i in range(3)]
    probe = _cache(lm, tmp_path / "probe")
    probe.store(prompts[0][:32], prefilled(lm, prompts[0][:32], 16), None)
    probe.disk.flush()
    one = probe.disk.stats()["bytes"]
    pc = _cache(lm, tmp_path / "budget", max_bytes=int(2.5 * one))
    for p in prompts:
        pc.store(p[:32], prefilled(lm, p[:32], 16), None)
        pc.disk.flush()
    st = pc.disk.stats()
    assert st["files"] == 2 and st["bytes"] <= 2.5 * one and st["evicted"] == 1
    pc.clear()
    assert pc.lookup(prompts[0], want_head=False)[1] == 0  # the oldest file went
    assert pc.lookup(prompts[2], want_head=False)[1] == 32
    full = _cache(lm, tmp_path / "full", min_free_bytes=1 << 62)  # more than any disk has free
    full.store(prompts[0][:32], prefilled(lm, prompts[0][:32], 16), None)
    full.disk.flush()
    assert full.disk.stats()["files"] == 0 and full.disk.stats()["skipped"] == 1
    assert full.lookup(prompts[0], want_head=False)[1] == 32  # RAM still serves


def test_a_continuation_is_the_decoders_cache_and_drop_forgets_it(lm, tmp_path):
    prompt = _prompt(20, 40)
    cache = prefilled(lm, prompt[:-1], 16)
    gen = serial_decode(lm, [prompt[-1]], Sampler(SamplingParams()), cache=cache)
    out = [next(gen).tokens[0] for _ in range(6)]
    gen.close()
    pc = _cache(lm, tmp_path)
    snap = pc.store_final(prompt + out, cache, None, seat="s1")
    assert snap is not None and snap.tokens == tuple(prompt + out) and snap.exact == pc.splits_exact
    nxt = prompt + out + [7, 8]
    if not pc.splits_exact:  # inexact here: not for requests that do not allow it
        assert pc.lookup(nxt, want_head=False) == (None, 0)
    got, n = pc.lookup(nxt, want_head=False, allow_inexact=True)
    assert n == len(prompt) + len(out)
    # What it holds is what the decoder's cache held: the next token's logits agree.
    restored, _ = pc.restore(got, nxt[n], head=None)
    assert mx.array_equal(next_logits(lm, restored, nxt[n]), next_logits(lm, cache, nxt[n])).item()
    pc.disk.flush()
    assert pc.disk.stats()["files"] == 1 and pc.pinned["s1"][0] == n
    assert pc.forget_seat("s1") == (1, snap.nbytes)
    assert pc.disk.stats()["files"] == 0 and not list((tmp_path / "fp").glob("*.snap"))
    assert pc.lookup(nxt, want_head=False, allow_inexact=True) == (None, 0)


def test_the_fingerprint_changes_with_what_changes_the_states_bits(lm):
    """A snapshot is only as good as the arithmetic that wrote it: the kernels a forward runs
    on (a fixed-order kernel's split, the fused recurrence, merged projections) and the engine's
    code are part of the fingerprint, as the prefill chunk and the decode path are."""
    key = prefix_disk.numerics_key(lm, 16)
    assert key["engine_source"] and key["kernels"] == lm.kernels
    base = prefix_disk.model_fingerprint(lm.path, key)
    assert prefix_disk.model_fingerprint(lm.path, dict(key)) == base
    for field in ("kernels", "engine_source", "recurrence", "linears", "prefill_chunk", "decode_path"):
        assert prefix_disk.model_fingerprint(lm.path, key | {field: f"{key[field]}+other"}) != base, field


def _pending_cache(lm, root: Path) -> PrefixCache:
    """A cache opened before the splits verdict (a start that serves first)."""
    return PrefixCache(1 << 30, 16, make_cache=lm.make_cache, disk=_tier(root), splits_pending=True)


def test_snapshots_that_wait_for_the_splits_verdict_are_made_exact_by_it_and_only_then_written(lm, tmp_path):
    """Before the verdict: an exact request's continuation and a prompt's exact end are kept
    pending: exact lookups pass them by (the grid point below serves), fast ones take them,
    the disk has nothing of them; grid points are exact as always. A verdict that splits are
    exact promotes them (the next turn resumes at its seat's exact end, and the file is written
    as exact); one that says not leaves them inexact."""
    prompt = _prompt(7)
    pc = _pending_cache(lm, tmp_path)
    assert "until the splits verdict" in pc.exact_reuse
    assert pc.boundaries(len(prompt), 0, fine=True) == {69, 64, 48}  # no message ends: no cuts
    assert pc.is_pending(69) and not pc.is_pending(64) and not pc.is_pending(69, from_exact=False)
    assert pc.store(prompt[:64], prefilled(lm, prompt[:64], 16), None).exact  # on the grid: exact now
    end = pc.store(prompt[:69], prefilled(lm, prompt[:69], 16), None, exact=False, pending=True)
    assert end.pending and not end.exact
    cont = pc.store_final(prompt + [3, 4], prefilled(lm, prompt + [3], 16), None, seat="s")
    assert cont.pending and not cont.exact
    lost = pc.store_final(prompt[:40] + [5, 6], prefilled(lm, prompt[:40] + [5], 16), None, seat="t", exact=False)
    assert not lost.pending and not lost.exact  # its decode left no cold state: never exact
    nxt = prompt + [3, 4, 9, 9]
    assert pc.lookup(nxt, want_head=False)[1] == 64
    assert pc.lookup(nxt, want_head=False, allow_inexact=True)[1] == 71
    pc.disk.flush()
    assert pc.disk.stats()["files"] == 2  # the grid point and the inexact continuation
    assert pc.stats()["pending"] == 2 and pc.stats()["splits_pending"]

    assert pc.settle(True) == 2
    assert cont.exact and end.exact and not lost.exact and pc.splits_exact and not pc.splits_pending
    snap, n = pc.lookup(nxt, want_head=False)
    assert n == 71 and snap is cont
    pc.disk.flush()
    assert pc.disk.stats()["files"] == 4
    fresh = PrefixCache(1 << 30, 16, make_cache=lm.make_cache, disk=_tier(tmp_path), splits_exact=True)
    snap, n = fresh.lookup(nxt, want_head=False)  # a restarted daemon: from the file, exact
    assert n == 71 and snap.exact and fresh.disk_hits == 1
    assert mx.array_equal(next_logits(lm, fresh.restore(snap, 9, head=None)[0], 9),
                          next_logits(lm, prefilled(lm, nxt[:71], 16), 9)).item()

    no = _pending_cache(lm, tmp_path / "no")
    held = no.store_final(prompt + [3, 4], prefilled(lm, prompt + [3], 16), None, seat="s")
    assert no.settle(False) == 0
    assert not held.exact and not held.pending and no.stats()["promoted"] == 0
    assert no.lookup(nxt, want_head=False)[1] == 0
    assert no.lookup(nxt, want_head=False, allow_inexact=True)[1] == 71


def test_a_pending_snapshot_that_leaves_ram_before_the_verdict_is_written_as_inexact(lm, tmp_path):
    prompt = _prompt(8)
    pc = _pending_cache(lm, tmp_path)
    snap = pc.store_final(prompt + [3, 4], prefilled(lm, prompt + [3], 16), None)
    assert snap.pending
    pc.disk.flush()
    assert pc.disk.stats()["files"] == 0
    assert pc.evict_oldest()[1] == 71
    pc.disk.flush()
    assert pc.disk.stats()["files"] == 1
    (entry,) = pc.disk.index.values()
    assert entry.tokens == 71 and not entry.exact
    assert pc.settle(True) == 0  # gone from RAM: the file stays what it was written as
    assert pc.lookup(prompt + [3, 4, 9], want_head=False)[1] == 0
    assert pc.lookup(prompt + [3, 4, 9], want_head=False, allow_inexact=True)[1] == 71
