"""Per-request sampling with its own random key.

One Sampler per request: the key lives in the request, so interleaved requests never share
random state and a seed reproduces a request whatever else the daemon is doing. The same
``log_distribution`` serves the serial sampler and speculation's p and q, which is what
keeps rejection sampling's output distribution exactly the base model's.
"""

from __future__ import annotations

import secrets

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_k, apply_top_p

from .types import SamplingParams


# Temperatures below this sample as greedy (argmax). Scaling by 1/T overflows float32 for
# T below ~3e-39 (inf, then NaN where a logprob is 0), and long before that the scaled
# distribution is argmax to within sampling noise: at T = 1e-5 a logprob gap of 0.001
# already weighs e^-100. vLLM uses the same cut-off (_SAMPLING_EPS).
GREEDY_BELOW = 1e-5


def logprobs(logits: mx.array) -> mx.array:
    """Log-softmax over the vocabulary (the last axis)."""
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.greedy = params.temperature < GREEDY_BELOW
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._key = mx.random.key(seed)

    def next_key(self) -> mx.array:
        self._key, sub = mx.random.split(self._key)
        return sub

    def log_distribution(self, logprobs: mx.array) -> mx.array:
        """Normalised log-probabilities of the distribution this request samples from:
        top-k, then top-p on the model's logprobs, then the temperature."""
        p = self.params
        if p.top_k > 0 and p.top_k < logprobs.shape[-1]:
            logprobs = apply_top_k(logprobs, p.top_k)
        if 0.0 < p.top_p < 1.0:
            logprobs = apply_top_p(logprobs, p.top_p)
        scaled = logprobs * (1.0 / p.temperature)
        return scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)

    def __call__(self, logprobs: mx.array) -> mx.array:
        """Pick the next token from logprobs of shape [..., vocab]."""
        if self.greedy:
            return mx.argmax(logprobs, axis=-1)
        return mx.random.categorical(self.log_distribution(logprobs), key=self.next_key())
