"""The serial decode path: one token per step, as a generator.

Built on the same model halves as speculation (``LoadedModel.hidden`` + ``logits``) so that
the fidelity gate compares like with like; the next step is queued with ``async_eval``
before the current token is handed out, as mlx-lm's ``generate_step`` does, so Python's
per-step overhead overlaps the device's work. Under a constraint the mask of step n+1
depends on token n, which the host reads first: the forward of step n+1 is still queued
before that read, and only its masking and sampling wait for the mask.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import mlx.core as mx

from ..model.model import LoadedModel
from ..prefill.prefill import prefill
from ..types import DecodeStep
from .sampling import Sampler, logprob_entries

# With a head history, the pairs a serial decode adds are fed to the head this many at a time
# (one head forward over them, as a prefill's chunk does), so the pending ones stay few.
HISTORY_FEED_EVERY = 32


def serial_decode(lm: LoadedModel, prompt: list[int], sampler: Sampler, cache: list | None = None,
                  history=None) -> Iterator[DecodeStep]:
    """Yield one DecodeStep per token, forever; the caller decides when to stop.

    ``history`` (a HeadHistory at the cache's position, or None): the MTP head's history,
    kept in step with the tokens decoded although nothing here drafts, so that the request's
    continuation (prefix_cache.store_final) serves a next turn that speculates. The head's
    work is its own arrays: the tokens are serial decode's, bit for bit."""
    if not prompt:
        raise ValueError("serial_decode needs at least one prompt token")
    if history is not None and len(prompt) != 1:
        raise ValueError("with a head history, serial_decode continues a prefilled cache: one prompt token")
    cache = cache if cache is not None else lm.make_cache()
    pairs = 0

    def forward(tokens: mx.array) -> tuple[mx.array, mx.array]:
        h = lm.hidden(tokens[None], cache)
        return lm.logits(h)[:, -1, :], h

    def decide(step: tuple[mx.array, mx.array]) -> tuple[mx.array, tuple | None]:
        nonlocal history, pairs
        logits, h = step
        # process() is the identity (same array) for a request without logit processors.
        logits = sampler.process(logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        y = sampler(logprobs).reshape(-1)
        sampler.commit(y)  # lazy: the next step's penalties count y
        if history is not None and history.head_evicted:
            history = None  # the governor evicted the head: nothing will speculate from this
        if history is not None:
            history.add(h[:, -1:], y)  # (hidden at this position, the token after it)
            pairs += 1
            if pairs % HISTORY_FEED_EVERY == 0:
                history.feed(keep_last=True)
                mx.async_eval(history.state())  # queued now: no lazy chain across feeds
        return y, sampler.logprob_arrays(logprobs, y)

    constraint = sampler.constraint
    y, lps = decide(forward(prefill(lm, prompt, cache)))
    mx.async_eval(y)
    t0 = time.perf_counter()
    n = 0
    while True:
        if constraint is None:
            next_y, next_lps = decide(forward(y))
            mx.async_eval(next_y)
            token = y.item()
        else:
            # The next mask depends on this token, known on the host only once it is read:
            # queue the next forward first, so the device runs it while the matcher takes the
            # token and computes the mask (llguidance releases the GIL), then decide.
            step = forward(y)
            mx.async_eval(step[0])
            token = y.item()
            constraint.settle([token])
            next_y, next_lps = decide(step)
            mx.async_eval(next_y)
        now = time.perf_counter()
        yield DecodeStep(tokens=[token], cycle_s=now - t0, logprobs=logprob_entries(lps))
        t0 = now
        n += 1
        if n % 256 == 0:
            mx.clear_cache()
        y, lps = next_y, next_lps
