"""Prompt lookup's proposals and back-off, and the per-request draft stop (pure bookkeeping),
then both inside speculative_decode: token-identical to serial at temperature 0."""

from __future__ import annotations

import itertools

import pytest

from daemon.engine.decoders.lookup import DraftStop, DraftStopConfig, LookupConfig, PromptLookup


@pytest.mark.quick
def test_proposes_the_continuation_of_the_longest_earlier_match():
    f = PromptLookup([1, 2, 3, 4, 5, 9, 9, 2, 3, 4], LookupConfig(min_ngram=2, max_ngram=3, max_draft=4))
    assert f.propose() == [5, 9, 9, 2]  # "2 3 4" occurred before, followed by 5 9 9 2
    f.extend([7])
    assert f.propose() == []  # "4 7" and "3 4 7" never occurred
    g = PromptLookup([5, 6, 1, 2, 8, 8, 5, 6, 1, 2, 9, 1, 2], LookupConfig(min_ngram=2, max_ngram=3, max_draft=3))
    assert g.propose() == [9, 1, 2]  # the latest occurrence of "1 2" wins ...
    g.extend([8])
    assert g.propose() == [8, 5, 6]  # ... and the longest n-gram: "1 2 8" beats "2 8"


@pytest.mark.quick
def test_backs_off_after_misses_and_recovers_on_hits():
    cfg = LookupConfig(min_ngram=1, max_ngram=1, max_draft=8, max_skip=8)
    f = PromptLookup([1, 2, 1], cfg)
    assert f.propose() == [2, 1]
    f.record(drafted=2, accepted=0)  # miss: sleep 2 cycles, halve the block
    assert (f.skip, f.cap) == (2, 4)
    assert f.propose() == [] and f.propose() == [] and f.propose() == [2, 1]
    f.record(2, 0)
    f.record(2, 0)
    f.record(2, 0)
    assert f.skip == 8 and f.cap == 1  # capped at max_skip; never below one token
    f.skip = 0
    f.record(1, 1)  # a full accept resets the misses and doubles the block
    assert (f.misses, f.cap) == (0, 2)
    f.record(2, 2)
    f.record(4, 4)
    assert f.cap == 8
    f.record(8, 3)  # broke off after 3: the next block is at most 6
    assert f.cap == 6 and (f.cycles, f.drafted, f.accepted) == (8, 23, 10)


@pytest.mark.quick
def test_draft_stop_weighs_confidence_by_running_acceptance():
    s = DraftStop(DraftStopConfig(threshold=0.5, base=1, alpha=0.5))
    assert s.more(0, 0.01)  # below base: always draft
    assert s.more(1, 0.6) and not s.more(1, 0.4)
    s.record(drafted=3, accepted=0)  # one judged position, rejected: acceptance -> 0
    assert s.acceptance == 0.0 and not s.more(1, 0.99)
    s.record(3, 3)
    assert 0.5 < s.acceptance < 1.0 and s.stops == 2


# -- inside speculative_decode ----------------------------------------------------------------

from daemon.engine.model.loading import load_model  # noqa: E402
from daemon.engine.decoders.sampling import Sampler  # noqa: E402
from daemon.engine.decoders.serial import serial_decode  # noqa: E402
from daemon.engine.decoders.speculative import speculative_decode  # noqa: E402
from daemon.engine.types import SamplingParams  # noqa: E402
from model_helpers import make_copy_head  # noqa: E402

QUOTING = "def f(a, b):\n    total = a + b\n    return total\n\ndef f(a, b):\n"


@pytest.fixture(scope="module")
def lm(random_model_path):
    return load_model(random_model_path)


@pytest.fixture(scope="module")
def copy_head(lm, tmp_path_factory):
    return make_copy_head(lm, tmp_path_factory.mktemp("copyhead-lookup"))


def _serial(lm, prompt, n):
    return [t for s in itertools.islice(serial_decode(lm, prompt, Sampler(SamplingParams())), n) for t in s.tokens]


def _spec(lm, head, prompt, n, depth, **kw):
    out, steps = [], []
    for s in speculative_decode(lm, head, prompt, Sampler(SamplingParams()), depth, **kw):
        out += s.tokens
        steps.append(s)
        assert len(s.tokens) == s.accepted + 1 and len(s.accepted_mask) == s.drafted
        if len(out) >= n:
            return out[:n], steps


@pytest.mark.parametrize("depth", [0, 1, 3])
@pytest.mark.parametrize("exact", [True, False])
def test_lookup_and_draft_stop_are_token_identical(lm, copy_head, depth, exact):
    prompt = lm.tokenizer.encode(QUOTING)
    ref = _serial(lm, prompt, 48)
    got, steps = _spec(lm, copy_head, prompt, 48, depth, exact=exact, lookup=LookupConfig(),
                       draft_stop=DraftStopConfig())
    assert got == ref
    sources = {s.draft_source for s in steps if s.drafted}
    assert "lookup" in sources  # the prompt's tail recurs: a block was verified
    if depth:
        assert "head" in sources


def test_lookup_runs_without_a_head(lm):
    prompt = lm.tokenizer.encode(QUOTING)
    got, steps = _spec(lm, None, prompt, 40, 2, lookup=LookupConfig())
    assert got == _serial(lm, prompt, 40)
    assert any(s.draft_source == "lookup" and s.accepted for s in steps)


def test_draft_stop_stops_below_the_ceiling(lm, copy_head):
    prompt = lm.tokenizer.encode("import json\n\nclass Encoder:")
    ref = _serial(lm, prompt, 40)
    # A threshold no draft can meet: every head cycle stops at the base depth.
    got, steps = _spec(lm, copy_head, prompt, 40, 4, draft_stop=DraftStopConfig(threshold=2.0, base=1))
    assert got == ref
    assert {s.depth for s in steps if s.drafted} == {1}
    got, steps = _spec(lm, copy_head, prompt, 40, 4, draft_stop=DraftStopConfig(threshold=0.0, base=1))
    assert got == ref and max(s.depth for s in steps) == 4  # a threshold of 0 never stops
