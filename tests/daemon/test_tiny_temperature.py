"""Any representable temperature is safe: below GREEDY_BELOW a request
samples as greedy, on the serial path, the speculative path (exact and fast) and in the
continuous batch; just above it, sampling stays finite and picks the argmax here."""

from __future__ import annotations

import itertools

import pytest

from daemon.engine.decoders.batch import BatchDecoder
from daemon.engine.decoders.sampling import GREEDY_BELOW, Sampler
from daemon.engine.decoders.serial import serial_decode
from daemon.engine.decoders.speculative import speculative_decode
from daemon.engine.types import SamplingParams

TINY = [5e-324, 1e-45, 1e-40, 1e-38, 1e-20, GREEDY_BELOW / 2]
N = 12


@pytest.fixture(scope="module")
def prompt(lm):
    return lm.tokenizer.encode("def load(path):\n    with open(path) as f:")


def _serial(lm, prompt, temperature, seed=3):
    steps = itertools.islice(serial_decode(lm, prompt, Sampler(SamplingParams(temperature=temperature, seed=seed))), N)
    return [t for s in steps for t in s.tokens]


def _spec(lm, head, prompt, temperature, exact, seed=3):
    out = []
    for s in speculative_decode(lm, head, prompt, Sampler(SamplingParams(temperature=temperature, seed=seed)), 2,
                                exact=exact):
        out += s.tokens
        if len(out) >= N:
            return out[:N]


def test_tiny_temperatures_are_greedy_on_every_path(lm, head, prompt):
    greedy = _serial(lm, prompt, 0.0)
    assert len(greedy) == N
    for t in TINY:
        assert Sampler(SamplingParams(temperature=t)).greedy, t
        assert _serial(lm, prompt, t) == greedy, t
        for exact in (True, False):
            assert _spec(lm, head, prompt, t, exact) == greedy, (t, exact)


def test_tiny_temperatures_in_the_batch(lm, prompt):
    greedy = _serial(lm, prompt, 0.0)
    batch = BatchDecoder(lm, max_rows=2)
    batch.add("a", Sampler(SamplingParams(temperature=1e-40, seed=1)), prompt, exact=False)
    batch.add("b", Sampler(SamplingParams(temperature=GREEDY_BELOW / 10, seed=2)), prompt, exact=False)
    got = {"a": [], "b": []}
    while len(got["a"]) < N:
        for key, token in batch.step().items():
            got[key].append(token)
    assert got["a"][:N] == greedy and got["b"][:N] == greedy


def test_temperature_just_above_the_cut_off_stays_finite(lm, prompt):
    import mlx.core as mx

    sampler = Sampler(SamplingParams(temperature=GREEDY_BELOW * 2, seed=0))
    assert not sampler.greedy
    logits = lm.logits(lm.hidden(mx.array([prompt]), lm.make_cache()))[:, -1, :]
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    dist = sampler.log_distribution(logprobs)
    assert bool(mx.all(mx.isfinite(mx.max(dist, axis=-1))).item())
    assert _serial(lm, prompt, GREEDY_BELOW * 2) == _serial(lm, prompt, 0.0)
