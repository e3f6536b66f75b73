"""Continuous batch decode at depth 0: several streams, one forward per step.

Built on mlx-lm's batch caches: per layer, ``KVCache.merge`` -> ``BatchKVCache`` (left-padded,
per-row rope offsets and masks) and ``ArraysCache.merge`` (GatedDeltaNet conv + recurrent
state stacked on the batch axis); ``extend`` admits, ``filter`` drops, ``extract`` hands a
row its own plain cache back. Nothing here rewrites those caches.

Row state, at every step boundary (what ``add`` takes and ``extract`` returns):
    (cache, next_token): the cache holds the prompt and every token emitted so far;
    next_token is DECIDED but neither emitted nor forwarded yet.
``step()`` emits every row's next_token, then issues one batched forward over them and
samples each row's following token (lazily, as serial_decode issues its next step ahead,
so the caller's per-token work overlaps the device). A new stream is prefilled alone and
its first token decided by a one-token (M=1) step, op for op serial_decode's first step,
so it joins the batch in the same state as every other row.

With one row the decoder keeps that row's plain per-request cache and runs M=1 steps: it is
serial_decode, bit for bit. With two or more rows the caches are merged; dropping back to
one extracts the survivor's plain cache again.

Exactness (temperature 0). Matmuls can round differently at batch height M>=2 than at
M=1, so a batched row can flip an argmax at a near-tie, and its cache drifts by ulps from
the one serial_decode would hold. bench/batch_bench.py measures it (bench/results/README.md
has the tables): on CPU a batched row is bit-identical to serial; on MLX CUDA it is not, and
a near-tie guard (``guard_margin``: re-decide a row with an M=1 forward from its pre-step
state where the batched top-2 margin is within ``guard * max(1, |top1 logit|)``) catches
every flip under teacher forcing but cannot make free-running rows exact (their cache has
already drifted under the batched kernels), at a large share of the batching gain. So:
- the guard is off by default (``guard_margin=None``; kept as an option);
- a row that must be exact at temperature 0 is batched only where the batched forward is
  bit-identical to M=1 on this backend: ``batch_matches_serial(lm)`` probes it once (mixed
  prompt lengths, heights 2..``max_rows``). Where it is not, exact greedy rows decode alone
  (serial_decode, or exact speculation) and ``add(..., exact=True)`` refuses them;
- fast rows and every temperature > 0 row always batch (the fast configuration accepts the
  flips; the results README counts them).

Temperature > 0: each row samples with its own Sampler (own key), consumed in the same
order as serial_decode consumes it, so a seed reproduces a request; batch numerics can
still move a draw that sits on a CDF boundary by an ulp (as they can move an argmax).

Driving it from the engine thread (worker.py), at the step boundaries it already has:
``add`` when the scheduler admits a batchable job (``admits``), ``step`` when the scheduler
picks any batched job (every row gets one token; charge each row's seat), ``extract`` when
the scheduler parks a batched job (keep (cache, next_token) on the job; ``add(cache=,
next_token=)`` when it is re-admitted), ``handle(row_id)`` as the job's ``generator`` so
that ``_finish``'s ``close()`` removes the row.

Adoption: serial_decode and speculative_decode keep their cache and the token they have
already decided (issued ahead) inside the generator, so an in-flight generator cannot be
adopted. Instead a stream that must leave the batch is ``extract``-ed: its (cache,
next_token) resumes alone (``serial_decode`` from that cache, after emitting next_token) or
rejoins later with
``add(row_id, sampler, cache=..., next_token=...)``, never recomputing its prompt.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache

from ..caches.batch_rows import DEFAULT_MAX_ROWS, RowBatch
from ..model.model import LoadedModel
from ..pieces import pause
from ..prefill.mixed_forward import Ride, hidden_with
from ..prefill.prefill import PREFILL_CHUNK, prefill
from .constraint import ConstraintError, ConstraintViolation
from .sampling import Sampler, logprobs as _logprobs, near_tie


def max_logit_diff(lm: LoadedModel, heights=(2, 3, 4, 8, 16), lens=(1, 7, 33), seed: int = 0) -> dict[int, float]:
    """Max |batched logit - M=1 logit| per batch height, rows of mixed prompt lengths (so
    the batch caches carry left padding)."""
    import copy
    import random

    out = {}
    V = lm.text_args.vocab_size
    for B in heights:
        rng = random.Random(seed * 1000 + B)
        states = []
        for _ in range(B):
            c = lm.make_cache()
            last = prefill(lm, [rng.randrange(V) for _ in range(rng.choice(lens))], c)
            states.append((c, last))
            pause()
        solo = [lm.logits(lm.hidden(last[None], [copy.deepcopy(x) for x in c]))[0, -1].astype(mx.float32)
                for c, last in states]
        batch = [type(layer[0]).merge(list(layer)) for layer in zip(*[c for c, _ in states])]
        inp = mx.concatenate([last for _, last in states])
        got = lm.logits(lm.hidden(inp[:, None], batch))[:, -1].astype(mx.float32)
        out[B] = max(mx.abs(x - got[i]).max().item() for i, x in enumerate(solo))
        pause()
    return out


def batch_matches_serial(lm: LoadedModel, max_rows: int = DEFAULT_MAX_ROWS) -> bool:
    """True when batched forwards on this backend give logits bit-identical to M=1 (probed
    once per model; a few small forwards). Exact rows may batch only then."""
    probed = lm.__dict__.setdefault("_batch_matches_serial", {})
    if max_rows not in probed:
        heights = sorted({h for h in (2, 3, 4, 8, max_rows) if 2 <= h <= max_rows})
        # One layer of each kind answers for the model (LoadedModel.layer_kinds_view).
        probed[max_rows] = all(d == 0.0 for d in max_logit_diff(lm.layer_kinds_view(), heights).values())
    return probed[max_rows]


@dataclass
class _Row:
    row_id: Hashable
    sampler: Sampler
    exact: bool
    emitted: int = 0
    guarded: int = 0


@dataclass
class BatchStats:
    steps: int = 0  # batched (or single-row) forwards issued
    row_steps: int = 0  # tokens emitted
    guard_checks: int = 0  # row-steps of exact greedy rows decided at M>=2
    guarded: int = 0  # of those, re-decided at M=1
    guard_changed: int = 0  # of those, where the M=1 token differed from the batched argmax


class BatchDecoder(RowBatch):
    """Drive from one thread, at step boundaries: ``add`` / ``remove`` / ``extract`` /
    ``step``. Row ids are any hashable (the worker's job key); the rows and their caches'
    joining and leaving are batch_rows.RowBatch's."""

    refusal = ("this backend's batched kernels are not bit-identical to M=1: a row that must be exact at "
               "temperature 0 decodes alone")

    def __init__(self, lm: LoadedModel, guard_margin: float | None = None, exact_ok: bool | None = None,
                 max_rows: int = DEFAULT_MAX_ROWS, prefill_chunk: int = PREFILL_CHUNK, logit_jitter: float = 0.0):
        """``guard_margin``: the near-tie guard for exact rows (None, the default: off; see
        the module docstring for why). ``exact_ok``: whether rows that must be exact at
        temperature 0 may batch; None probes ``batch_matches_serial`` once.
        ``logit_jitter`` is a test hook: uniform noise of that amplitude on the batched
        (B >= 2) logprobs, never on M=1 steps, standing in for batch-height-dependent
        kernels (on this CPU backend the batched logits are bit-identical to M=1)."""
        super().__init__(max_rows)
        self.lm = lm
        self.exact_ok = batch_matches_serial(lm, max_rows) if exact_ok is None else exact_ok
        self.logit_jitter = logit_jitter
        self._jitter_key = mx.random.key(0x8A7C)
        self.guard_margin = guard_margin
        self.prefill_chunk = prefill_chunk
        self.stats = BatchStats()
        self.last_positions = 0  # the last step's forward: one position per row (its step budget use)
        # len(rows) == 1: the row's own plain cache; >= 2: mlx-lm batch caches, one per layer.
        self._cache: list | None = None
        self._next: mx.array | None = None  # [B] uint32: decided, not emitted, not forwarded
        # Pending guard of the forward that decided _next: (flags [B] bool, argmax [B],
        # the forward's inputs [B], GDN states before it, per layer (None for KV layers)).
        self._pending: tuple | None = None

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self._cache) if self._cache else 0

    # ------------------------------------------------------------------ admission
    def admits(self, sampler: Sampler, exact: bool) -> bool:
        """Whether a row of this kind may join: anything but an exact temperature-0 row on a
        backend whose batched forward differs from M=1 (unless the guard is on)."""
        if sampler.processing or sampler.wants_logprobs:
            return False  # per-row processors and logprobs are not batched: such a row decodes alone
        return not (exact and sampler.greedy) or self.exact_ok or self.guard_margin is not None

    def add(
        self,
        row_id: Hashable,
        sampler: Sampler,
        prompt: list[int] | None = None,
        *,
        cache: list | None = None,
        next_token: int | None = None,
        exact: bool = False,
    ) -> None:
        """Admit a stream at a step boundary: from ``prompt`` (prefilled alone, first token
        decided at M=1, exactly as serial_decode; with ``cache``, that cache already holds
        the tokens before ``prompt``, as after a chunked prefill), or from a row state
        ``(cache, next_token)`` that ``extract`` returned. ``exact`` only matters at
        temperature 0."""
        self._check_join(row_id, sampler, exact)
        if prompt is not None:
            if next_token is not None:
                raise ValueError("give a prompt or (cache, next_token), not both")
            if not prompt:
                raise ValueError("a stream needs at least one prompt token")
            cache = cache if cache is not None else self.lm.make_cache()
            last = prefill(self.lm, prompt, cache, self.prefill_chunk)
            logits = self.lm.logits(self.lm.hidden(last[None], cache))[:, -1, :]
            # process(): the row's constraint (identity without one); penalties never batch.
            tok = sampler(_logprobs(sampler.process(logits))).reshape(-1).astype(mx.uint32)
        elif cache is not None and next_token is not None:
            tok = mx.array([int(next_token)], dtype=mx.uint32)
        else:
            raise ValueError("add needs a prompt, or both cache and next_token")
        mx.eval(tok, [c.state for c in cache])
        self._settle()
        merged = bool(self._rows)
        self._cache = self._joined(self._cache, cache)
        self._next = mx.concatenate([self._next, tok]) if merged else tok
        if merged:
            mx.eval(self._next, [c.state for c in self._cache])
        self._rows.append(_Row(row_id, sampler, exact=exact))

    # ------------------------------------------------------------------ leaving
    def remove(self, row_id: Hashable) -> None:
        """Drop a finished or cancelled row (its cache is discarded)."""
        self._settle()
        self._drop(self._index(row_id))

    def extract(self, row_id: Hashable) -> tuple[list, int]:
        """Take a row out with its state: (plain per-request cache, next_token). The cache
        holds the prompt and everything emitted; next_token is decided but not emitted.
        Resume alone (emit next_token, then serial_decode from the cache) or rejoin with
        ``add(cache=, next_token=)``."""
        self._settle()
        i = self._index(row_id)
        cache = self._taken_out(self._cache, i)
        nxt = int(self._next[i].item())
        mx.eval([c.state for c in cache])
        self._drop(i)
        return cache, nxt

    def _drop(self, i: int) -> None:
        keep = self._drop_row(i)
        self._cache = self._kept(self._cache, keep)
        if not keep:
            self._next = None
            return
        self._next = self._next[mx.array(keep)]
        mx.eval(self._next, [c.state for c in self._cache])

    # ------------------------------------------------------------------ decoding
    def step(self, ride: Ride | None = None) -> dict:
        """Emit one token per row; issue the batched forward that decides the next ones,
        carrying ``ride``'s prompt piece where given (mixed_forward.py; ``ride.hidden`` is
        set). Returns {row_id: token}."""
        if not self._rows:
            return {}
        self._settle()  # with a guard pending this waits for the last forward
        inputs = self._next  # may still be in flight: the next forward is queued behind it
        B = len(self._rows)
        self.last_positions = B
        rows = self._rows
        guard_rows = [] if B == 1 else [i for i, r in enumerate(rows) if r.exact and r.sampler.greedy]
        pre = None
        if guard_rows and self.guard_margin is not None:
            # GDN state before the forward, by reference (the forward replaces, not mutates).
            pre = [list(c.cache) if isinstance(c, ArraysCache) else None for c in self._cache]

        logits = self.lm.logits(hidden_with(self.lm, inputs[:, None], self._cache, ride))[:, -1, :]
        tokens = None
        if any(r.sampler.constraint is not None for r in rows):
            # A constrained row's mask follows the token it emits now: queue the forward, read
            # the tokens while it runs, settle each matcher, then mask (constrain_rows).
            mx.async_eval(logits)
            tokens = inputs.tolist()
            logits = constrain_rows(logits, [r.sampler.constraint for r in rows], tokens)
        lp = _logprobs(logits)
        if self.logit_jitter > 0.0 and B > 1:
            self._jitter_key, sub = mx.random.split(self._jitter_key)
            lp = lp.astype(mx.float32) + mx.random.uniform(-self.logit_jitter, self.logit_jitter, lp.shape, key=sub)
        greedy = [r.sampler.greedy for r in rows]
        if all(greedy):
            nxt = mx.argmax(lp, axis=-1)
        else:
            nxt = mx.concatenate([
                mx.argmax(lp[i : i + 1], axis=-1) if g else r.sampler(lp[i : i + 1]).reshape(-1)
                for i, (r, g) in enumerate(zip(rows, greedy))
            ])
        nxt = nxt.astype(mx.uint32)
        self._next = nxt
        to_eval = [nxt] + [c.state for c in self._cache]
        if ride is not None:
            to_eval += [ride.hidden] + [c.state for c in ride.cache]
        if pre is not None:
            mask = mx.array([i in guard_rows for i in range(B)])
            flags = mx.logical_and(near_tie(lp, logits, self.guard_margin), mask)
            self._pending = (flags, inputs, pre)
            to_eval.append(flags)
            self.stats.guard_checks += len(guard_rows)
        mx.async_eval(to_eval)
        tokens = inputs.tolist() if tokens is None else tokens
        self.stats.steps += 1
        self.stats.row_steps += B
        if self.stats.steps % 256 == 0:
            mx.clear_cache()
        out = {}
        for r, t in zip(rows, tokens):
            r.emitted += 1
            out[r.row_id] = t
        return out

    def _settle(self) -> None:
        """Resolve the pending guard: rows whose batched decision sat at a near-tie are
        re-decided with an M=1 forward from their pre-step state."""
        if self._pending is None:
            return
        flags, inputs, pre = self._pending
        self._pending = None
        flagged = [i for i, f in enumerate(flags.tolist()) if f]
        if not flagged:
            return
        fixed = list(self._next.tolist())
        for i in flagged:
            row_cache = []
            for c, p in zip(self._cache, pre):
                if isinstance(c, BatchKVCache):
                    # Positions before the slot this step wrote are untouched by it.
                    lp = int(c.left_padding[i].item())
                    kv = KVCache()
                    kv.keys = c.keys[i : i + 1, :, lp : c._idx - 1]
                    kv.values = c.values[i : i + 1, :, lp : c._idx - 1]
                    kv.offset = c._idx - 1 - lp
                    row_cache.append(kv)
                elif isinstance(c, ArraysCache):
                    a = ArraysCache(len(p))
                    a.cache = [x[i : i + 1] if x is not None else None for x in p]
                    row_cache.append(a)
                else:
                    raise TypeError(f"no M=1 redo for cache type {type(c).__name__}")
            logits = self.lm.logits(self.lm.hidden(inputs[i : i + 1][None], row_cache))[:, -1, :]
            # serial_decode's op sequence exactly: argmax of the logprobs, not the logits
            # (the bf16 subtraction can merge or split a near-tie).
            sampler = self._rows[i].sampler
            tok = int(sampler(_logprobs(sampler.process(logits))).item())
            self.stats.guarded += 1
            self._rows[i].guarded += 1
            if tok != fixed[i]:
                self.stats.guard_changed += 1
            fixed[i] = tok
        self._next = mx.array(fixed, dtype=mx.uint32)


def constrain_rows(logits: mx.array, constraints: list, emitted: list[int]) -> mx.array:
    """Batched logits [B, V] with each constrained row masked by its grammar, after that row's
    matcher has taken the token it emits now (``emitted[i]``); unconstrained rows pass through
    unchanged (a where() on True is the identity), so their numerics stay serial's.
    The per-row contract a batched path keeps (engine/decoders/constraint.py): ``settle`` a row's
    committed tokens, ``advance`` its drafts, then ``sampler.process(row_logits, drafts,
    start)`` gives its masked rows."""
    masks = []
    for c, t in zip(constraints, emitted):
        if c is not None and c.error is None:
            try:
                c.settle([t])
                masks.append(c.rows(0, 1))
                continue
            except (ConstraintError, ConstraintViolation) as exc:
                # That row alone fails (the worker reads ``error`` before delivering its
                # token); its next token is decided unmasked but never delivered.
                c.error = exc
        masks.append(mx.ones((1, logits.shape[-1]), dtype=mx.bool_))
    return mx.where(mx.concatenate(masks, axis=0), logits, mx.array(-mx.inf, dtype=logits.dtype))

