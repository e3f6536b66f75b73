"""Prefix cache for hybrid models: state snapshots at chunk-aligned boundaries.

A council re-sends its shared context every turn. Attention KV could be trimmed back to any
shared prefix, but a GatedDeltaNet layer's conv and recurrent state cannot: it is the state
after the last token, nothing earlier. So, as mlx-lm's ``LRUPromptCache`` does for such
caches and llama.cpp does with its checkpoints for recurrent/hybrid models, we keep whole
snapshots of the model's state at chosen boundaries, keyed by the token prefix they hold,
and a new request continues from the longest snapshot its prompt starts with.

Where this differs from those anchors, and why:
- Boundaries are multiples of the prefill chunk, taken while prefilling. A request that hits
  at P then prefills [P, P+C), [P+C, P+2C), ... : exactly the chunks a cold run of the same
  prompt forwards after P, from a state bit-identical to the cold run's at P. So a hit gives
  a cold run's tokens on every backend, by construction, not by luck of the kernels (on
  this CPU, resuming at an unaligned split, e.g. after 50 of a 256-token first chunk, does
  change the state in the last ulp). The cost: a continuation re-prefills up to C-1 tokens
  of the previous prompt plus the previous output (mlx-lm resumes after the output; its
  output was decoded one token at a time, which a cold prefill does not reproduce bit for
  bit on every backend).
- The MTP head's committed history is part of the snapshot: the head's KV (one slot per
  prompt position but the last) and the base hidden at the last position, which pairs with
  whatever token the next request has there. A hit therefore primes the head exactly as a
  cold prefill does, and acceptance after a hit is a cold run's (mlx-lm has no MTP head;
  MTPLX's session bank keeps one session's head state, not shared prefixes).
- Which boundaries: the last aligned boundary of every prompt (a seat's next turn, whose
  prompt starts with this one, continues from it) and, for chat requests, the last aligned
  boundary inside the first message (the shared system prompt, so other seats start from
  it). Not every chunk: each snapshot holds a full KV copy, so n boundaries of one prompt
  cost O(n^2) bytes.
- LRU under a byte budget, and the governor can shed entries oldest first under memory
  pressure (``evict_oldest``) before it touches the MTP head.

No locks: it lives on the engine thread.
"""

from __future__ import annotations

import copy
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import mlx.core as mx
from mlx.utils import tree_flatten


def clone_cache(cache: list) -> list:
    """Independent copies of per-layer caches, holding exactly their state (no spare
    capacity), so neither side's later updates reach the other."""
    out = []
    for c in cache:
        n = copy.copy(c)
        n.state = copy.deepcopy(c.state)
        out.append(n)
    mx.eval(_arrays(out))
    return out


def _arrays(cache: list) -> list:
    return [a for _, a in tree_flatten([c.state for c in cache]) if isinstance(a, mx.array)]


def _nbytes(cache: list) -> int:
    return sum(a.nbytes for a in _arrays(cache))


def chain_keys(tokens: list[int], chunk: int, upto: int) -> list[int]:
    """keys[k-1] identifies tokens[:k*chunk], for every k*chunk <= upto."""
    keys, h = [], 0
    for k in range(1, upto // chunk + 1):
        h = hash((h, tuple(tokens[(k - 1) * chunk : k * chunk])))
        keys.append(h)
    return keys


@dataclass
class Snapshot:
    tokens: tuple[int, ...]
    base: list
    head: list | None  # the head's KV caches, or None when taken without a head history
    head_hidden: mx.array | None  # base hidden at the last position, [1, 1, H]
    nbytes: int
    created_at: float = field(default_factory=time.monotonic)
    hits: int = 0


class PrefixCache:
    def __init__(self, max_bytes: int, chunk: int):
        self.max_bytes = max_bytes
        # The governor's cap under memory pressure (None: none); the budget is the lower.
        self.limit: int | None = None
        self.chunk = chunk
        self.entries: OrderedDict[tuple[int, int], Snapshot] = OrderedDict()  # LRU: oldest first
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self.cached_tokens = 0
        self.evicted = 0

    # ------------------------------------------------------------------ lookup
    def boundaries(self, prompt_len: int, start: int, segment_ends: list[int] = ()) -> set[int]:
        """Positions (tokens in the cache) at which a prefill of this prompt, from ``start``,
        takes a snapshot: the last aligned boundary of the prompt, and of each segment end."""
        last = prompt_len - 1  # the last prompt token is never prefilled
        c = self.chunk
        out = {last // c * c} | {min(e, last) // c * c for e in segment_ends}
        return {p for p in out if p > start and p > 0}

    def lookup(self, prompt: list[int], want_head: bool) -> tuple[Snapshot | None, int]:
        """The longest snapshot ``prompt`` starts with (leaving at least its last token to
        forward) that also carries a head history when ``want_head``; and its length."""
        c = self.chunk
        keys = chain_keys(prompt, c, len(prompt) - 1)
        for k in range(len(keys), 0, -1):
            snap = self.entries.get((k * c, keys[k - 1]))
            if snap is None or (want_head and snap.head is None):
                continue
            if list(snap.tokens) != prompt[: k * c]:
                continue  # a hash collision: never trust a key alone
            self.entries.move_to_end((k * c, keys[k - 1]))
            snap.hits += 1
            self.hits += 1
            self.cached_tokens += k * c
            return snap, k * c
        self.misses += 1
        return None, 0

    def restore(self, snap: Snapshot, next_token: int, head) -> tuple[list, object]:
        """Fresh caches holding the snapshot's state, and a head history primed as a cold
        prefill would have it at this point (None without a head)."""
        cache = clone_cache(snap.base)
        history = None
        if head is not None and snap.head is not None:
            from .speculative import HeadHistory

            history = HeadHistory(head)
            history.cache = clone_cache(snap.head)
            history.add(snap.head_hidden, mx.array([next_token], dtype=mx.uint32))
        return cache, history

    # ------------------------------------------------------------------ storing
    def store(self, tokens: list[int], cache: list, history) -> Snapshot | None:
        """Keep a copy of the state after ``tokens`` (a chunk multiple), with the head's
        history when there is one (exactly one pair pending: the last position's hidden)."""
        p = len(tokens)
        if p == 0 or p % self.chunk:
            return None
        key = (p, chain_keys(tokens, self.chunk, p)[-1])
        old = self.entries.get(key)
        if old is not None and (old.head is not None or history is None):
            self.entries.move_to_end(key)
            return old  # already held (with at least as much)
        head = hidden = None
        if history is not None and history.n == 1:
            head = clone_cache(history.cache)
            hidden = mx.array(history.h[-1][:, -1:, :])
            mx.eval(hidden)
        base = clone_cache(cache)
        nbytes = _nbytes(base) + (_nbytes(head) + hidden.nbytes if head is not None else 0)
        if nbytes > self.budget:
            return None
        if old is not None:
            self._drop(key)
        snap = Snapshot(tuple(tokens), base, head, hidden, nbytes)
        self.entries[key] = snap
        self.nbytes += nbytes
        while self.nbytes > self.budget:
            self.evict_oldest()
        return snap

    @property
    def budget(self) -> int:
        return self.max_bytes if self.limit is None else min(self.max_bytes, self.limit)

    def set_limit(self, limit: int | None) -> list[tuple[int, int]]:
        """Apply the governor's cap: drop the oldest snapshots until under it. Returns
        (bytes, tokens) of each one dropped, oldest first."""
        self.limit = limit
        dropped = []
        while self.nbytes > self.budget and self.entries:
            dropped.append(self.evict_oldest())
        return dropped

    # ------------------------------------------------------------------ shedding
    def _drop(self, key) -> int:
        snap = self.entries.pop(key)
        self.nbytes -= snap.nbytes
        return snap.nbytes

    def evict_oldest(self) -> tuple[int, int]:
        """Drop the least recently used snapshot: (bytes freed, its token count); (0, 0)
        when empty."""
        if not self.entries:
            return 0, 0
        key = next(iter(self.entries))
        self.evicted += 1
        return self._drop(key), key[0]

    def clear(self) -> int:
        freed = self.nbytes
        self.entries.clear()
        self.nbytes = 0
        return freed

    def set_chunk(self, chunk: int) -> None:
        """Snapshots are aligned to the prefill chunk; another chunk size cannot use them."""
        if chunk != self.chunk:
            self.clear()
            self.chunk = chunk

    def stats(self) -> dict:
        return {"entries": len(self.entries), "bytes": self.nbytes, "max_bytes": self.max_bytes, "limit_bytes": self.limit,
                "hits": self.hits, "misses": self.misses, "cached_tokens": self.cached_tokens,
                "evicted": self.evicted}
