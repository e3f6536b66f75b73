"""A prompt's prefill as resumable units of work, one chunk per ``step()``.

The engine thread runs one chunk, then goes back round its loop (commands, cancels,
deadlines, the watchdog, other streams' decode steps) before the next, so a long prompt
slows the council instead of stopping it. Each chunk is the same computation as one
iteration of ``prefill`` below (and, with a head history, of
``speculative.prefill_with_hidden``): all prompt tokens but the last go through the model,
the last is left for the first decode step, which then continues from ``cache`` (and
``history``) exactly as serial or speculative decode would after their own prefill.

``start`` > 0 continues a cache that already holds ``prompt[:start]`` (a prefix-cache hit).
``stops``: positions a chunk must end at (where the prefix cache takes a snapshot: a
message's or the prompt's exact end), on a backend where splitting a prefill there leaves
the same state as the cold run's grid (prefix_cache.py ``splits_agree``); without them the
chunks are [start, start + chunk), ... as before.

``step(limit)`` cuts the piece at ``limit`` tokens as well, and ``next_piece(limit)`` says how
long it will be: batched_prefill.prefill_together forwards several requests' pieces of one
common length in one forward and then does each one's bookkeeping (``check_head``,
``absorb``) as ``step`` does, so the two paths cannot drift apart.
"""

from __future__ import annotations

import mlx.core as mx

from ..model.model import LoadedModel


PREFILL_CHUNK = 2048


def prefill(lm: LoadedModel, prompt: list[int], cache: list, chunk: int = PREFILL_CHUNK) -> mx.array:
    """Run all prompt tokens but the last through the model in chunks; return the last
    token (as a [1] array) for the first decode step."""
    ids = mx.array(prompt, dtype=mx.uint32)
    while ids.size > 1:
        n = min(chunk, ids.size - 1)
        lm.prefill_hidden(ids[None, :n], cache)
        mx.eval([c.state for c in cache])
        ids = ids[n:]
    return ids


class ChunkedPrefill:
    def __init__(self, lm: LoadedModel, prompt: list[int], chunk: int, cache: list, history=None, start: int = 0,
                 stops=()):
        if not prompt:
            raise ValueError("a prefill needs at least one prompt token")
        if not 0 <= start < len(prompt):
            raise ValueError(f"start {start} outside a {len(prompt)}-token prompt (the last token is never prefilled)")
        self.lm = lm
        self.prompt = prompt
        self.chunk = max(1, int(chunk))
        self.cache = cache
        self.history = history
        self.start = start
        self.pos = start  # tokens of the prompt that are in the cache
        self.ids = mx.array(prompt, dtype=mx.uint32)
        self.stops = sorted(p for p in set(stops) if start < p < self.total)

    @property
    def total(self) -> int:
        """Tokens this prefill forwards in all: the prompt less its last token."""
        return len(self.prompt) - 1

    @property
    def done(self) -> bool:
        return self.pos >= self.total

    @property
    def last_token(self) -> int:
        return self.prompt[-1]

    def next_piece(self, limit: int | None = None) -> int:
        """How many tokens the next step forwards (0 when done): the chunk, cut at the next
        stop, at what is left, and at ``limit`` (a together step's common length)."""
        if self.done:
            return 0
        if limit is not None and limit < 1:
            raise ValueError(f"a piece limit must be at least 1 token (got {limit})")
        while self.stops and self.stops[0] <= self.pos:
            self.stops.pop(0)
        n = min(self.chunk, self.total - self.pos)
        if self.stops:
            n = min(n, self.stops[0] - self.pos)
        return n if limit is None else min(n, int(limit))

    def step(self, limit: int | None = None) -> int:
        """Forward the next piece (at most ``limit`` tokens); return how many tokens it held
        (0 when done)."""
        n = self.next_piece(limit)
        if n == 0:
            return 0
        self.check_head()
        h = self.lm.prefill_hidden(self.piece_ids(n)[None], self.cache)  # chunked GatedDeltaNet where enabled
        mx.eval([c.state for c in self.cache] + self.absorb(h, n))
        return n

    # -- the bookkeeping a step shares with batched_prefill.prefill_together -----------------

    def ridden(self, h: mx.array, n: int) -> None:
        """The next n tokens went through another forward (a decode step's, mixed_forward.py),
        which advanced ``cache``: evaluate it and do a step's bookkeeping (``h``: their
        hidden states, [1, n, H])."""
        if n != self.next_piece(n):
            raise ValueError(f"a ridden piece of {n} tokens runs past this prefill's next piece")
        mx.eval([c.state for c in self.cache] + self.absorb(h, n))

    def check_head(self) -> None:
        """Before a forward: drop a history whose head the governor evicted (this request
        then decodes serially)."""
        if self.history is not None and self.history.head_evicted:
            self.history = None

    def piece_ids(self, n: int) -> mx.array:
        """The next n prompt tokens, [n] uint32."""
        return self.ids[self.pos : self.pos + n]

    def absorb(self, h: mx.array, n: int) -> list:
        """After the forward of the next n tokens (``h``: their hidden states, [1, n, H]):
        feed the head history, move ``pos``; returns the history's arrays to evaluate
        (lazy, so a together step evaluates every row in one go)."""
        arrays = []
        if self.history is not None:
            self.history.add(h, self.ids[self.pos + 1 : self.pos + n + 1])
            self.history.feed(keep_last=True)
            arrays += [h] + self.history.state()
        self.pos += n
        return arrays
