"""A prompt's prefill as resumable units of work, one chunk per ``step()``.

The engine thread runs one chunk, then goes back round its loop (commands, cancels,
deadlines, the watchdog, other streams' decode steps) before the next, so a long prompt
slows the council instead of stopping it. Each chunk is the same computation as one
iteration of ``serial.prefill`` (and, with a head history, of
``speculative.prefill_with_hidden``): all prompt tokens but the last go through the model,
the last is left for the first decode step, which then continues from ``cache`` (and
``history``) exactly as serial or speculative decode would after their own prefill.

``start`` > 0 continues a cache that already holds ``prompt[:start]`` (a prefix-cache hit).
``stops``: positions a chunk must end at (where the prefix cache takes a snapshot: a
message's or the prompt's exact end), on a backend where splitting a prefill there leaves
the same state as the cold run's grid (prefix_cache.py ``splits_agree``); without them the
chunks are [start, start + chunk), ... as before.
"""

from __future__ import annotations

import mlx.core as mx

from .model import LoadedModel


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

    def step(self) -> int:
        """Forward the next chunk; return how many tokens it held (0 when done)."""
        if self.done:
            return 0
        if self.history is not None and getattr(self.history.head, "unloaded", False):
            self.history = None  # the governor evicted the head: this request decodes serially
        n = min(self.chunk, self.total - self.pos)
        while self.stops and self.stops[0] <= self.pos:
            self.stops.pop(0)
        if self.stops:
            n = min(n, self.stops[0] - self.pos)
        chunk = self.ids[self.pos : self.pos + n]
        h = self.lm.prefill_hidden(chunk[None], self.cache)  # chunked GatedDeltaNet where enabled
        arrays = [c.state for c in self.cache]
        if self.history is not None:
            self.history.add(h, self.ids[self.pos + 1 : self.pos + n + 1])
            self.history.feed(keep_last=True)
            arrays += [h] + self.history.state()
        mx.eval(arrays)
        self.pos += n
        return n
