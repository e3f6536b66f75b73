"""SpecBatchDecoder (daemon/engine/decoders/batch_spec.py): rows speculating together vs each alone."""

from __future__ import annotations

import itertools

import pytest

mx = pytest.importorskip("mlx.core")

from daemon.engine.decoders.batch_spec import SpecBatchDecoder  # noqa: E402
from daemon.engine.model.mtp_head import load_mtp_head  # noqa: E402
from daemon.engine.decoders.sampling import Sampler  # noqa: E402
from daemon.engine.decoders.serial import serial_decode  # noqa: E402
from daemon.engine.decoders.speculative import speculative_decode  # noqa: E402
from daemon.engine.types import SamplingParams  # noqa: E402

TEXTS = ["def load(path):\n    with open(path) as f:", "import json\n\nclass Encoder:", "x",
         "for i in range(10):\n    print(", "# utilities\n\n\ndef add(a, b):\n    return a + b\n\n\ndef sub(a, b):"]
N = 20


@pytest.fixture(scope="module")
def head(tiny):
    return load_mtp_head(tiny)


@pytest.fixture(scope="module")
def prompts(tiny):
    return [tiny.tokenizer.encode(t) for t in TEXTS]


def serial(lm, prompt, n=N, params=SamplingParams()):
    sampler = Sampler(params, prompt=prompt)
    steps = list(itertools.islice(serial_decode(lm, prompt, sampler), n))
    return [s.tokens[0] for s in steps], [lp for s in steps for lp in (s.logprobs or [])]


def drive(bd, want: dict, n=N, join: list | None = None, on_cycle=None):
    """Step until every row has n tokens; rows leave once they have them; ``join`` rows are
    admitted one per cycle as others run. Returns {row: tokens}, {row: [DecodeStep]}."""
    got = {r: [] for r in want}
    steps = {r: [] for r in want}
    join = list(join or [])
    while len(bd) or join:
        for r, s in bd.step().items():
            got[r] += s.tokens
            steps[r].append(s)
            assert len(s.tokens) == s.accepted + 1 and len(s.accepted_mask) == s.drafted
        for r in [r for r in bd.row_ids if len(got[r]) >= n]:
            bd.remove(r)
        if join:
            join.pop(0)()
        if on_cycle is not None:
            on_cycle(got)
    return {r: v[:n] for r, v in got.items()}, steps


@pytest.mark.parametrize("height", [2, 4, 8])
def test_greedy_rows_join_and_leave_and_stay_serial(tiny, head, prompts, height):
    """Mixed prompt lengths and per-row depths (0-4), rows joining mid-stream and leaving
    when done: every row's tokens are serial_decode's for its prompt alone."""
    rows = list(range(height + 2))
    plan = {r: (prompts[r % len(prompts)], (1, 2, 3, 4, 0)[r % 5]) for r in rows}
    refs = {r: serial(tiny, plan[r][0])[0] for r in rows}
    bd = SpecBatchDecoder(tiny, lambda: head, lambda B: 4, max_rows=height)
    assert bd.exact_ok, "on CPU the batched verify is bit-identical to serial steps"

    def admit(r):
        return lambda: bd.add(r, Sampler(SamplingParams()), plan[r][0], exact=True, depth=lambda d=plan[r][1]: d)

    first = max(1, height // 2)
    for r in rows[:first]:
        admit(r)()
    pending = [admit(r) for r in rows[first:]]  # admitted mid-stream, while there is room

    def on_cycle(_):
        while pending and len(bd) < height:
            pending.pop(0)()

    got, steps = drive(bd, refs, on_cycle=on_cycle)
    assert got == refs
    drafted = sum(s.drafted for r in rows for s in steps[r])
    assert drafted > 0 and sum(s.accepted for r in rows for s in steps[r]) > 0
    assert all(s.drafted == 0 for r in rows if plan[r][1] == 0 for s in steps[r])  # depth-0 rows never draft
    assert max(s.depth for r in rows for s in steps[r]) == 4


def test_batched_rows_draft_and_accept_as_each_alone(tiny, head, prompts):
    """The head's per-row history is whole: each batched row's cycles (tokens and accepted
    counts) are those of speculative_decode running that prompt alone at the same depth."""
    depth = 3
    solo = []
    for p in prompts[:3]:
        out, n = [], 0
        for s in speculative_decode(tiny, head, p, Sampler(SamplingParams()), depth, guard_margin=None, pipeline=False):
            out.append((s.tokens, s.accepted))
            n += len(s.tokens)
            if n >= N:
                break
        solo.append(out)
    bd = SpecBatchDecoder(tiny, lambda: head, lambda B: depth)
    for i, p in enumerate(prompts[:3]):
        bd.add(i, Sampler(SamplingParams()), p, exact=True)
    got = {i: [] for i in range(3)}
    for _ in range(max(len(s) for s in solo)):
        for r, s in bd.step().items():
            got[r].append((s.tokens, s.accepted))
    for i in range(3):
        assert got[i][: len(solo[i])] == solo[i]
        assert sum(a for _, a in solo[i]) > 0


@pytest.mark.parametrize("depth", [2, 0])
def test_processors_and_logprobs_rows_batch_and_match_serial(tiny, head, prompts, depth):
    """logit_bias, penalties and logprobs rows batch beside plain rows at temperature 0:
    tokens and logprob entries are serial's, drafting (depth 2) or with every cycle queued
    ahead (depth 0: the processors count each token on the device before the next cycle)."""
    params = [
        SamplingParams(logit_bias={11: 4.0, 13: -100.0, 220: 2.0}),
        SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3),
        SamplingParams(logprobs=True, top_logprobs=3),
        SamplingParams(),
    ]
    refs = {i: serial(tiny, prompts[i], params=p) for i, p in enumerate(params)}
    bd = SpecBatchDecoder(tiny, lambda: head, lambda B: depth)
    for i, p in enumerate(params):
        bd.add(i, Sampler(p, prompt=prompts[i]), prompts[i], exact=True)
    got, steps = drive(bd, refs)
    for i in range(len(params)):
        assert got[i] == refs[i][0], i
    lps = [e for s in steps[2] for e in s.logprobs][:N]
    assert len(lps) == N
    for (lp, top), (want_lp, want_top) in zip(lps, refs[2][1]):
        assert lp == pytest.approx(want_lp, abs=1e-6)
        assert [t for t, _ in top] == [t for t, _ in want_top]
    if depth:
        assert sum(s.drafted for s in steps[0] + steps[1]) > 0  # processor rows really speculated
    else:
        assert bd.stats.ahead_used > N // 2  # their cycles really were queued ahead


def test_sampled_rows_with_a_seed_run_finish_and_reproduce(tiny, head, prompts):
    def run():
        bd = SpecBatchDecoder(tiny, lambda: head, lambda B: 3)
        for i in range(3):
            bd.add(i, Sampler(SamplingParams(temperature=0.8, top_k=20, seed=100 + i), prompt=prompts[i]), prompts[i])
        bd.add(3, Sampler(SamplingParams(temperature=1.0, seed=7, presence_penalty=0.5)), prompts[3])
        return drive(bd, {i: None for i in range(4)})

    got, steps = run()
    V = tiny.text_args.vocab_size
    assert all(len(got[i]) == N and all(0 <= t < V for t in got[i]) for i in range(4))
    assert sum(s.drafted for r in steps for s in steps[r]) > 0
    again, _ = run()
    assert again == got  # a seed reproduces a batched request


def test_extracted_row_resumes_alone_and_rejoins(tiny, head, prompts):
    """``extract`` hands back (cache, primary, head history): continued alone by
    speculative_decode, or re-added, the row still decodes serial's tokens."""
    refs = [serial(tiny, p, 2 * N)[0] for p in prompts[:3]]
    bd = SpecBatchDecoder(tiny, lambda: head, lambda B: 2)
    for i in range(3):
        bd.add(i, Sampler(SamplingParams()), prompts[i], exact=True)
    got = {i: [] for i in range(3)}
    while min(len(v) for v in got.values()) < N // 2:
        for r, s in bd.step().items():
            got[r] += s.tokens
    cache, primary, hist = bd.extract(0)
    for s in speculative_decode(tiny, head, [primary], Sampler(SamplingParams()), 2, guard_margin=None,
                                cache=cache, history=hist, pipeline=False):
        got[0] += s.tokens
        if len(got[0]) >= 2 * N:
            break
    cache, primary, hist = bd.extract(1)
    bd.add(1, Sampler(SamplingParams()), [primary], cache=cache, history=hist, exact=True)
    while min(len(got[1]), len(got[2])) < 2 * N:
        for r, s in bd.step().items():
            got[r] += s.tokens
    assert [got[i][: 2 * N] for i in range(3)] == refs


def test_solo_speculation_hands_over_into_the_batch(tiny, head, prompts):
    flag = {"go": False}
    ref = serial(tiny, prompts[0], 2 * N)[0]
    gen = speculative_decode(tiny, head, prompts[0], Sampler(SamplingParams()), 2, guard_margin=None,
                             pipeline=False, handoff=lambda: flag["go"])
    out = []
    while len(out) < N // 2:
        out += next(gen).tokens
    flag["go"] = True
    with pytest.raises(StopIteration) as done:
        next(gen)
    cache, primary, hist = done.value.value
    assert primary == out[-1]
    bd = SpecBatchDecoder(tiny, lambda: head, lambda B: 2)
    bd.add("solo", Sampler(SamplingParams()), [primary], cache=cache, history=hist, exact=True)
    bd.add("other", Sampler(SamplingParams()), prompts[1], exact=True)
    accepted = 0
    while len(out) < 2 * N:
        s = bd.step()["solo"]
        out += s.tokens
        accepted += s.accepted
    assert out[: 2 * N] == ref and accepted > 0


def test_head_evicted_mid_stream_rows_go_on_at_depth_zero(tiny, head, prompts):
    live = {"head": head}
    refs = {i: serial(tiny, prompts[i])[0] for i in range(2)}
    bd = SpecBatchDecoder(tiny, lambda: live["head"], lambda B: 2)
    for i in range(2):
        bd.add(i, Sampler(SamplingParams()), prompts[i], exact=True)

    def evict(got):
        if min(len(v) for v in got.values()) >= N // 2:
            live["head"] = None

    got, steps = drive(bd, refs, on_cycle=evict)
    assert got == refs
    assert steps[0][-1].drafted == 0 and any(s.drafted for s in steps[0])


def test_exact_greedy_rows_refused_where_batched_verify_differs(tiny, head, prompts):
    bd = SpecBatchDecoder(tiny, lambda: head, lambda B: 2, exact_ok=False)
    assert not bd.admits(Sampler(SamplingParams()), exact=True)
    assert bd.admits(Sampler(SamplingParams()), exact=False)  # fast rows accept flips
    assert bd.admits(Sampler(SamplingParams(temperature=0.7)), exact=True)
    with pytest.raises(ValueError):
        bd.add(0, Sampler(SamplingParams()), prompts[0], exact=True)


def test_ragged_probe_passes_here_and_catches_a_wrong_rollback(tiny, monkeypatch):
    """The start-up probe behind ``exact_ok``: true on CPU; where the ragged rollback is
    wrong (rows keep every verify position), every row's later logits differ and it says so."""
    from daemon.engine.decoders import exactness

    tiny.__dict__.pop("_ragged_verify_matches_serial", None)
    assert exactness.ragged_verify_matches_serial(tiny)
    tiny.__dict__.pop("_ragged_verify_matches_serial", None)
    monkeypatch.setattr(exactness, "keep_ragged", lambda cache, rec, keep, T: None)
    assert not exactness.ragged_verify_matches_serial(tiny)
    tiny.__dict__.pop("_ragged_verify_matches_serial", None)


def test_rows_at_depth_zero_leave_and_extract_with_an_unfed_head(tiny, head, prompts):
    """Depth 0 throughout (the governor's call under load): the head's batch cache is never
    written; rows still leave, are extracted and rejoin, decoding serial's tokens."""
    refs = {i: serial(tiny, prompts[i])[0] for i in range(3)}
    bd = SpecBatchDecoder(tiny, lambda: head, lambda B: 0)
    for i in range(3):
        bd.add(i, Sampler(SamplingParams()), prompts[i], exact=True)
    first = {r: s.tokens for r, s in bd.step().items()}
    cache, primary, hist = bd.extract(2)
    bd.add(2, Sampler(SamplingParams()), [primary], cache=cache, history=hist, exact=True)
    bd.remove(2)
    bd.add(2, Sampler(SamplingParams()), prompts[2], exact=True)  # from its prompt again
    got, steps = drive(bd, refs)
    assert {r: (first[r] + got[r] if r < 2 else got[r])[:N] for r in got} == refs
    assert all(s.drafted == 0 for r in steps for s in steps[r])


def test_depth_zero_cycles_issued_ahead_stay_serial_through_depth_changes_and_joins(tiny, head, prompts):
    """Depth-0 cycles are queued ahead of the host's read; a cycle queued ahead is undone
    when the depth rises, a row joins, leaves or is extracted. Through all of them every row
    decodes serial's tokens, and both the queued cycles and the undoing really happened."""
    refs = {i: serial(tiny, prompts[i], 2 * N)[0] for i in range(4)}
    depth = {"k": 0}
    bd = SpecBatchDecoder(tiny, lambda: head, lambda B: depth["k"])
    for i in range(2):
        bd.add(i, Sampler(SamplingParams()), prompts[i], exact=True)
    got = {i: [] for i in range(4)}
    cycle = 0
    ks, transitions = [], []
    while len(bd):
        depth["k"] = 2 if cycle % 9 in (4, 5) else 0  # the governor raising and lowering the depth
        for r, s in bd.step().items():
            got[r] += s.tokens
        ks.append(bd.last_depth)
        transitions.append(bd.last_transition)
        cycle += 1
        if cycle == 3:
            bd.add(2, Sampler(SamplingParams()), prompts[2], exact=True)  # joins while a cycle is ahead
        if cycle == 7:
            cache, primary, hist = bd.extract(1)  # leaves with a cycle ahead, rejoins from its state
            bd.add(1, Sampler(SamplingParams()), [primary], cache=cache, history=hist, exact=True)
        if cycle == 11:
            bd.add(3, Sampler(SamplingParams()), prompts[3], exact=True)
        for r in [r for r in bd.row_ids if len(got[r]) >= 2 * N]:
            bd.remove(r)
    assert {i: got[i][: 2 * N] for i in range(4)} == refs
    assert bd.stats.ahead_used > 10 and bd.stats.ahead_undone >= 3
    assert bd.stats.drafted > 0  # the depth really rose in between
    # The first cycle at a new depth is a transition (its cost is the change's: the governor
    # does not book it); a second cycle at depth 2 is a steady one.
    changed = [i for i in range(1, len(ks)) if ks[i] != ks[i - 1]]
    assert changed and all(transitions[i] for i in changed)
    steady = [i for i in range(1, len(ks)) if ks[i] == ks[i - 1] == 2]
    assert steady and not all(transitions[i] for i in steady)


def test_unpipelined_decoder_decodes_the_same_tokens(tiny, head, prompts):
    """``pipeline=False`` (the benchmark's before arm) reads every cycle before the next: the
    same tokens, for greedy rows and for sampled rows with their seeds (a cycle issued ahead
    draws from a row's key; undoing it, when the depth rises or a row is extracted and
    rejoins, puts the key back), so a seed still reproduces a batched request; a row with
    processors and logprobs rides along."""
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_k=20, seed=5),
              SamplingParams(temperature=1.0, seed=9),
              SamplingParams(repetition_penalty=1.3, presence_penalty=0.8, logprobs=True, top_logprobs=2)]

    def run(pipeline):
        depth = {"k": 0}
        bd = SpecBatchDecoder(tiny, lambda: head, lambda B: depth["k"], pipeline=pipeline)
        samplers = {i: Sampler(p, prompt=prompts[i]) for i, p in enumerate(params)}
        for i in samplers:
            bd.add(i, samplers[i], prompts[i], exact=True)
        cycles = {"n": 0}

        def on_cycle(_):
            cycles["n"] += 1
            depth["k"] = 2 if cycles["n"] % 7 == 3 else 0
            if cycles["n"] == 5 and 2 in bd:
                cache, primary, hist = bd.extract(2)
                bd.add(2, samplers[2], [primary], cache=cache, history=hist, exact=True)

        got, _ = drive(bd, {i: None for i in range(len(params))}, on_cycle=on_cycle)
        return got, bd.stats

    (on, st_on), (off, st_off) = run(True), run(False)
    assert on == off
    assert st_on.ahead_used > 5 and st_on.ahead_undone >= 2 and st_off.ahead_used == 0



def test_a_cycle_reports_the_positions_its_forward_held(tiny, head, prompts):
    """The step budget's use (worker._advance): a speculating cycle at depth K forwards every
    row's primary and K drafts, B x (K + 1) positions; at depth 0, and in BatchDecoder, B."""
    from daemon.engine.decoders.batch import BatchDecoder

    depth = {"k": 3}
    bd = SpecBatchDecoder(tiny, lambda: head, lambda B: depth["k"])
    for i in range(3):
        bd.add(i, Sampler(SamplingParams()), prompts[i], exact=True)
    bd.step()  # rows admitted from their prompts have a pair to draft from now
    bd.step()
    assert (bd.last_depth, bd.last_positions) == (3, 3 * 4)
    depth["k"] = 0
    bd.step()
    assert (bd.last_depth, bd.last_positions) == (0, 3)
    plain = BatchDecoder(tiny)
    for i in range(2):
        plain.add(i, Sampler(SamplingParams()), prompts[i], exact=True)
    plain.step()
    assert plain.last_positions == 2
