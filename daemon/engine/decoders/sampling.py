"""Per-request sampling with its own random key, and the request's logit processors.

One Sampler per request: the key lives in the request, so interleaved requests never share
random state and a seed reproduces a request whatever else the daemon is doing. The same
``log_distribution`` serves the serial sampler and speculation's p and q, which is what
keeps rejection sampling's output distribution exactly the base model's.

Logit processors (``process``), applied to raw logits in this order, at every temperature:
1. repetition_penalty r on every token seen in the prompt or the output so far
   (logit / r where positive, logit * r where negative; as in the CTRL paper and vLLM);
2. presence and frequency penalties on output tokens (OpenAI's definition:
   logit - presence * [count > 0] - frequency * count);
3. logit_bias, so a -100 ban is never undone by a penalty;
4. the request's constraint (constraint.py), last: -inf wherever its grammar forbids the
   token, so nothing before it can bring a forbidden token back.
Then the distribution: log-softmax, then (only when sampling) min_p, top-k, top-p, temperature.

A processor depends on the output so far, so speculation must give each verify row, and each
draft, the history it would have under serial decode: committed tokens plus the drafts before
it. ``process(logits, extra, start)`` does that: row r sees the committed history plus
``extra[:start + r]``. The committed counts live on the device and are updated lazily
(``commit``), so serial decode keeps issuing its next step before the current token is read.
The constraint is host state (a matcher over token ids): row r's mask is the matcher's state
after the committed tokens plus ``start + r`` drafts, so a path must ``advance`` the drafts
into ``constraint`` (and ``settle`` what it commits) before it builds those rows.
"""

from __future__ import annotations

import secrets

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from ..types import SamplingParams
from .constraint import TokenConstraint


# Temperatures below this sample as greedy (argmax). Scaling by 1/T overflows float32 for
# T below ~3e-39 (inf, then NaN where a logprob is 0), and long before that the scaled
# distribution is argmax to within sampling noise: at T = 1e-5 a logprob gap of 0.001
# already weighs e^-100. vLLM uses the same cut-off (_SAMPLING_EPS).
GREEDY_BELOW = 1e-5


def logprobs(logits: mx.array) -> mx.array:
    """Log-softmax over the vocabulary (the last axis)."""
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def near_tie(lp: mx.array, logits: mx.array, margin: float) -> mx.array:
    """Exact mode's guard, per row of logprobs [R, V]: top1 - top2 <= margin * max(1,
    |top1 logit|). top2 is the largest value left once the argmax is masked out, so it
    equals top1 when two entries tie (as ``mx.topk(lp, 2)`` would give): two reductions
    instead of a partial sort over the vocabulary (on CUDA a top-k over 248k entries costs
    more than the rest of the decision).
    """
    lp = lp.astype(mx.float32)
    hi = lp.max(axis=-1)
    top = mx.argmax(lp, axis=-1)
    rest = mx.where(mx.arange(lp.shape[-1])[None, :] == top[:, None], -mx.inf, lp)
    lo = rest.max(axis=-1)
    scale = mx.maximum(mx.abs(logits.max(axis=-1).astype(mx.float32)), 1.0)
    return (hi - lo) <= margin * scale


class Sampler:
    def __init__(self, params: SamplingParams, prompt: list[int] | None = None,
                 constraint: TokenConstraint | None = None):
        self.params = params
        # Constrained decoding: the grammar's mask, applied last in ``process``.
        self.constraint = constraint
        self.greedy = params.temperature < GREEDY_BELOW
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._key = mx.random.key(seed)
        self.processing = params.processes_logits
        self.wants_logprobs = params.logprobs
        self._prompt = list(prompt or []) if params.repetition_penalty != 1.0 else []
        self._counts: mx.array | None = None  # [V] float32: output token counts
        self._prompt_mask: mx.array | None = None  # [V] float32: 1 where the prompt has the token
        self._bias: mx.array | None = None
        self._pending: list[mx.array] = []  # committed before the vocabulary size was known

    def next_key(self) -> mx.array:
        self._key, sub = mx.random.split(self._key)
        return sub

    # ------------------------------------------------------------------ processors
    def _ensure(self, vocab: int) -> None:
        if self._counts is not None:
            return
        zeros = mx.zeros((vocab,), dtype=mx.float32)
        self._counts = zeros
        self._prompt_mask = zeros
        if self._prompt:
            ids = mx.array(sorted({t for t in self._prompt if t < vocab}), dtype=mx.uint32)
            self._prompt_mask = zeros.at[ids].add(1.0)
        bias = {t: b for t, b in (self.params.logit_bias or {}).items() if 0 <= t < vocab}
        if bias:
            self._bias = zeros.at[mx.array(list(bias), dtype=mx.uint32)].add(mx.array(list(bias.values()), dtype=mx.float32))
        for tokens in self._pending:
            self.commit(tokens)
        self._pending = []

    def commit(self, tokens) -> None:
        """Count committed output tokens (an mx array or a list of ids); lazy on the device."""
        if not self.processing:
            return
        idx = tokens.reshape(-1).astype(mx.uint32) if isinstance(tokens, mx.array) else mx.array(list(tokens), dtype=mx.uint32)
        if idx.size == 0:
            return
        if self._counts is None:
            self._pending.append(idx)
            return
        self._counts = self._counts.at[idx].add(1.0)

    def process(self, logits: mx.array, extra: mx.array | None = None, start: int = 0) -> mx.array:
        """The request's processors over logits [R, V]; row r sees the committed history plus
        ``extra[:start + r]`` (drafts not yet committed). Identity (the same array) when the
        request has no processors and no constraint, so such requests run exactly the ops
        they always ran."""
        if self.processing:
            logits = self._penalise(logits, extra, start)
        if self.constraint is not None:
            logits = self.constraint.apply(logits, start)
        return logits

    def _penalise(self, logits: mx.array, extra: mx.array | None, start: int) -> mx.array:
        p = self.params
        logits = logits.astype(mx.float32)
        rows, vocab = logits.shape[-2], logits.shape[-1]
        self._ensure(vocab)
        counts = self._counts[None]
        if extra is not None and extra.size > 0 and start + rows - 1 > 0:
            extra = extra.reshape(-1)
            onehot = (extra[:, None] == mx.arange(vocab, dtype=extra.dtype)[None]).astype(mx.float32)
            # prefix[i] = counts of extra[:i]
            prefix = mx.concatenate([mx.zeros((1, vocab), dtype=mx.float32), mx.cumsum(onehot, axis=0)], axis=0)
            counts = counts + prefix[start : start + rows]
        if p.repetition_penalty != 1.0:
            seen = (counts + self._prompt_mask[None]) > 0
            r = p.repetition_penalty
            logits = mx.where(seen, mx.where(logits > 0, logits / r, logits * r), logits)
        if p.presence_penalty != 0.0:
            logits = logits - p.presence_penalty * (counts > 0).astype(mx.float32)
        if p.frequency_penalty != 0.0:
            logits = logits - p.frequency_penalty * counts
        if self._bias is not None:
            logits = logits + self._bias[None]
        return logits

    # ------------------------------------------------------------------ distribution
    def log_distribution(self, logprobs: mx.array) -> mx.array:
        """Normalised log-probabilities of the distribution this request samples from:
        min-p, top-k, then top-p on the (processed) logprobs, then the temperature."""
        p = self.params
        if p.min_p > 0.0:
            logprobs = apply_min_p(logprobs, p.min_p)
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

    # ------------------------------------------------------------------ reporting
    def logprob_arrays(self, logprobs: mx.array, tokens: mx.array) -> tuple | None:
        """Lazy (chosen [R], top ids [R, n], top values [R, n]) for rows of processed,
        normalised logprobs [R, V] and the tokens chosen at them; None unless asked for."""
        if not self.wants_logprobs:
            return None
        lp = logprobs.astype(mx.float32)
        chosen = mx.take_along_axis(lp, tokens.reshape(-1, 1).astype(mx.int32), axis=-1)[:, 0]
        n = min(self.params.top_logprobs, lp.shape[-1])
        if n == 0:
            return chosen, None, None
        part = mx.argpartition(-lp, kth=n - 1, axis=-1)[:, :n] if n < lp.shape[-1] else mx.argsort(-lp, axis=-1)
        order = mx.argsort(-mx.take_along_axis(lp, part, axis=-1), axis=-1)
        top_ids = mx.take_along_axis(part, order, axis=-1)
        return chosen, top_ids, mx.take_along_axis(lp, top_ids, axis=-1)


def logprob_entries(arrays: tuple | None, rows: int | None = None) -> list[tuple[float, list[tuple[int, float]]]] | None:
    """Python values of ``Sampler.logprob_arrays`` (first ``rows`` rows); syncs the device."""
    if arrays is None:
        return None
    chosen, ids, vals = arrays
    c = chosen.tolist()
    rows = len(c) if rows is None else rows
    if ids is None:
        return [(c[i], []) for i in range(rows)]
    il, vl = ids.tolist(), vals.tolist()
    return [(c[i], list(zip(il[i], vl[i]))) for i in range(rows)]
