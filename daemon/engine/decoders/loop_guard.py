"""A loop guard for sampled requests: detect repetition, then a DRY-style penalty.

Small models (and large ones at low temperature) fall into loops: the same line again and
again until max_tokens. The guard watches the request's output; once its tail is periodic
(a unit of 1..``max_period`` tokens repeated ``min_repeats`` times, spanning at least
``min_span`` tokens) it arms a DRY ("don't repeat yourself") penalty: a token that would
extend a repeat of the context's suffix of length n >= ``allowed_length`` loses
``multiplier * base ** (n - allowed_length)`` from its logprob. It disarms after
``cooldown`` tokens with no loop seen.

Only sampled requests get a guard (the caller never builds one at temperature 0), so exact
greedy output is never touched. While armed, a request decodes with serial steps: the
penalty depends on every token before it, and serial steps keep the sampled distribution
exactly the penalised one (no proposal to reconcile).

No mlx here: the penalty is a {token: amount} map the decode loop turns into a bias row.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoopGuardConfig:
    max_period: int = 32
    min_repeats: int = 3
    min_span: int = 24
    # DRY penalty (the defaults its authors suggest)
    multiplier: float = 0.8
    base: float = 1.75
    allowed_length: int = 2
    window: int = 512  # context tokens searched for repeats
    max_match: int = 16  # longer matches are penalised as this long (keeps base**n finite)
    cooldown: int = 64


def periodic_tail(seq: list[int], cfg: LoopGuardConfig) -> int | None:
    """The smallest period p such that the tail of ``seq`` repeats a p-token unit at least
    ``min_repeats`` times over at least ``min_span`` tokens; None when there is none."""
    n = len(seq)
    for p in range(1, cfg.max_period + 1):
        span = max(p * cfg.min_repeats, cfg.min_span)
        if span > n:
            break
        tail = seq[n - span :]
        if all(tail[i] == tail[i + p] for i in range(span - p)):
            return p
    return None


def dry_penalty(context: list[int], cfg: LoopGuardConfig) -> dict[int, float]:
    """{token: logprob penalty} for tokens that would extend a repeat of the context's
    suffix: for each earlier occurrence of the last token, the length n of the match ending
    there; the token that followed it is penalised by the longest such n."""
    tail = context[-cfg.window :]
    n = len(tail)
    if n < 2:
        return {}
    last = tail[-1]
    longest: dict[int, int] = {}
    for j in range(n - 1):
        if tail[j] != last:
            continue
        m = 1
        while m <= j and m < cfg.max_match and tail[j - m] == tail[n - 1 - m]:
            m += 1
        cand = tail[j + 1]
        if m > longest.get(cand, 0):
            longest[cand] = m
    return {t: cfg.multiplier * cfg.base ** (m - cfg.allowed_length)
            for t, m in longest.items() if m >= cfg.allowed_length}


class LoopGuard:
    """Per-request state: the output so far, armed or not, and what it did."""

    def __init__(self, prompt: list[int], cfg: LoopGuardConfig = LoopGuardConfig()):
        self.cfg = cfg
        self.context = list(prompt[-cfg.window :])
        self.output: list[int] = []
        self.armed = False
        self.quiet = 0  # tokens since a loop was last seen, while armed
        self.arms = 0  # times armed
        self.penalised = 0  # steps decoded with a penalty

    def extend(self, tokens: list[int]) -> None:
        self.context.extend(tokens)
        if len(self.context) > 2 * self.cfg.window:
            del self.context[: len(self.context) - self.cfg.window]
        self.output.extend(tokens)
        del self.output[: max(0, len(self.output) - 2 * self.cfg.max_period * self.cfg.min_repeats - self.cfg.min_span)]
        looping = periodic_tail(self.output, self.cfg) is not None
        if looping:
            if not self.armed:
                self.arms += 1
            self.armed, self.quiet = True, 0
        elif self.armed:
            self.quiet += len(tokens)
            if self.quiet >= self.cfg.cooldown:
                self.armed = False

    def penalty(self) -> dict[int, float]:
        """The penalty for the next token ({} when disarmed)."""
        if not self.armed:
            return {}
        self.penalised += 1
        return dry_penalty(self.context, self.cfg)
