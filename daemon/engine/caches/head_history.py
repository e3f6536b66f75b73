"""The MTP head's side of one request: its KV cache and the committed pairs (base hidden,
next token) not yet fed to it. Speculative decode feeds it a cycle at a time; the prefix
cache keeps a copy in a snapshot and primes a fresh one from it on a hit."""

from __future__ import annotations

import mlx.core as mx


class HeadHistory:
    """The head's per-request KV cache plus the committed pairs not yet fed to it."""

    def __init__(self, head):
        self.head = head
        self.cache = head.make_cache() if head is not None else None
        self.h: list[mx.array] = []  # [1, n, H] base hiddens
        self.t: list[mx.array] = []  # [n] next tokens
        self.n = 0
        # The last pair fed, when feed() consumed every pending pair: a finished request's
        # continuation (prefix_cache.store_final) takes it back out as the pending pair.
        self.last_fed: tuple[mx.array, mx.array] | None = None

    def add(self, hidden: mx.array, tokens: mx.array) -> None:
        self.h.append(hidden)
        self.t.append(tokens.reshape(-1).astype(mx.uint32))
        self.n += tokens.size

    @property
    def head_evicted(self) -> bool:
        """The governor evicted the head this history feeds: nothing will draft from it."""
        return getattr(self.head, "unloaded", False)

    @property
    def offset(self) -> int:
        return self.cache[0].offset if self.cache else 0

    def feed(self, keep_last: bool) -> mx.array | None:
        """Run pending pairs through the head (committed slots); return the head's output
        hidden at the last fed position ([1, 1, H]), or None when nothing was fed."""
        if self.head is None or self.n == 0 or (keep_last and self.n == 1):
            return None
        h = mx.concatenate(self.h, axis=1) if len(self.h) > 1 else self.h[0]
        t = mx.concatenate(self.t) if len(self.t) > 1 else self.t[0]
        if keep_last:
            self.h, self.t, self.n = [h[:, -1:]], [t[-1:]], 1
            h, t = h[:, :-1], t[:-1]
        else:
            self.h, self.t, self.n = [], [], 0
            self.last_fed = (h[:, -1:], t[-1:])
        out = self.head(h, t[None], self.cache)
        return out[:, -1:, :]

    def trim(self, n: int) -> None:
        for c in self.cache:
            c.trim(n)

    def state(self) -> list:
        return [x for c in (self.cache or []) for x in (c.keys, c.values) if x is not None]
