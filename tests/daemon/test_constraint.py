"""Constrained decoding (daemon/engine/decoders/constraint.py) on the bundled model, in process:
the matcher's bookkeeping, refusals, and every decode path (serial, exact and sampled
speculation with head drafts and prompt-lookup blocks, batched rows) against the grammar and
against constrained serial decode."""

from __future__ import annotations

import itertools
import json

import pytest

mx = pytest.importorskip("mlx.core")

from daemon.engine.decoders.batch import BatchDecoder  # noqa: E402
from daemon.engine.decoders.constraint import (  # noqa: E402
    ConstraintError,
    ConstraintViolation,
    compile_constraint,
)
from daemon.engine.decoders.lookup import DraftStopConfig, LookupConfig  # noqa: E402
from daemon.engine.model.mtp_head import load_mtp_head  # noqa: E402
from daemon.engine.decoders.sampling import Sampler  # noqa: E402
from daemon.engine.decoders.serial import serial_decode  # noqa: E402
from daemon.engine.decoders.speculative import speculative_decode  # noqa: E402
from daemon.engine.types import SamplingParams  # noqa: E402

from constraint_cases import CASES as CONSTRAINTS, check_output  # noqa: E402

CASES = list(CONSTRAINTS.items())  # (kind, value)
PROMPTS = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n", "import os\nimport sys\n\ndef main():\n"]


@pytest.fixture(scope="module")
def head(tiny):
    return load_mtp_head(tiny)


def text_of(lm, tokens):
    """The output up to its first EOS, and whether there was one."""
    cut = next((i for i, t in enumerate(tokens) if t in lm.eos_token_ids), None)
    return lm.tokenizer.decode(tokens[:cut] if cut is not None else tokens), cut is not None


def decode(gen, n, constraint=None):
    """Tokens until n, or until the grammar ends (the worker stops there too)."""
    out = []
    for step in gen:
        out += step.tokens
        if len(out) >= n or (constraint is not None and constraint.complete) or set(out) & {0, 2}:
            break
    gen.close()
    return out[:n]


def serial_ref(lm, prompt, kind, value, n=60, params=SamplingParams()):
    c = compile_constraint(lm, kind, value)
    return decode(serial_decode(lm, prompt, Sampler(params, prompt, constraint=c)), n, c), c


# ---------------------------------------------------------------- the matcher's bookkeeping


@pytest.mark.quick
def test_advance_rollback_settle_and_forbidden_tokens(tiny):
    c = compile_constraint(tiny, "regex", "ab|abc")
    tok = tiny.tokenizer
    ab, cc = tok.encode("ab"), tok.encode("c")
    assert len(ab) == 1 and len(cc) == 1
    bad = tok.encode("#")[0]
    assert c.allows(0, ab[0]) and not c.allows(0, bad)
    with pytest.raises(ConstraintViolation):
        c.advance([bad])
    assert c.position == 0 and not c.matcher.is_error()  # never advanced over a forbidden token
    c.advance(ab)  # a draft
    assert c.rows(0, 2).shape == (2, tiny.text_args.vocab_size)
    with pytest.raises(ConstraintViolation):
        c.rows(0, 3)  # position 2 was never reached: an error, not an unconstrained row
    # After "ab": "c" or EOS.
    allowed = {i for i, v in enumerate(c.rows(1, 1)[0].tolist()) if v}
    assert allowed == {cc[0]} | set(tiny.eos_token_ids)
    c.settle(ab + cc)  # the draft kept, one more committed
    assert c.floor == 2 and c.complete  # "abc": only EOS can follow
    assert {i for i, v in enumerate(c.rows(0, 1)[0].tolist()) if v} == set(tiny.eos_token_ids)
    with pytest.raises(ConstraintViolation):
        c.rollback(1)  # below the committed floor
    # Tokens after the grammar's end are EOS; they roll back without touching the matcher.
    c.advance([0, 0])
    c.rollback(2)
    assert c.position == 2 and c.complete


def test_settle_rolls_back_rejected_drafts(tiny):
    c = compile_constraint(tiny, "lark", 'start: "yes" | "no"')
    yes, no = tiny.tokenizer.encode("yes"), tiny.tokenizer.encode("no")
    c.advance(yes)
    c.settle(no)  # the draft "yes" was rejected, "no" committed
    assert c.tokens == no and c.complete


def test_masks_are_as_wide_as_the_logits(tiny):
    vocab = tiny.text_args.vocab_size
    wide = compile_constraint(tiny, "json_object", "", width=vocab + 100)  # a padded vocabulary
    m = wide.rows(0, 1)
    assert m.shape == (1, vocab + 100) and not m[0, vocab:].any().item()
    narrow = compile_constraint(tiny, "regex", "[a-z]+", width=vocab - 96)
    assert narrow.rows(0, 1).shape == (1, vocab - 96)
    with pytest.raises(ConstraintViolation):
        narrow.apply(mx.zeros((1, vocab)))


@pytest.mark.parametrize("kind,value,names", [
    ("json_schema", json.dumps({"type": "object", "dependentSchemas": {"a": {}}}), "dependentSchemas"),
    ("json_schema", json.dumps({"type": "string", "pattern": "(?=a)b"}), "look-around"),
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", "[1, 2]", "JSON object"),
    ("regex", "(", "unclosed group"),
    ("lark", "start: foo", "unknown name"),
])
def test_unenforceable_constraints_are_refused_naming_why(tiny, kind, value, names):
    with pytest.raises(ConstraintError) as exc:
        compile_constraint(tiny, kind, value)
    assert names in str(exc.value)


# ---------------------------------------------------------------- decode paths


@pytest.mark.parametrize("kind,value", CASES)
def test_serial_output_matches_the_constraint(tiny, kind, value):
    out, c = serial_ref(tiny, tiny.encode_prompt(PROMPTS[0], None, None), kind, value)
    text, _ = text_of(tiny, out)
    assert c.complete or out[-1] in tiny.eos_token_ids, text
    check_output(kind, text)


@pytest.mark.parametrize("kind,value", CASES)
def test_exact_speculation_is_constrained_serial_token_for_token(tiny, head, kind, value):
    """Head drafts, prompt-lookup blocks and the adaptive stop, depths 1-3: exact
    speculation commits constrained serial decode's tokens (CPU: verify bit-identical)."""
    for text in PROMPTS:
        prompt = tiny.encode_prompt(text, None, None)
        ref, _ = serial_ref(tiny, prompt, kind, value)
        for depth, drafting in itertools.product((1, 2, 3), ({}, {"lookup": LookupConfig()},
                                                             {"lookup": LookupConfig(), "draft_stop": DraftStopConfig()})):
            c = compile_constraint(tiny, kind, value)
            gen = speculative_decode(tiny, head, prompt, Sampler(SamplingParams(), prompt, constraint=c), depth,
                                     exact=True, guard_margin=None, **drafting)
            got = decode(gen, len(ref), c)
            assert got == ref[: len(got)] and len(got) == len(ref), (text, depth, list(drafting))


@pytest.mark.parametrize("kind,value", CASES)
def test_sampled_speculation_output_matches_the_constraint(tiny, head, kind, value):
    prompt = tiny.encode_prompt(PROMPTS[1], None, None)
    for depth, seed in ((1, 1), (2, 2)):
        c = compile_constraint(tiny, kind, value)
        params = SamplingParams(temperature=0.8, seed=seed)
        gen = speculative_decode(tiny, head, prompt, Sampler(params, prompt, constraint=c), depth,
                                 lookup=LookupConfig())
        out = decode(gen, 80, c)
        text, _ = text_of(tiny, out)
        if c.complete or set(out) & tiny.eos_token_ids:
            check_output(kind, text)
        # Every token, EOS past the end included, is one a fresh matcher takes (it raises
        # on a forbidden one): the output, cut by length or not, is a prefix of the grammar.
        compile_constraint(tiny, kind, value).advance(out)


def test_batched_constrained_rows_are_their_serial_decodes(tiny):
    """Three constrained rows and one unconstrained row share each forward; every row
    decodes what it decodes alone (CPU batched logits are bit-identical to M=1)."""
    n = 24
    prompts = [tiny.encode_prompt(p, None, None) for p in PROMPTS + ["def add(a, b):\n"]]
    kinds = CASES[:1] + CASES[2:] + [None]
    refs = []
    for p, case in zip(prompts, kinds):
        if case is None:
            gen = serial_decode(tiny, p, Sampler(SamplingParams()))
            refs.append([s.tokens[0] for s in itertools.islice(gen, n)])
        else:
            c = compile_constraint(tiny, *case)
            gen = serial_decode(tiny, p, Sampler(SamplingParams(), p, constraint=c))
            refs.append([s.tokens[0] for s in itertools.islice(gen, n)])
    bd = BatchDecoder(tiny, max_rows=4)
    constraints = []
    for i, (p, case) in enumerate(zip(prompts, kinds)):
        c = compile_constraint(tiny, *case) if case is not None else None
        constraints.append(c)
        sampler = Sampler(SamplingParams(), p, constraint=c)
        assert bd.admits(sampler, exact=True)
        bd.add(i, sampler, p, exact=True)
    got: dict = {}
    for _ in range(n):
        for k, v in bd.step().items():
            got.setdefault(k, []).append(v)
    assert [got[i] for i in range(4)] == refs
    for c, case, out in zip(constraints, kinds, refs):
        if case is not None:
            assert c.floor == n  # each matcher took exactly the row's emitted tokens
            text, ended = text_of(tiny, out)
            if ended:
                check_output(case[0], text)


def test_constrained_rows_speculate_in_the_batch_as_they_decode_alone(tiny, head):
    """Constrained rows (every kind) beside an unconstrained one and a row with processors,
    in one speculating batch at depth 2: each row's drafts are drawn under its grammar, its
    verify is masked, its matcher settles on what it commits. Each row decodes its constrained
    serial decode's tokens (temperature 0, CPU: the batched verify is bit-identical), its
    output obeys its grammar, the constrained rows really drafted, and no grammar failed."""
    from daemon.engine.decoders.batch_spec import SpecBatchDecoder

    n = 28
    prompts = [tiny.encode_prompt(p, None, None) for p in PROMPTS + ["def add(a, b):\n", "x = 1\n"]]
    kinds = CASES[:1] + CASES[2:] + [None, CASES[1]]
    params = [SamplingParams()] * 4 + [SamplingParams(repetition_penalty=1.2)]
    refs = []
    for p, case, sp in zip(prompts, kinds, params):
        c = compile_constraint(tiny, *case) if case is not None else None
        refs.append(decode(serial_decode(tiny, p, Sampler(sp, p, constraint=c)), n, c))
    bd = SpecBatchDecoder(tiny, lambda: head, lambda B: 2)
    constraints = []
    for i, (p, case, sp) in enumerate(zip(prompts, kinds, params)):
        c = compile_constraint(tiny, *case) if case is not None else None
        constraints.append(c)
        sampler = Sampler(sp, p, constraint=c)
        assert bd.admits(sampler, exact=True)
        bd.add(i, sampler, p, exact=True)
    got = {i: [] for i in range(len(prompts))}
    drafted = {i: 0 for i in range(len(prompts))}
    while len(bd):
        for r, s in bd.step().items():
            got[r] += s.tokens
            drafted[r] += s.drafted
            c = constraints[r]
            assert c is None or c.error is None, c.error
            if c is not None and c.complete or len(got[r]) >= n or set(got[r]) & {0, 2}:
                assert c is None or c.floor == len(got[r])  # the matcher took exactly what the row committed
                bd.remove(r)
    for i, (case, ref) in enumerate(zip(kinds, refs)):
        assert got[i][: len(ref)] == ref, i
        if case is not None:
            assert drafted[i] > 0, i
            text, ended = text_of(tiny, ref)
            if ended:
                check_output(case[0], text)
