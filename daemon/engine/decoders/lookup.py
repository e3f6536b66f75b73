"""Prompt-lookup drafting, and the per-request early stop of the head's drafting.

Prompt lookup: when the last n tokens of prompt + output so far (n from ``max_ngram`` down
to ``min_ngram``) occurred before, the tokens that followed that earlier occurrence are
proposed as a draft block and verified in one base forward, as the head's drafts are.
Councils edit code and continue tables they hold in context, so such blocks are often long
and right, and they cost no head forward. The proposal is a deterministic function of the
context, so for rejection sampling its q is a point mass: accept x with probability p(x),
on reject sample from p with x removed and renormalised (speculative.py builds q as a
one-hot row and the usual rule does exactly that).

It backs off when it does not pay: a lookup cycle that accepts nothing costs a wider
verify for one token, so after a miss lookup sleeps for 2, 4, 8, ... cycles (up to
``max_skip``; one accepted token resets it) and its block length halves; a block that
breaks off after a tokens caps the next at 2a (at least 2); a fully accepted block
doubles the length back, up to ``max_draft``.

DraftStop (per-request depth): past ``base`` draft positions, the head drafts the next
position only while (prefix confidence) x (this request's running acceptance) covers the
cost of one more position (``threshold``, in serial steps). Prefix confidence is the product
of the head's top-1 probabilities so far: a property of its distribution, never of the
token sampled from it, so at temperature > 0 the proposal for every position drafted is
still q and rejection sampling stays exact.

Nothing here imports mlx: both are plain bookkeeping over token ids and numbers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LookupConfig:
    min_ngram: int = 3
    max_ngram: int = 6
    max_draft: int = 8
    max_skip: int = 32


class PromptLookup:
    """N-gram index over one request's tokens; proposes continuations and backs off."""

    def __init__(self, tokens: list[int], cfg: LookupConfig = LookupConfig()):
        if not 1 <= cfg.min_ngram <= cfg.max_ngram or cfg.max_draft < 1:
            raise ValueError(f"bad lookup config {cfg}")
        self.cfg = cfg
        self.seq: list[int] = []
        # n -> {n-gram: end index of its latest occurrence}
        self._index: dict[int, dict[tuple, int]] = {n: {} for n in range(cfg.min_ngram, cfg.max_ngram + 1)}
        # n -> end index of the latest occurrence of the current tail n-gram before the tail
        self._match: dict[int, int | None] = {n: None for n in self._index}
        self.cap = cfg.max_draft
        self.misses = 0
        self.skip = 0
        # telemetry
        self.cycles = self.drafted = self.accepted = self.skipped = 0
        self.extend(tokens)

    def extend(self, tokens) -> None:
        """Append committed tokens (run past an EOS or not: they are context either way)."""
        seq = self.seq
        for t in tokens:
            seq.append(int(t))
            end = len(seq)
            for n, index in self._index.items():
                if end < n:
                    self._match[n] = None
                    continue
                key = tuple(seq[end - n : end])
                self._match[n] = index.get(key)
                index[key] = end

    def peek(self) -> list[int]:
        """The continuation of the longest tail n-gram seen before, up to ``cap`` tokens."""
        for n in sorted(self._index, reverse=True):
            e = self._match[n]
            if e is not None:
                return self.seq[e : e + self.cap]
        return []

    def propose(self) -> list[int]:
        """The draft block for the next cycle, or [] (no match, or backing off)."""
        if self.skip > 0:
            self.skip -= 1
            self.skipped += 1
            return []
        return self.peek()

    def record(self, drafted: int, accepted: int) -> None:
        """The outcome of a cycle that verified a lookup block."""
        self.cycles += 1
        self.drafted += drafted
        self.accepted += accepted
        if accepted == 0:
            self.misses += 1
            self.skip = min(2**self.misses, self.cfg.max_skip)
            self.cap = max(1, self.cap // 2)
        else:
            self.misses = 0
            if accepted >= drafted:
                self.cap = min(self.cfg.max_draft, self.cap * 2)
            else:  # the copy broke off: the next block is as long as twice what held
                self.cap = max(2, min(self.cap, 2 * accepted))


@dataclass(frozen=True)
class DraftStopConfig:
    # Cost of drafting and verifying one more position, in serial steps: the head step plus
    # the verify's growth per token (bundled model on this CPU: a 2-token forward costs
    # ~1.33 steps, bench/results/spec_cpu_tiny_qwen35.md).
    threshold: float = 0.35
    # Positions always drafted (up to the governor's depth) before the rule applies.
    base: int = 1
    # EWMA weight of the running acceptance.
    alpha: float = 0.1


class DraftStop:
    """Per-request decision to stop a cycle's head drafting early."""

    def __init__(self, cfg: DraftStopConfig = DraftStopConfig()):
        self.cfg = cfg
        self.acceptance = 1.0  # running conditional acceptance of head positions
        self.n = 0
        self.stops = 0

    def more(self, position: int, prefix_confidence: float) -> bool:
        """Draft position ``position + 1``, given positions 1..position are drafted and the
        product of their top-1 probabilities is ``prefix_confidence``?"""
        if position < self.cfg.base:
            return True
        go = prefix_confidence * self.acceptance >= self.cfg.threshold
        if not go:
            self.stops += 1
        return go

    def record(self, drafted: int, accepted: int) -> None:
        """Conditional acceptance of the positions judged (accepted ones, then one miss)."""
        judged = [1.0] * accepted + ([0.0] if accepted < drafted else [])
        for x in judged:
            self.n += 1
            w = max(self.cfg.alpha, 1.0 / self.n)
            self.acceptance += w * (x - self.acceptance)
