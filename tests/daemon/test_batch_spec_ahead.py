"""SpecBatchDecoder's drafting cycles built ahead (batch_ahead.py): the
next cycle is built and queued from the last one's device-side acceptance before the host
reads it. Every test forces it on (``spec_ahead=True``; on the CPU it is off by default) at
any cycle time (``AHEAD``: the daemon's floor of 10 ms would make the tests depend on this
machine's speed) and holds it to what cycles built one at a time give: serial's tokens,
cycle for cycle."""

from __future__ import annotations

import itertools

import pytest

mx = pytest.importorskip("mlx.core")

from daemon.engine.decoders.batch_ahead import AHEAD_MIN_CYCLES  # noqa: E402
from daemon.engine.decoders.batch_spec import SpecBatchDecoder  # noqa: E402
from daemon.engine.decoders.sampling import Sampler  # noqa: E402
from daemon.engine.decoders.serial import serial_decode  # noqa: E402
from daemon.engine.types import SamplingParams  # noqa: E402

N = 24
AHEAD = {"spec_ahead": True, "ahead_min_cycle_s": 0.0}


@pytest.fixture(scope="module")
def head(tiny_head):
    return tiny_head


@pytest.fixture(scope="module")
def prompts(code_prompts):
    return code_prompts


@pytest.fixture(scope="module")
def refs(tiny, prompts):
    """serial_decode's first 2N tokens for each prompt alone."""
    return [[s.tokens[0] for s in itertools.islice(serial_decode(tiny, p, Sampler(SamplingParams())), 2 * N)]
            for p in prompts]


def cycles(bd, n: int) -> dict:
    """Step until every row has n tokens: {row: [(tokens, accepted), ...]} (rows stay)."""
    got = {r: [] for r in bd.row_ids}
    while min(sum(len(t) for t, _ in v) for v in got.values()) < n:
        for r, s in bd.step().items():
            got[r].append((s.tokens, s.accepted))
    return got


def flat(cycle_list) -> list:
    return [t for toks, _ in cycle_list for t in toks]


@pytest.mark.parametrize("depth", [1, 3])
def test_built_ahead_is_cycle_for_cycle_what_one_at_a_time_gives(tiny, head, prompts, refs, depth):
    """Three greedy rows: the same tokens and accepted counts per cycle with cycles built
    ahead as without, serial's tokens, and the cycles really were built ahead."""
    runs = {}
    for ahead in (False, True):
        bd = SpecBatchDecoder(tiny, lambda: head, lambda B: depth, spec_ahead=ahead, ahead_min_cycle_s=0.0)
        for i in range(3):
            bd.add(i, Sampler(SamplingParams()), prompts[i], exact=True)
        runs[ahead] = (cycles(bd, N), bd.stats)
    (one, st_one), (built, st_built) = runs[False], runs[True]
    n = min(len(v) for v in one.values())  # the run built ahead may have read one more cycle
    assert {r: v[:n] for r, v in built.items()} == {r: v[:n] for r, v in one.items()}
    assert all(flat(built[i])[:N] == refs[i][:N] for i in range(3))
    assert st_one.spec_ahead_used == 0
    # At a floor of 0 from the second cycle, all but those after which compaction was due (it
    # pauses building ahead).
    assert st_built.spec_ahead_used >= st_built.cycles // 2
    assert st_built.accepted > 0 and st_built.accepted < st_built.drafted  # some drafts rejected: holes


def test_rows_join_leave_and_are_taken_out_while_cycles_are_built_ahead(tiny, head, prompts, refs):
    """A row joining, a row leaving and a row taken out and re-added each undo the cycle
    queued ahead; every row still decodes serial's tokens."""
    bd = SpecBatchDecoder(tiny, lambda: head, lambda B: 2, **AHEAD)
    for i in range(3):
        bd.add(i, Sampler(SamplingParams()), prompts[i], exact=True)
    got = {i: [] for i in range(5)}

    def run_until(n, rows):
        while min(len(got[r]) for r in rows) < n:
            for r, s in bd.step().items():
                got[r] += s.tokens

    while bd.stats.spec_ahead_used < 2:  # past the cycles that time the others: building ahead
        for r, s in bd.step().items():
            got[r] += s.tokens
    undone = bd.stats.spec_ahead_undone
    bd.add(3, Sampler(SamplingParams()), prompts[3], exact=True)  # joins
    assert bd.stats.spec_ahead_undone == undone + 1
    run_until(len(got[3]) + N // 3, [3])
    cache, primary, hist = bd.extract(1)  # taken out (parked) ...
    bd.remove(2)  # ... and one leaves
    run_until(N, [0, 3])
    bd.add(1, Sampler(SamplingParams()), [primary], cache=cache, history=hist, exact=True)  # rejoins
    bd.add(4, Sampler(SamplingParams()), prompts[4], exact=True)
    run_until(2 * N, [0, 1, 3, 4])
    for r in (0, 1, 3, 4):
        assert got[r][: 2 * N] == refs[r][: 2 * N], r
    assert got[2] == refs[2][: len(got[2])]
    assert bd.stats.spec_ahead_used > 10 and bd.stats.spec_ahead_undone >= undone + 3


def test_evicted_head_undoes_the_cycle_ahead_and_rows_go_on(tiny, head, prompts, refs):
    live = {"head": head}
    bd = SpecBatchDecoder(tiny, lambda: live["head"], lambda B: 2, **AHEAD)
    for i in range(2):
        bd.add(i, Sampler(SamplingParams()), prompts[i], exact=True)
    got = {0: [], 1: []}
    while min(len(v) for v in got.values()) < 2 * N:
        if bd.stats.spec_ahead_used >= 2:  # building ahead: the head goes
            live["head"] = None
        for r, s in bd.step().items():
            got[r] += s.tokens
    assert [got[i][: 2 * N] for i in range(2)] == [refs[0][: 2 * N], refs[1][: 2 * N]]
    assert bd.stats.spec_ahead_used > 0 and bd.stats.spec_ahead_undone == 1


def test_rows_it_cannot_decide_on_the_device_take_cycles_one_at_a_time(tiny, head, prompts, refs):
    """A row with logprobs (or processors, a grammar, a sampler), or a lone row: no cycle is
    built ahead, and the tokens are serial's."""
    for case in ("logprobs", "alone"):
        bd = SpecBatchDecoder(tiny, lambda: head, lambda B: 2, **AHEAD)
        n_rows = 1 if case == "alone" else 2
        for i in range(n_rows):
            params = SamplingParams(logprobs=True) if case == "logprobs" and i == 1 else SamplingParams()
            bd.add(i, Sampler(params, prompt=prompts[i]), prompts[i], exact=True)
        got = cycles(bd, N)
        assert all(flat(got[i])[:N] == refs[i][:N] for i in range(n_rows)), case
        assert bd.stats.spec_ahead_used == 0 and bd.stats.drafted > 0, case


def test_rows_capped_below_the_batchs_depth_accept_at_most_their_cap(tiny, head, prompts, refs):
    """Rows with their own ceilings (3, 1 and 0: a serial row) in a batch at depth 3: built
    ahead, each row's cycles are what one at a time gives (no row accepts past its cap), and
    serial's tokens."""
    caps = (None, 1, 0)
    runs = {}
    for ahead in (False, True):
        bd = SpecBatchDecoder(tiny, lambda: head, lambda B: 3, spec_ahead=ahead, ahead_min_cycle_s=0.0)
        for i, cap in enumerate(caps):
            bd.add(i, Sampler(SamplingParams()), prompts[i], exact=True, depth=None if cap is None else (lambda c=cap: c))
        runs[ahead] = cycles(bd, N), bd.stats
    (one, _), (built, st) = runs[False], runs[True]
    n = min(len(v) for v in one.values())
    assert {r: v[:n] for r, v in built.items()} == {r: v[:n] for r, v in one.items()}
    assert all(flat(built[i])[:N] == refs[i][:N] for i in range(3))
    assert st.spec_ahead_used > 0
    assert max(a for _, a in built[1]) == 1 and max(a for _, a in built[2]) == 0 and max(a for _, a in built[0]) > 1


def test_holes_are_compacted_between_cycles_built_ahead(tiny, head, prompts, refs, monkeypatch):
    """With compaction due at every few holes, cycles built ahead pause for it (nothing is
    queued on caches being compacted) and resume; the tokens stay serial's."""
    from daemon.engine.caches import ragged_cache

    monkeypatch.setattr(ragged_cache, "COMPACT_SHARE", 0.02)
    bd = SpecBatchDecoder(tiny, lambda: head, lambda B: 3, **AHEAD)
    for i in range(3):
        bd.add(i, Sampler(SamplingParams()), prompts[i], exact=True)
    compactions = []
    real = ragged_cache.RaggedKVCache.compact
    monkeypatch.setattr(ragged_cache.RaggedKVCache, "compact", lambda c: (compactions.append(c), real(c)))
    got = cycles(bd, 2 * N)
    assert all(flat(got[i])[: 2 * N] == refs[i][: 2 * N] for i in range(3))
    assert compactions and bd.stats.spec_ahead_used > 0


def test_short_cycles_are_not_built_ahead(tiny, head, prompts, refs):
    """Where drafting cycles are shorter than the floor (on a GPU: a small model, whose host is
    the bottleneck anyway) every cycle is built after the last one is read."""
    bd = SpecBatchDecoder(tiny, lambda: head, lambda B: 2, spec_ahead=True, ahead_min_cycle_s=3600.0)
    for i in range(3):
        bd.add(i, Sampler(SamplingParams()), prompts[i], exact=True)
    got = cycles(bd, N)
    assert all(flat(got[i])[:N] == refs[i][:N] for i in range(3))
    assert bd.stats.spec_ahead_used == 0 and bd.drafting_s is not None and bd.stats.drafted > 0


def test_the_floor_waits_for_enough_cycles_timed(tiny, head, prompts, refs):
    """With a floor above 0 (the daemon's 10 ms; here one any cycle passes) nothing is built
    ahead before AHEAD_MIN_CYCLES steady drafting cycles are timed, and after that it is."""
    bd = SpecBatchDecoder(tiny, lambda: head, lambda B: 2, spec_ahead=True, ahead_min_cycle_s=1e-9)
    for i in range(3):
        bd.add(i, Sampler(SamplingParams()), prompts[i], exact=True)
    got = {i: [] for i in range(3)}
    while bd.drafting_s is None:
        assert bd.stats.spec_ahead_used == 0
        for r, s in bd.step().items():
            got[r] += s.tokens
    while min(len(v) for v in got.values()) < 2 * N:
        for r, s in bd.step().items():
            got[r] += s.tokens
    assert all(got[i][: 2 * N] == refs[i][: 2 * N] for i in range(3))
    assert bd.stats.spec_ahead_used > 0 and bd.stats.cycles >= AHEAD_MIN_CYCLES
