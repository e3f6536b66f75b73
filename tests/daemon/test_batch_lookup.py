"""Prompt lookup inside the speculating batch (daemon/engine/decoders/batch_spec.py): rows
whose committed tail recurs verify the block that followed it, in one forward with the
others, and every greedy row still decodes serial_decode's tokens."""

from __future__ import annotations

import itertools

import pytest

mx = pytest.importorskip("mlx.core")

from daemon.engine.decoders.batch_spec import SpecBatchDecoder  # noqa: E402
from daemon.engine.decoders.lookup import LookupConfig  # noqa: E402
from daemon.engine.decoders.sampling import Sampler  # noqa: E402
from daemon.engine.decoders.serial import serial_decode  # noqa: E402
from daemon.engine.types import SamplingParams  # noqa: E402

# Text that repeats: the bundled model copies such runs, so lookup blocks are proposed and held.
TEXTS = ["def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\ndef add(",
         "| x | y |\n| 1 | 2 |\n| 3 | 4 |\n| 1 | 2 |\n| 3 |",
         "import os\nimport sys\nimport os\nimport sys\nimport",
         "for i in range(3):\n    print(i)\nfor i in range(3):\n    print("]
N = 40
LOOKUP = LookupConfig(max_draft=8)


@pytest.fixture(scope="module")
def prompts(tiny):
    return [tiny.tokenizer.encode(t) for t in TEXTS]


def serial(lm, prompt, params=SamplingParams(), n=N):
    return [s.tokens[0] for s in itertools.islice(serial_decode(lm, prompt, Sampler(params, prompt=prompt)), n)]


def drive(bd, n=N, join=()):
    """Step until every row has n tokens (rows leave once they have them; ``join`` rows are
    admitted one a cycle); returns {row: tokens}, {row: [DecodeStep]}."""
    got, steps, join = {}, {}, list(join)
    while len(bd) or join:
        for r, s in bd.step().items():
            got.setdefault(r, []).extend(s.tokens)
            steps.setdefault(r, []).append(s)
            assert len(s.tokens) == s.accepted + 1 and len(s.accepted_mask) == s.drafted
        for r in [r for r in bd.row_ids if len(got.get(r, ())) >= n]:
            bd.remove(r)
        if join:
            join.pop(0)()
    return {r: v[:n] for r, v in got.items()}, steps


@pytest.mark.parametrize("depth", [0, 2])
def test_rows_verify_their_lookup_blocks_together_and_stay_serial(tiny, tiny_head, prompts, depth):
    """Four greedy rows (one with a repetition penalty, one without lookup), joining mid-stream,
    at batch depth 0 (cycles queued ahead, undone when a lookup cycle comes) and 2 (head
    drafts between lookup cycles): each row's tokens are serial_decode's, lookup cycles ran,
    and their blocks were accepted."""
    params = [SamplingParams(), SamplingParams(repetition_penalty=1.1), SamplingParams(), SamplingParams()]
    refs = {i: serial(tiny, p, params[i]) for i, p in enumerate(prompts)}
    bd = SpecBatchDecoder(tiny, lambda: tiny_head, lambda B: depth, max_rows=4)
    assert bd.exact_ok

    def admit(i):
        return lambda: bd.add(i, Sampler(params[i], prompt=prompts[i]), prompts[i], exact=True,
                              lookup=None if i == 3 else LOOKUP)

    admit(0)()
    admit(1)()
    got, steps = drive(bd, join=[admit(2), admit(3)])
    assert got == refs
    by_lookup = {i: [s for s in steps[i] if s.draft_source == "lookup"] for i in steps}
    assert not by_lookup[3], "a row added without lookup drafts none"
    assert any(by_lookup[i] for i in (0, 1, 2))
    assert bd.stats.lookup_cycles > 0 and bd.stats.lookup_accepted > 0
    assert bd.stats.lookup_accepted == sum(s.accepted for i in (0, 1, 2) for s in by_lookup[i])
    assert all(s.drafted <= LOOKUP.max_draft and s.depth == s.drafted for v in by_lookup.values() for s in v)
    if depth == 0:
        assert bd.stats.ahead_undone > 0  # depth-0 cycles queued ahead gave way to lookup cycles
    else:
        assert bd.stats.drafted > 0  # the head drafted between them (its counts apart from lookup's)


def test_a_lookup_row_that_joins_late_reads_what_it_generated_before(tiny, tiny_head, prompts):
    """A row added with ``context`` (its prompt and what it generated alone) proposes blocks
    from all of it, as the engine's rejoining rows do; a sampled row gets no lookup."""
    prompt = prompts[0]
    ref = serial(tiny, prompt, n=N + 12)
    bd = SpecBatchDecoder(tiny, lambda: tiny_head, lambda B: 0, max_rows=2)
    sampler = Sampler(SamplingParams(), prompt=prompt)
    sampler.commit(mx.array(ref[:12], dtype=mx.uint32))  # the tokens it decoded before joining
    bd.add("late", sampler, prompt + ref[:12], exact=True, lookup=LOOKUP, context=[])
    bd.add("sampled", Sampler(SamplingParams(temperature=0.8, seed=3), prompt=prompts[1]), prompts[1],
           lookup=LOOKUP)
    assert bd._rows[0].lookup.seq == prompt + ref[:12]
    assert bd._rows[1].lookup is None
    got, _ = drive(bd)
    assert got["late"] == ref[12:12 + N]
