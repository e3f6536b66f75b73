"""Prefix cache for hybrid models: state snapshots at chosen boundaries, in RAM and on disk.

A council re-sends its shared context every turn. Attention KV could be trimmed back to any
shared prefix, but a GatedDeltaNet layer's conv and recurrent state cannot: it is the state
after the last token, nothing earlier. So, as mlx-lm's ``LRUPromptCache`` does for such
caches and llama.cpp does with its checkpoints for recurrent/hybrid models, we keep whole
snapshots of the model's state at chosen boundaries, keyed by the token prefix they hold,
and a new request continues from the longest snapshot its prompt starts with.

Exact and inexact snapshots. A request that hits at P then prefills [P, P+C), [P+C, P+2C),
... : where P is a multiple of the prefill chunk C and the snapshot's own state came from
such a chain, those are exactly the chunks a cold run forwards after P, from a state
bit-identical to the cold run's at P, so a hit gives a cold run's tokens on every backend
by construction ("exact" snapshots). Finer reuse is not that by construction:
- the prompt's exact end and a chat message's exact end (not rounded down to a chunk): a
  later prompt resumes there, where its cold run would be mid-chunk;
- a request's continuation, stored when it finishes: the prompt plus the tokens it
  generated (decoded one at a time, or verified a few at a time), which a seat's next turn
  starts with. Without it every turn re-prefills up to C-1 tokens of its prompt plus its
  whole previous answer.
Whether those splits change the numbers is a property of the backend's kernels:
``splits_agree`` checks it at start-up (a prompt prefilled in C-chunks vs split off the
grid in other ways, with a token-by-token tail, the filled state compared bit for bit).
Where it agrees every snapshot is exact ("any token": the prefill also cuts its chunks at
the snapshot points, so a snapshot sits at a message's exact end). On this CPU it agrees
at every chunk size: MLX's CPU forward gives each row the same bits whatever the number
of rows beside it and wherever the forward starts (bench/probes/prefill_split_numerics.py: random
split plans of a 1,400-token prompt, forwards of 1-399 rows mixed with decode steps, all
bit-identical). (An earlier probe compared the KV caches' whole buffers, whose spare
capacity depends on the split, and so reported "differs" from 128-token chunks up.) Where
it does not agree (MLX on CUDA: the chunked GatedDeltaNet form from 128 tokens, matmul
kernels chosen by row count), such a snapshot is "inexact": a hit gives the state a cold
run would have up to float rounding, so greedy tokens can differ from a cold run's at a
near-tie. Requests in speculation mode "fast" (which already accept near-tie flips) use
them; exact and serial requests use them only when the operator sets
``prefix_cache.inexact_reuse`` (config.py), and otherwise reuse on the chunk grid only.

Until the verdict. A daemon that serves first (warming.py) answers before ``splits_agree``
has run. Meanwhile a prefill cuts its chunks on the grid only, and a snapshot that is exact
exactly where splits are (a prompt's exact end, the last chunk ending there anyway; an exact
request's continuation) is kept *pending*: inexact for now, so exact requests pass it by,
and promoted to exact when the verdict says splits are exact (to inexact when it says not).
Why: a fresh council's first round arrives before the verdict, and without them its seats'
next turns re-prefilled up to a chunk plus their whole last answer each. A pending snapshot
goes to the disk tier only once settled (a file's exactness is part of its name).

Snapshot points (``boundaries``). An exact end serves its own continuation (the seat's
next turn); a grid point inside the prompt serves every other prompt that shares that
much: another seat's prompt that differs in its last lines, a raw prompt (which has no
message ends), a chat that diverges inside a long message. So a prefill stores both: the
prompt's and each message's exact end where splits are exact, the last two grid points
before the prompt's end and the last one before each message end (where they lie past
the end before them). A prompt that diverges from an earlier one anywhere in its last
chunk then re-prefills less than a chunk of what they share. Denser points along a long
prompt would cover divergence anywhere, at one whole snapshot (KV up to that point) each.

The MTP head's committed history is part of the snapshot: the head's KV (one slot per
position but the last) and the base hidden at the last position, which pairs with whatever
token the next request has there. A hit primes the head exactly as a cold prefill does.

Tiers. RAM holds snapshots under a byte budget, LRU, except that each seat's latest
continuation is evicted only after every unpinned snapshot (a seat keeps its place while
others come and go). Every snapshot is also handed to the disk tier (prefix_disk.py) as it
is stored, so dropping it from RAM (the budget, or the governor under memory pressure,
``evict_oldest``) loses nothing the disk holds, and a restarted daemon finds it there. A
lookup looks at both tiers' lengths and reads a file only at a hit.

No locks here: it lives on the engine thread (the disk tier locks its own index).
"""

from __future__ import annotations

import copy
import hashlib
import random
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache

from ..pieces import pause
from . import prefix_disk
from .head_history import HeadHistory


def clone_cache(cache: list) -> list:
    """Independent copies of per-layer caches, holding exactly their state (no spare
    capacity: mlx-lm's KVCache state is its whole buffer, up to 255 empty slots past the
    offset; the copy is cut to the filled part), so neither side's later updates reach the
    other."""
    out = []
    for c in cache:
        n = copy.copy(c)
        n.state = copy.deepcopy(c.state)
        _trim_spare(n)
        out.append(n)
    mx.eval(_arrays(out))
    return out


def _trim_spare(c) -> None:
    """Cut a plain KV cache's buffers to its offset (what it reads; a later update grows
    them again as from any other length)."""
    if type(c) is not KVCache or c.keys is None or c.keys.shape[2] <= c.offset:
        return
    c.keys = mx.array(c.keys[..., : c.offset, :])
    c.values = mx.array(c.values[..., : c.offset, :])


def filled_arrays(cache: list) -> list:
    """Every array of a cache's state as a forward reads it: a KV cache's keys and values
    up to its offset (the spare capacity past it depends on how the tokens were split),
    every other cache's whole state."""
    out = []
    for c in cache:
        if isinstance(c, KVCache) and c.keys is not None:
            out += [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
        else:
            out += [a for _, a in tree_flatten(c.state) if isinstance(a, mx.array)]
    return out


def _arrays(cache: list) -> list:
    return [a for _, a in tree_flatten([c.state for c in cache]) if isinstance(a, mx.array)]


def _nbytes(cache: list) -> int:
    return sum(a.nbytes for a in _arrays(cache))


def _states(cache: list) -> list:
    """Per layer, the cache's state as it is (the disk tier stores the tree)."""
    return [c.state for c in cache]


def _from_states(fresh: list, states: list) -> list:
    """Fresh caches given stored states (the setters take what the getters gave)."""
    if len(fresh) != len(states):
        raise ValueError(f"snapshot has {len(states)} layers, the model {len(fresh)}")
    for c, s in zip(fresh, states):
        c.state = s
    return fresh


def cache_offset(cache: list) -> int | None:
    """Tokens held, read from an attention layer (None: no layer says)."""
    for c in cache:
        off = getattr(c, "offset", None)
        if isinstance(off, int) and getattr(c, "keys", None) is not None:
            return off
    return None


def split_plans(chunk: int) -> tuple[int, list[list[int]]]:
    """The prompt length ``splits_agree`` prefills and the ways it splits it: each plan a
    list of forward lengths, a 1 being a decode step. The first is the cold run's grid;
    the others resume off the grid as a prefix-cache hit does (at a prompt's or a message's
    exact end, after a continuation decoded token by token), with the chunks after the
    split landing off the grid too."""
    n = 2 * chunk + 9

    def plan(cuts: list[int], stepwise_from: int) -> list[int]:
        out, pos = [], 0
        for end in cuts + [stepwise_from]:
            while pos < end:
                out.append(min(chunk, end - pos))
                pos += out[-1]
        return out + [1] * (n - pos)

    # One off-grid plan, not two (until 2026-12-07 a second split [131, 256, 129, 1 x 5]
    # beside [1, 1, 253, 6, 256, 2, 1, 1]): each plan is a prefill of n tokens, which on a
    # CPU costs its FLOPs, and the probe runs inside a fresh start's first round. This one
    # keeps what both covered: forwards of 1 token, odd lengths (129, 124, 6), a forward
    # ending just before the grid (at chunk - 1), a whole chunk landing off the grid, a short
    # forward across the next grid point, and a token-by-token tail.
    return n, [plan([], n),  # the cold run: chunks of ``chunk`` on the grid
               plan([1, 2, chunk // 2 + 3, chunk - 1, 2 * chunk - 1], n - 4)]


def splits_agree(lm, chunk: int, seed: int = 0) -> bool:
    """Does resuming off the chunk grid (and stepping token by token, as decode does)
    leave the same state, bit for bit, as prefilling in ``chunk``-sized pieces? Compares
    every layer's filled state (``filled_arrays``) and the next step's logits after each of
    ``split_plans``. Where it does, snapshots at any position are exact. Runs one layer of
    each kind (``LoadedModel.layer_kinds_view``): what holds for it holds for the model."""
    lm = lm.layer_kinds_view()
    rng = random.Random(seed)
    n, plans = split_plans(chunk)
    vocab = min(1000, lm.text_args.vocab_size)  # ids past the vocabulary read past the embedding
    ids = mx.array([rng.randrange(1, vocab) for _ in range(n + 1)], dtype=mx.uint32)

    def run(plan: list[int]) -> list:
        cache, pos, hidden = lm.make_cache(), 0, []
        for m in plan:
            if m == 1 and pos >= n - 9:  # the tail: decode steps
                h = lm.hidden(ids[None, pos : pos + 1], cache)
            else:
                h = lm.prefill_hidden(ids[None, pos : pos + m], cache)
            hidden.append(h)
            mx.eval(_arrays(cache), h)
            pos += m
            pause()  # run piecewise at start-up: a forward a piece (engine/pieces.py)
        logits = lm.logits(lm.hidden(ids[None, n : n + 1], cache))
        # Every position's hidden state too: the view's last layer has no layer after it
        # whose cache would show its output.
        out = filled_arrays(cache) + [logits, mx.concatenate(hidden, axis=1)]
        mx.eval(out)
        return out

    ref = run(plans[0])
    for plan in plans[1:]:
        other = run(plan)
        if len(ref) != len(other) or not all(a.shape == b.shape and mx.array_equal(a, b).item()
                                             for a, b in zip(ref, other)):
            return False
    return True


@dataclass
class Snapshot:
    tokens: tuple[int, ...]
    base: list
    head: list | None  # the head's KV caches, or None when taken without a head history
    head_hidden: mx.array | None  # base hidden at the last position, [1, 1, H]
    nbytes: int
    exact: bool = True
    seat: str | None = None
    pending: bool = False  # exact if the splits verdict, not in yet, says splits are exact
    created_at: float = field(default_factory=time.monotonic)
    hits: int = 0


def _as_good(old: Snapshot, exact: bool, pending: bool) -> bool:
    """Does a snapshot held already promise at least what a new one would?"""
    return old.exact or (not exact and (old.pending or not pending))


def _digests(prompt: list[int], lengths: list[int]) -> dict[int, str]:
    """token_digest(prompt[:n]) for each n in ``lengths``, in one pass."""
    raw = np.asarray(prompt, dtype=np.uint32).tobytes()
    out, h, at = {}, hashlib.blake2b(digest_size=16), 0
    for n in sorted(lengths):
        h.update(raw[at * 4 : n * 4])
        at = n
        out[n] = h.copy().hexdigest()
    return out


class PrefixCache:
    def __init__(self, max_bytes: int, chunk: int, make_cache=None, disk: prefix_disk.DiskTier | None = None,
                 splits_exact: bool = False, splits_pending: bool = False):
        self.max_bytes = max_bytes
        # The governor's cap under memory pressure (None: none); the budget is the lower.
        self.limit: int | None = None
        self.chunk = chunk
        self.make_cache = make_cache  # builds an empty model cache (a disk hit fills one)
        self.disk = disk
        self.splits_exact = splits_exact
        # The splits verdict is not in yet (a start that serves first): see "Until the verdict".
        self.splits_pending = splits_pending
        self.entries: OrderedDict[tuple[int, str], Snapshot] = OrderedDict()  # LRU: oldest first
        self.pinned: dict[str, tuple[int, str]] = {}  # seat -> its latest continuation's key
        self.seat_continuations: dict[str, set[tuple[int, str]]] = {}  # for a session "drop"
        self.nbytes = 0
        self.hits = 0
        self.disk_hits = 0
        self.misses = 0
        # Bumped by every snapshot taken in: a request that looked before may find more now.
        self.generation = 0
        self.cached_tokens = 0
        self.evicted = 0
        self.continuations = 0
        self.promoted = 0  # pending snapshots the verdict made exact

    def is_exact(self, p: int, from_exact: bool = True) -> bool:
        """Would a snapshot at ``p``, taken by a prefill that started from an exact state,
        give a cold run's state? (Never after an inexact one: even where splits are exact, a
        continuation whose decode rounded unlike serial steps is inexact, store_final.)"""
        return from_exact and (self.splits_exact or p % self.chunk == 0)

    def is_pending(self, p: int, from_exact: bool = True) -> bool:
        """Would a snapshot at ``p`` be exact if the splits verdict, not in yet, says splits
        are? (Off the grid, from an exact state, while the verdict is pending.)"""
        return from_exact and self.splits_pending and not self.is_exact(p)

    # ------------------------------------------------------------------ lookup
    def boundaries(self, prompt_len: int, start: int, segment_ends: list[int] = (), fine: bool = False) -> set[int]:
        """Positions (tokens in the cache) at which a prefill of this prompt, from ``start``,
        takes a snapshot.

        An exact end serves only its own continuation; grid points (multiples of the
        chunk) inside the prompt serve other prompts that share less. Before the prompt's
        end, the last two grid points: a prompt that diverges anywhere in this one's last
        chunk (another seat's last lines) then resumes less than a chunk before where it
        diverges, whether or not a grid point falls between (with only the last grid
        point, one that diverged a token before it would fall back to the point before:
        for a raw prompt, its start). Before each
        message end, the last grid point (for a history rewritten near a message's end).
        A grid point at or before an earlier end adds nothing: that end serves every
        prompt it would.

        Where splits are exact, the prompt's end and each segment end (chat messages)
        exactly too (the prefill cuts its chunks at every point, ``ChunkedPrefill``'s
        ``stops``). Elsewhere the grid points only; with ``fine``, the prompt's exact end
        too (the last chunk ends there anyway)."""
        last = prompt_len - 1  # the last prompt token is never prefilled
        c = self.chunk
        ends = sorted({last} | {min(e, last) for e in segment_ends})
        out, before = set(), 0
        for e in ends:
            grid = {e // c * c, e // c * c - c} if e == last else {e // c * c}
            out |= {g for g in grid if g > before}
            if self.splits_exact:
                out.add(e)
                before = e  # an exact end serves whatever a grid point below it would
        if fine:
            out.add(last)
        return {p for p in out if p > start and p > 0}

    def lookup(self, prompt: list[int], want_head: bool, allow_inexact: bool = False) -> tuple[Snapshot | None, int]:
        """The longest snapshot ``prompt`` starts with (leaving at least its last token to
        forward) that also carries a head history when ``want_head`` and is exact unless
        ``allow_inexact``, from RAM or else from disk; and its length."""
        limit = len(prompt) - 1
        lengths = {k[0] for k in self.entries if k[0] <= limit}
        if self.disk is not None:
            lengths |= {n for n in self.disk.lengths() if 0 < n <= limit}
        digests = _digests(prompt, list(lengths))
        for n in sorted(lengths, reverse=True):
            key = (n, digests[n])
            snap = self.entries.get(key)
            if snap is not None and self._usable(snap.head is not None, snap.exact, want_head, allow_inexact):
                if list(snap.tokens) != prompt[:n]:
                    continue  # a hash collision: never trust a key alone
                self.entries.move_to_end(key)
                return self._hit(snap, n)
            if self.disk is None:
                continue
            e = self.disk.find(*key)
            if e is None or not self._usable(e.head, e.exact, want_head, allow_inexact):
                continue
            t0 = time.perf_counter()
            snap = self._load(e, prompt[:n])
            if snap is not None:
                self.disk_hits += 1
                self.disk.log.info("prefix_cache.disk_hit", tokens=n, bytes=snap.nbytes, head=snap.head is not None,
                                   exact=snap.exact, ms=round((time.perf_counter() - t0) * 1000, 2))
                return self._hit(snap, n)
        self.misses += 1
        return None, 0

    def relookup(self, prompt: list[int], want_head: bool, allow_inexact: bool, held: int) -> tuple[Snapshot | None, int]:
        """``lookup`` again for a request that found ``held`` tokens before and has forwarded
        nothing since: the longer snapshot and its length, or (None, held) where there is none
        longer. The statistics count the request once, as its better lookup."""
        hits, misses, cached = self.hits, self.misses, self.cached_tokens
        snap, n = self.lookup(prompt, want_head, allow_inexact=allow_inexact)
        if snap is None or n <= held:
            self.hits, self.misses, self.cached_tokens = hits, misses, cached
            if snap is not None:
                snap.hits -= 1
            return None, held
        if held:  # its first lookup was a hit already: it is one hit, of n tokens
            self.hits -= 1
            self.cached_tokens -= held
        else:  # its first lookup was a miss: now it is a hit
            self.misses -= 1
        return snap, n

    @staticmethod
    def _usable(has_head: bool, exact: bool, want_head: bool, allow_inexact: bool) -> bool:
        return (has_head or not want_head) and (exact or allow_inexact)

    def _hit(self, snap: Snapshot, n: int) -> tuple[Snapshot, int]:
        snap.hits += 1
        self.hits += 1
        self.cached_tokens += n
        return snap, n

    def _load(self, e: prefix_disk.DiskEntry, tokens: list[int]) -> Snapshot | None:
        """A disk entry read back into RAM (kept there, as the most recent); None when the
        file did not check out (the disk tier logged and dropped it)."""
        data = self.disk.load(e, tokens)
        if data is None or self.make_cache is None:
            return None
        try:
            base = _from_states(self.make_cache(), data["base"])
            head = data["head"]  # per-layer states: made the head's caches at restore
        except Exception as exc:  # noqa: BLE001 - a file that does not fit this model is a miss
            self.disk.log.warning("prefix_cache.disk_corrupt", tokens=e.tokens, error=f"layout: {exc}")
            self.disk._forget(e, delete=True)
            return None
        mx.eval(_arrays(base))
        head_bytes = sum(a.nbytes for _, a in tree_flatten(head) if isinstance(a, mx.array)) if head is not None else 0
        nbytes = _nbytes(base) + (head_bytes + data["head_hidden"].nbytes if head is not None else 0)
        snap = Snapshot(tuple(tokens), base, head, data["head_hidden"], nbytes, exact=data["exact"])
        self._insert((len(tokens), e.digest), snap, to_disk=False)
        return snap

    def restore(self, snap: Snapshot, next_token: int, head) -> tuple[list, object]:
        """Fresh caches holding the snapshot's state, and a head history primed as a cold
        prefill would have it at this point (None without a head)."""
        cache = clone_cache(snap.base)
        history = None
        if head is not None and snap.head is not None:
            history = HeadHistory(head)
            if snap.head and not hasattr(snap.head[0], "state"):  # read from disk: per-layer states
                snap.head = _from_states(head.make_cache(), snap.head)
            history.cache = clone_cache(snap.head)
            history.add(snap.head_hidden, mx.array([next_token], dtype=mx.uint32))
        return cache, history

    # ------------------------------------------------------------------ storing
    def store(self, tokens: list[int], cache: list, history, exact: bool = True, seat: str | None = None,
              pending: bool = False) -> Snapshot | None:
        """Keep a copy of the state after ``tokens``, with the head's history when there is
        one (exactly one pair pending: the last position's hidden). ``exact``: the state is
        a cold run's (the caller knows how it was reached); refused (None) when claimed
        off the chunk grid on a backend where splits change the numbers. ``pending``
        (with ``exact`` False): it is a cold run's if the splits verdict says splits are
        exact (``is_pending``); kept as inexact until ``settle``."""
        p = len(tokens)
        if p == 0 or (exact and not self.is_exact(p)):
            return None
        pending = pending and not exact and self.splits_pending
        key = (p, prefix_disk.token_digest(tokens))
        old = self.entries.get(key)
        if old is not None and (old.head is not None or history is None) and _as_good(old, exact, pending):
            self.entries.move_to_end(key)
            return old  # already held (with at least as much)
        head = hidden = None
        if history is not None and history.n == 1 and history.cache is not None:
            head = clone_cache(history.cache)
            hidden = mx.array(history.h[-1][:, -1:, :])
            mx.eval(hidden)
        base = clone_cache(cache)
        nbytes = _nbytes(base) + (_nbytes(head) + hidden.nbytes if head is not None else 0)
        snap = Snapshot(tuple(tokens), base, head, hidden, nbytes, exact=exact, seat=seat, pending=pending)
        if old is not None:
            self._drop(key)
        return self._insert(key, snap, to_disk=not pending)

    def store_final(self, known: list[int], cache: list, history, seat: str | None = None,
                    exact: bool = True) -> Snapshot | None:
        """A finished request's continuation: ``cache`` holds a prefix of ``known`` (the
        prompt plus every token its decoder committed); keep it, with the head's history
        when that is at the same position. Pinned as the seat's latest. Exact where splits
        are and the caller says the decode left a cold run's state (``exact``: its prefill
        started from an exact state, and its decode path computes what serial steps do)."""
        p = cache_offset(cache)
        if p is None or not 0 < p <= len(known):
            return None
        hist = None
        if history is not None and history.cache is not None:
            if history.n >= 1 and history.offset + history.n == p:
                history.feed(keep_last=True)  # the request is over: its history is ours
                hist = history
            elif history.n == 0 and history.offset == p and getattr(history, "last_fed", None) is not None:
                # Everything was fed (a first draft was issued ahead): take the last slot back
                # out and keep its hidden pending, as a prefill leaves it.
                history.trim(1)
                h, t = history.last_fed
                history.h, history.t, history.n = [h], [t], 1
                hist = history
        snap = self.store(list(known[:p]), cache, hist, exact=self.splits_exact and exact, seat=seat,
                          pending=exact)
        if snap is not None:
            self.continuations += 1
            if seat is not None:
                key = (p, prefix_disk.token_digest(snap.tokens))
                self.pinned[seat] = key
                self.seat_continuations.setdefault(seat, set()).add(key)
        return snap

    def settle(self, splits_exact: bool) -> int:
        """The splits verdict is in: every pending snapshot becomes exact where splits are,
        inexact where not, and goes to the disk tier. Returns how many became exact."""
        self.splits_exact, self.splits_pending = splits_exact, False
        promoted = 0
        for key, snap in self.entries.items():
            if snap.pending:
                snap.exact, snap.pending = splits_exact, False
                promoted += splits_exact
                self._spill(key, snap, to_disk=True)
        self.promoted += promoted
        return promoted

    def _insert(self, key, snap: Snapshot, to_disk: bool) -> Snapshot | None:
        if snap.nbytes > self.budget:
            self._spill(key, snap, to_disk and not snap.pending)
            return None
        self.entries[key] = snap
        self.generation += 1  # requests that looked before it may look again (relookup)
        self.nbytes += snap.nbytes
        self._spill(key, snap, to_disk)
        while self.nbytes > self.budget:
            self.evict_oldest()
        return snap

    def _spill(self, key, snap: Snapshot, to_disk: bool) -> None:
        """Hand the snapshot to the disk tier (written off this thread). A failure here is
        logged and costs only the file, never the request that stored it."""
        if not to_disk or self.disk is None or not self.disk.usable:
            return
        name = prefix_disk.file_name(key[0], key[1], snap.head is not None, snap.exact)
        try:
            head_states = _states(snap.head) if snap.head is not None else None
            pending = prefix_disk.prepare(self.disk.fingerprint, snap.tokens, _states(snap.base), head_states,
                                          snap.head_hidden, snap.exact, name)
        except Exception as exc:  # noqa: BLE001 - a state it cannot lay out costs the file only
            self.disk.log.warning("prefix_cache.disk_write_failed", file=name, error=repr(exc))
            return
        self.disk.submit(pending)

    @property
    def budget(self) -> int:
        return self.max_bytes if self.limit is None else min(self.max_bytes, self.limit)

    def set_limit(self, limit: int | None) -> list[tuple[int, int]]:
        """Apply the governor's cap: drop the oldest snapshots until under it (they stay on
        disk). Returns (bytes, tokens) of each one dropped, oldest first."""
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
        """Drop the least recently used snapshot, a seat's latest continuation only when
        nothing else is left: (bytes freed, its token count); (0, 0) when empty."""
        if not self.entries:
            return 0, 0
        pinned = set(self.pinned.values())
        key = next((k for k in self.entries if k not in pinned), next(iter(self.entries)))
        self.evicted += 1
        snap = self.entries[key]
        if snap.pending:  # never written yet: the disk keeps it as what it is now, inexact
            snap.pending = False
            self._spill(key, snap, to_disk=True)
        return self._drop(key), key[0]

    def forget_seat(self, seat: str) -> tuple[int, int]:
        """A seat's session is over: drop its pin and the continuations it stored, from RAM
        and disk (shared prefixes it stored stay: other seats start from them). Returns
        (snapshots dropped, bytes freed from RAM)."""
        self.pinned.pop(seat, None)
        keys = self.seat_continuations.pop(seat, set())
        freed = sum(self._drop(k) for k in keys if k in self.entries)
        if self.disk is not None:
            for k in keys:
                self.disk.discard(k)
        return len(keys), freed

    def clear(self) -> int:
        freed = self.nbytes
        self.entries.clear()
        self.nbytes = 0
        return freed

    def set_chunk(self, chunk: int) -> None:
        """Exact snapshots are aligned to the prefill chunk; another chunk size cannot use
        them (nor the files written under the old one: the caller reopens the disk tier)."""
        if chunk != self.chunk:
            self.clear()
            self.chunk = chunk

    @property
    def exact_reuse(self) -> str:
        """Where exact requests may resume, in words (status): any token where splits are
        exact here, else the chunk grid only."""
        if self.splits_exact:
            return "any token (off-grid splits are bit-identical here)"
        if self.splits_pending:
            return (f"chunk grid ({self.chunk} tokens) until the splits verdict is in; "
                    "snapshots off it wait for it (pending)")
        return f"chunk grid ({self.chunk} tokens): off-grid splits are not bit-identical here"

    def stats(self) -> dict:
        out = {"entries": len(self.entries), "bytes": self.nbytes, "max_bytes": self.max_bytes, "limit_bytes": self.limit,
               "hits": self.hits, "ram_hits": self.hits - self.disk_hits, "disk_hits": self.disk_hits,
               "misses": self.misses, "cached_tokens": self.cached_tokens, "evicted": self.evicted,
               "continuations": self.continuations, "pinned_seats": len(self.pinned),
               "splits_exact": self.splits_exact, "splits_pending": self.splits_pending,
               "pending": sum(s.pending for s in self.entries.values()), "promoted": self.promoted,
               "exact_reuse": self.exact_reuse}
        if self.disk is not None:
            out["disk"] = self.disk.stats()
        return out
