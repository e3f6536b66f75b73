"""Logit processors (penalties, logit_bias), min_p and logprobs: serial and speculative alike."""

from __future__ import annotations

import itertools
import math

import mlx.core as mx
import pytest

from daemon.measure.fidelity import PROCESSORS, run_fidelity_gate
from daemon.engine.model.loading import load_model
from daemon.engine.decoders.sampling import Sampler
from daemon.engine.decoders.serial import serial_decode
from daemon.engine.decoders.speculative import speculative_decode
from daemon.engine.types import SamplingParams

from model_helpers import make_copy_head

PROMPT = "def load(path):\n    with open(path) as f:"


@pytest.fixture(scope="module")
def lm(random_model_path):
    return load_model(random_model_path)


@pytest.fixture(scope="module")
def copy_head(lm, tmp_path_factory):
    """A head that drafts what the base model would say, so drafts are accepted and the
    processors' per-row history (committed + earlier drafts) is exercised."""
    return make_copy_head(lm, tmp_path_factory.mktemp("copyhead-opts"))


def serial_steps(lm, prompt, n, params):
    return list(itertools.islice(serial_decode(lm, prompt, Sampler(params, prompt=prompt)), n))


@pytest.mark.quick
def test_processors_change_greedy_output_and_ban_works(lm):
    prompt = lm.tokenizer.encode(PROMPT)
    plain = [s.tokens[0] for s in serial_steps(lm, prompt, 24, SamplingParams())]
    banned = plain[0]
    pen = [s.tokens[0] for s in serial_steps(lm, prompt, 24, SamplingParams(**PROCESSORS))]
    assert pen != plain
    ban = [s.tokens[0] for s in serial_steps(lm, prompt, 24, SamplingParams(logit_bias={banned: -100.0}))]
    assert banned not in ban
    # A strong frequency penalty on a model that repeats itself: fewer repeats.
    freq = [s.tokens[0] for s in serial_steps(lm, prompt, 24, SamplingParams(frequency_penalty=2.0))]
    assert len(set(freq)) >= len(set(plain))


def test_exact_speculation_with_processors_is_token_identical(lm, copy_head):
    report = run_fidelity_gate(lm, copy_head, [PROMPT, "import json\n\nclass Encoder:"], depths=(1, 3), max_tokens=24,
                               modes=("exact",), params=SamplingParams(**PROCESSORS))
    assert report.passed, [a.first_divergence for a in report.arms]
    assert all(a.processors for a in report.arms)
    assert sum(a.accepted for a in report.arms) > 0  # drafts were accepted: rows saw earlier drafts


def test_the_gate_catches_processors_that_ignore_drafts(lm, copy_head, monkeypatch):
    orig = Sampler.process
    monkeypatch.setattr(Sampler, "process", lambda self, logits, extra=None, start=0: orig(self, logits))
    report = run_fidelity_gate(lm, copy_head, [PROMPT, "import json\n\nclass Encoder:"], depths=(1, 3), max_tokens=24,
                               modes=("exact",), params=SamplingParams(**PROCESSORS))
    assert not report.passed


def test_logprobs_serial_and_speculative_agree(lm, copy_head):
    prompt = lm.tokenizer.encode(PROMPT)
    params = SamplingParams(logprobs=True, top_logprobs=3, **PROCESSORS)
    ser = serial_steps(lm, prompt, 12, params)
    ref = [(s.tokens[0], s.logprobs[0]) for s in ser]
    for tok, (lp, top) in ref:
        assert len(top) == 3 and top[0][0] == tok  # greedy: the chosen token is the most likely
        assert lp == pytest.approx(top[0][1]) and lp <= 0.0
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        assert sum(math.exp(v) for _, v in top) <= 1.0 + 1e-4
    got = []
    for step in speculative_decode(lm, copy_head, prompt, Sampler(params, prompt=prompt), 2, exact=True):
        assert step.logprobs is not None and len(step.logprobs) == len(step.tokens)
        got += list(zip(step.tokens, step.logprobs))
        if len(got) >= 12:
            break
    for (t1, (lp1, top1)), (t2, (lp2, top2)) in zip(ref, got[:12]):
        assert t1 == t2
        assert lp1 == pytest.approx(lp2, abs=1e-4)
        assert [t for t, _ in top1] == [t for t, _ in top2]


def test_min_p_keeps_only_likely_tokens(lm):
    prompt = lm.tokenizer.encode(PROMPT)
    s = Sampler(SamplingParams(temperature=1.0, min_p=0.5), prompt=prompt)
    lp = mx.log(mx.array([[0.5, 0.3, 0.2]]))
    dist = mx.exp(s.log_distribution(lp)).tolist()[0]
    assert dist[2] == 0.0 and dist[1] > 0.0  # 0.2 < 0.5 * 0.5 <= 0.3
