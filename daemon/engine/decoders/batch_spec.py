"""Speculation inside the continuous batch: every row drafts, one verify scores them all.

Row state at a cycle boundary, per row, as speculative.py keeps it for one request:
- the base cache holds positions 0..P-1; ``primary`` (the last committed token, or the
  prompt's last) sits at P, not yet forwarded;
- the head's KV holds committed slots; slot S is the pair (base hidden at S, real token
  S+1); pairs not yet fed wait in the row's ``pending`` list, which (once the row has
  decoded a cycle or was prefilled with a head) ends with (base hidden at P-1, primary).

One cycle (``step``), at the batch's depth K = ``depth_for(B)``, row i drafting k_i <= K:
1. draft: one head forward over every row's pending pairs (padded to the longest; the pads
   become holes, ragged_cache.py), each row's first draft from its last real pair, then
   K-1 batched single steps (speculative slots). A row drafts with its own sampler and
   processors (``speculative.draft_token``); a row with k_i < K ignores the extra drafts.
2. verify: ONE base forward over [primary_i, d_i1..d_iK] for every row ([B, K+1]),
   through the capturing GatedDeltaNet walk (forward.capture_hidden).
3. accept per row: greedy rows while the draft equals the argmax (``greedy_accepted``),
   sampled rows by rejection sampling (``speculative.rejection_sample``); each row's
   processors see its own committed history plus its drafts, as in serial decode.
4. commit per row a_i + 1 tokens: attention KV keeps its first a_i + 1 verify slots (the
   rest become holes, the row's offset drops by their number); GatedDeltaNet conv and
   recurrent state are gathered at the row's last kept index; the head drops its K-1
   speculative slots and queues the committed pairs.

With one row the caches are that row's own plain ones (KVCache trims instead of holes), so
a lone row runs the ops speculative_decode runs; two or more are merged (mlx-lm's
ArraysCache.merge, RaggedKVCache.merge) and dropping back to one extracts the survivor.

Exactness: a greedy row's tokens are the verify's argmaxes, so an exact row is serial's
tokens wherever the batched verify's logits are bit-identical to one-token steps:
``batch_matches_serial`` (batched forwards), ``verify_matches_serial`` (a verify vs serial
steps) and ``exactness.ragged_verify_matches_serial`` (rows verified together, keeping
ragged prefixes, then verified through the holes) together, probed once; elsewhere ``admits`` refuses exact greedy rows (they
decode alone). Constrained rows (constraint.py) draw each draft under their grammar's mask
(the matcher takes every draft, a host read per draft), verify under the same masks and
settle the matcher on the committed tokens. There is no near-tie guard here. Not done in the
batch (solo speculation has them): the draft stopper, the loop guard. A depth-0 cycle is queued
ahead, as BatchDecoder's step is, unless a row has a grammar (``_step_ahead``).

Prompt lookup (lookup.py), for greedy rows without a grammar that were added with
``lookup``: where a row's committed tail recurs in its prompt and output, a cycle verifies the
block that followed it (no head forward: a lookup cycle). When any row has a block, that
cycle is a lookup cycle (a cycle queued ahead is undone first): rows with a block verify it,
the others their head's drafts at the batch's depth (at depth 0 their primary alone), all in
one forward; each row commits what a verify of its own would (greedy: the verify's argmaxes,
so tokens are the same whatever was drafted). Why: a council's seats copy code and tables from their context, and a lone request
drafted such blocks while the same request in the batch decoded a token a cycle (on an H100,
four HTTP streams of 256 tokens gave 0.91x one stream: bench/results/h100_2026-12-07g). A
block is at most ``LookupConfig.max_draft`` tokens: the caller caps it so a verify stays
within the rows the exactness probes and the invariant kernels cover.

Cycles queued ahead of the host's read (depth 0, and drafting cycles decided on the device)
are batch_ahead.py's (``CyclesAhead``, which this decoder inherits).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache

from ..caches.batch_rows import DEFAULT_MAX_ROWS, RowBatch
from ..caches.head_history import HeadHistory
from ..caches.ragged_cache import RaggedKVCache, keep_kv, keep_ragged
from ..model.capture import capture_hidden
from ..model.model import LoadedModel
from ..prefill.mixed_forward import Ride, hidden_with
from ..prefill.prefill import PREFILL_CHUNK
from ..types import DecodeStep
from .batch import batch_matches_serial
from .batch_ahead import AHEAD_WINDOW, CyclesAhead, QueuedDepthZero, QueuedDrafting
from .constraint import ConstraintError, ConstraintViolation
from .exactness import ragged_verify_matches_serial, verify_matches_serial
from .lookup import LookupConfig, PromptLookup
from .sampling import Sampler, logprob_entries, logprobs as _logprobs
from .speculative import (FLUSH_PENDING, PIPELINE_MIN_CYCLE_S, draft_token, greedy_accepted, prefill_with_hidden,
                          rejection_sample, resolve_pipeline, sampled_accepted)


@dataclass
class SpecRow:
    row_id: Hashable
    sampler: Sampler
    exact: bool
    primary: int
    depth: Callable[[], int] | None  # the row's own ceiling (None: the batch's depth)
    pending_h: list = field(default_factory=list)  # [1, n, H] base hiddens
    pending_t: list = field(default_factory=list)  # [n] uint32 next tokens
    n_pending: int = 0
    lookup: PromptLookup | None = None  # over every token up to and including primary

    @property
    def plain(self) -> bool:
        """Greedy without processors or a grammar: decided by one batched argmax."""
        return self.sampler.greedy and not self.sampler.processing and self.sampler.constraint is None

    @property
    def grammar(self):
        """The row's constraint while it holds (None: none, or it failed: the worker then
        fails the row before delivering anything this cycle decided)."""
        con = self.sampler.constraint
        return con if con is not None and con.error is None else None


@dataclass
class SpecBatchStats:
    cycles: int = 0
    row_cycles: int = 0
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    ahead_used: int = 0  # depth-0 cycles that ran issued ahead of the previous one's read
    ahead_undone: int = 0  # cycles issued ahead and undone (a row joined or left, the depth rose)
    spec_ahead_used: int = 0  # drafting cycles built ahead of the previous one's read, and run
    spec_ahead_undone: int = 0  # drafting cycles built ahead and undone (a row joined or left)
    read_wait_s: float = 0.0  # the host's time in drafting cycles' one read: waiting for the device
    lookup_cycles: int = 0  # cycles that verified prompt-lookup blocks
    lookup_drafted: int = 0
    lookup_accepted: int = 0


def resolve_batch_lookup(setting: bool | None) -> bool:
    """None ("auto", the config's default): rows draft lookup blocks on CUDA, where a verify of
    a few positions a row costs about what one does (bench/results/h100_2026-12-07f): four HTTP
    streams of 256 tokens ran 1.40x and 1.50x the batch without it on an H100
    (bench/results/h100_2026-12-07h). Not on the CPU, where each position is a row of work:
    four HTTP streams of repetitive output ran 0.59x with it
    (bench/results/batch_lookup_cpu_2026-12-07); not on Metal until it is measured there."""
    if setting is not None:
        return setting
    return mx.default_device() == mx.gpu and not mx.metal.is_available()


class SpecBatchDecoder(CyclesAhead, RowBatch):
    """Drive from one thread, at cycle boundaries: ``add`` / ``remove`` / ``extract`` /
    ``step``. ``head`` returns the resident MTP head (or None); ``depth_for(B)`` the batch's
    depth at height B (``HeadSlot.depth_for``). The rows and the joining and leaving of
    their caches (base and head alike) are batch_rows.RowBatch's."""

    refusal = ("this backend's batched verify is not bit-identical to serial steps: a row that must be exact at "
               "temperature 0 decodes alone")

    @staticmethod
    def merge_layer(c):
        """Attention layers become RaggedKVCaches (rows keep different verify prefixes)."""
        if isinstance(c, ArraysCache):
            out = ArraysCache.merge([c])
            out.left_padding = None  # an all-empty merge sets it; a zero state needs no mask
            return out
        return RaggedKVCache.merge([c])

    def __init__(self, lm: LoadedModel, head: Callable[[], object | None], depth_for: Callable[[int], int],
                 exact_ok: bool | None = None, max_rows: int = DEFAULT_MAX_ROWS, prefill_chunk: int = PREFILL_CHUNK,
                 pipeline: bool = True, spec_ahead: bool | None = None,
                 ahead_min_cycle_s: float = PIPELINE_MIN_CYCLE_S):
        """``pipeline``: queue a depth-0 cycle ahead (see ``_step_ahead``); False runs every
        cycle to its end first (the benchmark's "before" arm). ``spec_ahead``: build drafting
        cycles ahead (batch_ahead.py); None: on CUDA only
        (``speculative.resolve_pipeline``), never where ``pipeline`` is False, and only once
        drafting cycles take ``ahead_min_cycle_s`` or more (``_builds_ahead``; 0: from the
        first cycle that can be)."""
        super().__init__(max_rows)
        self.lm = lm
        self.pipeline = pipeline
        self.spec_ahead = pipeline and resolve_pipeline(spec_ahead)
        self.ahead_min_cycle_s = ahead_min_cycle_s
        self.head_fn = head
        self.depth_for = depth_for
        if exact_ok is None:
            exact_ok = (batch_matches_serial(lm, max_rows) and verify_matches_serial(lm, "capture")
                        and ragged_verify_matches_serial(lm))
        self.exact_ok = exact_ok
        self.prefill_chunk = prefill_chunk
        self.stats = SpecBatchStats()
        self._cache: list | None = None  # base: one row's own, or merged per layer
        self._hcache: list | None = None  # the head's, likewise
        self._head = None  # the head whose history _hcache holds
        self._ahead: QueuedDepthZero | None = None  # a depth-0 cycle queued before the last one was read
        self._spec_ahead: QueuedDrafting | None = None  # a drafting cycle queued before the last one was read
        self._drafting_times: deque = deque(maxlen=AHEAD_WINDOW)  # steady drafting cycles' wall times
        self.last_depth = 0
        self.last_positions = 0  # the last cycle's forward: rows x (depth + 1) positions
        # Whether the last cycle was a transition (DecodeStep.transition): the first at its
        # depth, or one whose head feed caught up on pairs queued at a lower depth or by a
        # joining row. Its cost is not its depth's steady cost (governor/cost_model.py).
        self.last_transition = False
        self.last_source = "head"  # "lookup": the last cycle verified prompt-lookup blocks

    # ------------------------------------------------------------------ the head
    def _live_head(self):
        head = self.head_fn()
        if head is None or getattr(head, "unloaded", False):
            head = None
        if head is not self._head:  # evicted or replaced: its history means nothing now
            self._discard_ahead()
            self._head = head
            self._hcache = None if head is None or not self._rows else self._fresh_head_cache(len(self._rows))
            for r in self._rows:
                r.pending_h, r.pending_t, r.n_pending = [], [], 0
        return head

    def _fresh_head_cache(self, n: int) -> list:
        one = self._head.make_cache()
        return one if n == 1 else [RaggedKVCache.merge([KVCache() for _ in range(n)]) for _ in one]

    # ------------------------------------------------------------------ admission
    def admits(self, sampler: Sampler, exact: bool) -> bool:
        """Any row but an exact greedy one where the batched verify is not bit-identical.
        Constrained rows batch too (``_drafts`` and ``step`` keep each row's grammar)."""
        return not (exact and sampler.greedy) or self.exact_ok

    def add(self, row_id: Hashable, sampler: Sampler, prompt: list[int], *, cache: list | None = None,
            history: HeadHistory | None = None, exact: bool = False, depth: Callable[[], int] | None = None,
            lookup: LookupConfig | None = None, context: list[int] = ()) -> None:
        """Admit a row at a cycle boundary. ``cache`` holds everything before ``prompt``;
        all of ``prompt`` but its last token is prefilled here (as speculative_decode's
        prefill), the last is the row's primary. ``history``: the row's head history (its
        KV and pending pairs, from a prefill or ``extract``). ``lookup``: draft prompt-lookup
        blocks for this row (a greedy row without a grammar) from ``context`` (the tokens
        before ``prompt``: the rest of the prompt, and what the row generated before it
        joined) and what it commits."""
        self._check_join(row_id, sampler, exact)
        if not prompt:
            raise ValueError("a stream needs at least one prompt token")
        self._discard_ahead()
        head = self._live_head()
        cache = cache if cache is not None else self.lm.make_cache()
        if history is None or history.head is not head:
            history = HeadHistory(head)
        primary = int(prefill_with_hidden(self.lm, prompt, cache, history, self.prefill_chunk).item())
        row = SpecRow(row_id, sampler, exact, primary, depth)
        if lookup is not None and sampler.greedy and sampler.constraint is None:
            row.lookup = PromptLookup(list(context) + list(prompt), lookup)
        if head is not None:
            row.pending_h, row.pending_t, row.n_pending = list(history.h), list(history.t), history.n
        hcache = history.cache
        mx.eval([c.state for c in cache] + history.state())
        merged = bool(self._rows)
        self._cache = self._joined(self._cache, cache)
        # A batch without a head keeps none (a first row brings its own, None or not).
        self._hcache = self._joined(self._hcache, hcache) if self._hcache is not None or not merged else None
        if merged:
            mx.eval([c.state for c in self._cache + (self._hcache or [])])
        self._rows.append(row)

    # ------------------------------------------------------------------ leaving
    def remove(self, row_id: Hashable) -> None:
        i = self._index(row_id)
        self._discard_ahead()
        self._drop(i)

    def extract(self, row_id: Hashable) -> tuple[list, int, HeadHistory]:
        """Take a row out with its state: (plain cache holding everything before primary,
        primary, its head history). Resume alone with ``speculative_decode(lm, head,
        [primary], sampler, ..., cache=, history=)`` or rejoin with ``add``."""
        i = self._index(row_id)
        self._discard_ahead()
        row = self._rows[i]
        cache = self._taken_out(self._cache, i)
        hcache = self._taken_out(self._hcache, i) if self._hcache is not None else None
        hist = HeadHistory(self._head)
        if self._head is not None:
            hist.cache = hcache
            hist.h, hist.t, hist.n = list(row.pending_h), list(row.pending_t), row.n_pending
        mx.eval([c.state for c in cache] + hist.state())
        self._drop(i)
        return cache, row.primary, hist

    def _drop(self, i: int) -> None:
        keep = self._drop_row(i)
        self._cache = self._kept(self._cache, keep)
        self._hcache = self._kept(self._hcache, keep) if self._hcache is not None else None
        if keep:
            mx.eval([c.state for c in self._cache + (self._hcache or [])])

    # ------------------------------------------------------------------ decoding
    def _row_depth(self, row: SpecRow, k: int) -> int:
        if row.n_pending == 0:
            return 0  # nothing to draft from yet: this cycle's verify makes the pair
        return self._row_cap(row, k)

    @staticmethod
    def _row_cap(row: SpecRow, k: int) -> int:
        """The depth row drafts at in a batch at depth k: k, or the row's own ceiling below it."""
        return k if row.depth is None else max(0, min(k, int(row.depth())))

    def _feed(self, head) -> mx.array:
        """Every row's pending pairs through the head (committed slots), padded to the
        longest; returns each row's head output at its last real pair, [B, 1, H]."""
        rows = self._rows
        n = [r.n_pending for r in rows]
        T = max(n)
        H = self.lm.text_args.hidden_size
        dtype = next(r.pending_h[0].dtype for r in rows if r.pending_h)
        hs, ts = [], []
        for r, ni in zip(rows, n):
            h = [x.astype(dtype) for x in r.pending_h] + ([mx.zeros((1, T - ni, H), dtype=dtype)] if ni < T else [])
            t = list(r.pending_t) + ([mx.zeros((T - ni,), dtype=mx.uint32)] if ni < T else [])
            hs.append(mx.concatenate(h, axis=1) if len(h) > 1 else h[0])
            ts.append((mx.concatenate(t) if len(t) > 1 else t[0])[None])
            r.pending_h, r.pending_t, r.n_pending = [], [], 0
        out = head(mx.concatenate(hs), mx.concatenate(ts), self._hcache)
        if T > min(n):
            for c in self._hcache:
                keep_kv(c, n, T)
        last = mx.array([max(ni - 1, 0) for ni in n], dtype=mx.int32)
        return mx.take_along_axis(out, last[:, None, None], axis=1)  # [B, 1, H]

    def _drafts(self, head, K: int, ks: list[int], g: mx.array | None = None) -> tuple[list[mx.array], list[list]]:
        """K rounds of drafts: per round one [B] token array; per row its log q's (sampled).
        ``g``: the head's output to draft the first from (default: ``_feed``'s)."""
        rows = self._rows
        g = self._feed(head) if g is None else g
        drafts, logq = [], [[] for _ in rows]
        for j in range(K):
            if j:
                g = head(g, drafts[-1][:, None], self._hcache)
            logits = head.logits(g)[:, -1, :]  # [B, V]
            plain = mx.argmax(logits, axis=-1).astype(mx.uint32)
            own = [i for i, r in enumerate(rows) if not r.plain and j < ks[i]]  # their own sampler/processors
            if not own:
                drafts.append(plain)
                continue
            cols = []
            for i, r in enumerate(rows):
                if i not in own:
                    cols.append(plain[i : i + 1])
                    continue
                before = [d[i : i + 1] for d in drafts]
                if j and r.grammar is not None:
                    # The mask this draft is drawn under follows the last draft: the matcher
                    # takes it first (a host read per draft, as in solo speculation).
                    self._grammar_step(r, lambda: r.grammar.advance([before[-1].item()]))
                if r.sampler.constraint is not None and r.grammar is None:  # failed: never delivered
                    d, ql = plain[i : i + 1], mx.log(mx.softmax(logits[i : i + 1].astype(mx.float32), axis=-1))
                else:
                    d, ql, _ = draft_token(r.sampler, logits[i : i + 1], before)
                cols.append(d)
                logq[i].append(ql)
            drafts.append(mx.concatenate(cols))
        # Each constrained row's matcher takes its last draft: the verify's row k_i is masked
        # by the state after all k_i drafts (the masks drafts were drawn under are reused).
        for i, r in enumerate(rows):
            if ks[i] and r.grammar is not None:
                self._grammar_step(r, lambda: r.grammar.advance([drafts[ks[i] - 1][i].item()]))
        return drafts, logq

    @staticmethod
    def _grammar_step(row: SpecRow, fn: Callable[[], object]) -> None:
        """Run a matcher call; a failing grammar fails that row alone (its ``error`` is set,
        which the worker reads before delivering the row's tokens)."""
        try:
            fn()
        except (ConstraintError, ConstraintViolation) as exc:
            row.sampler.constraint.error = exc

    def _processed(self, row: SpecRow, logits: mx.array, drafts: mx.array) -> mx.array:
        """The row's processors and grammar over its verify logits; a grammar that fails
        here fails the row (unmasked logits, never delivered)."""
        if row.sampler.constraint is not None and row.grammar is None:
            return logits
        try:
            return row.sampler.process(logits, drafts)
        except (ConstraintError, ConstraintViolation) as exc:
            row.sampler.constraint.error = exc
            return logits

    def step(self, ride: Ride | None = None) -> dict[Hashable, DecodeStep]:
        """One cycle for every row; returns {row_id: DecodeStep} (tokens may run past EOS).
        ``ride``: a prompt's piece a depth-0 forward of this step may carry
        (mixed_forward.py); ``ride.hidden`` is set where one did (a cycle that drafts never
        carries one: its verify's positions are the rows' own)."""
        if not self._rows:
            return {}
        rows = list(self._rows)
        steps = self._cycle(ride)
        for r in rows:  # each row's lookup reads every token it committed
            if r.lookup is not None and r.row_id in steps:
                r.lookup.extend(steps[r.row_id].tokens)
        return steps

    def _lookup_blocks(self) -> list[list[int]] | None:
        """Each row's prompt-lookup block for this cycle ([] for none), or None where no row
        has one. Asked once a cycle (a row's lookup counts its backing off in cycles)."""
        blocks = [r.lookup.propose() if r.lookup is not None else [] for r in self._rows]
        return blocks if any(blocks) else None

    def _cycle(self, ride: Ride | None) -> dict[Hashable, DecodeStep]:
        t0 = time.perf_counter()
        rows, B = self._rows, len(self._rows)
        head = self._live_head()  # a replaced head undoes a cycle queued ahead
        self.last_source = "head"
        if self._spec_ahead is not None:
            return self._adopt_drafting(head, t0)
        k = max(0, int(self.depth_for(B))) if head is not None else 0
        blocks = self._lookup_blocks()
        if blocks is not None:
            return self._lookup_cycle(head, blocks, k, t0)
        ks = [self._row_depth(r, k) for r in rows]
        K = max(ks)
        # The depth this cycle's forward verified (rows may cap below the batch's k): what the
        # governor's cost(B, k) learns from. A batch of depth-0 rows ("off", capped) is a
        # depth-0 cycle, whatever depth_for said, or its cost would be booked against k.
        self.last_transition = K != self.last_depth or (K > 0 and max(r.n_pending for r in rows) > K + 1)
        self.last_depth = K
        self.last_positions = B * (K + 1)
        if K == 0 and self._pipelines():
            return self._step_ahead(head, k, t0, ride)
        self._discard_ahead()
        if K and self._builds_ahead(head, K):
            return self._run_drafting(head, self._issue_drafting(head, ks, None), t0)
        if K:
            drafts, logq = self._drafts(head, K, ks)
            spec_slots = K - 1
        else:
            (drafts, logq), spec_slots = self._no_drafts(head), 0
        return self._verify(head, ks, drafts, logq, spec_slots, t0, ride)

    def _no_drafts(self, head) -> tuple[list, list[list]]:
        """A cycle where the head drafts for no row: no draft columns, and the head fed the
        rows' pending positions once they pile up, to keep its history whole."""
        if head is not None and max(r.n_pending for r in self._rows) >= FLUSH_PENDING:
            self._feed(head)
        return [], [[] for _ in self._rows]

    def _lookup_cycle(self, head, blocks: list[list[int]], k: int, t0: float) -> dict[Hashable, DecodeStep]:
        """Verify every row's lookup block, and the others' head drafts at the batch's depth
        ``k`` (none at depth 0), in one forward."""
        self._discard_ahead()  # its input was the last token read: this cycle starts there
        rows = self._rows
        heads = [0 if b else self._row_depth(r, k) for b, r in zip(blocks, rows)]  # rows the head drafts for
        Kh = max(heads)
        ks = [len(b) or kh for b, kh in zip(blocks, heads)]
        K = max(ks)
        self.last_transition = K != self.last_depth or self.last_source != "lookup"
        self.last_depth, self.last_positions, self.last_source = K, len(rows) * (K + 1), "lookup"
        drafts, logq = self._drafts(head, Kh, heads) if Kh else self._no_drafts(head)
        from_blocks = [bool(b) for b in blocks]
        from_block = mx.array(from_blocks)
        block = mx.array([b + [0] * (K - len(b)) for b in blocks], dtype=mx.uint32)  # [B, K]; pads are never judged
        cols = [mx.where(from_block, block[:, j], drafts[j] if j < Kh else block[:, j]) for j in range(K)]
        self.stats.lookup_cycles += 1
        return self._verify(head, ks, cols, logq, max(Kh - 1, 0), t0, None, from_blocks=from_blocks)

    def _verify(self, head, ks: list[int], drafts: list[mx.array], logq: list[list], spec_slots: int, t0: float,
                ride: Ride | None, from_blocks: list[bool] | None = None) -> dict[Hashable, DecodeStep]:
        """Verify every row's primary and its ``ks[i]`` drafts (``drafts``: K [B] token
        arrays) in one forward, accept and commit per row; ``spec_slots``: the head's
        speculative slots to drop after; ``from_blocks[i]``: row i's drafts are its lookup
        block (its lookup learns the outcome, and they count apart from the head's)."""
        rows, B, K = self._rows, len(self._rows), max(ks)
        tokens = mx.stack([self._primaries()] + drafts, axis=1)  # [B, K+1]
        T = K + 1

        # 2. verify every row at once, keeping the per-position GatedDeltaNet states.
        # (At depth 0 every row keeps its one position: the plain forward, BatchDecoder's.)
        rec: list = []
        hid = capture_hidden(self.lm, tokens, self._cache, rec) if K else hidden_with(self.lm, tokens, self._cache, ride)
        logits = self.lm.logits(hid)  # [B, T, V]
        plain_lp = _logprobs(logits) if any(r.plain for r in rows) else None
        plain_picks = mx.argmax(plain_lp, axis=-1) if plain_lp is not None else None  # [B, T]

        # 3. acceptance, down to one int array the host reads: every row's verify inputs
        # and (plain rows) argmaxes as two [B, T] blocks, then per other row its picks and coins.
        lps, host = {}, [tokens.reshape(-1)]
        if plain_picks is not None:
            host.append(plain_picks.reshape(-1))
        for i, r in enumerate(rows):
            if r.plain:
                continue
            ki = ks[i]
            d_i = tokens[i, 1 : ki + 1]
            lp = lps[i] = _logprobs(self._processed(r, logits[i, : ki + 1], d_i))
            if r.sampler.greedy:
                picks, coins = mx.argmax(lp, axis=-1), mx.zeros((ki,), dtype=mx.int32)
            elif ki == 0:
                picks, coins = r.sampler(lp).reshape(-1), mx.zeros((0,), dtype=mx.int32)
            else:
                picks, coins = rejection_sample(r.sampler, lp, d_i, logq[i][:ki])
            host += [picks.reshape(-1), coins.reshape(-1)]
        t_read = time.perf_counter()
        vals = mx.concatenate([x.astype(mx.int32) for x in host]).tolist()
        self.stats.read_wait_s += time.perf_counter() - t_read

        steps, keep = {}, []
        inputs = [vals[i * T : (i + 1) * T] for i in range(B)]
        argmaxes = [vals[(B + i) * T : (B + i + 1) * T] for i in range(B)] if plain_picks is not None else None
        pos = (2 if plain_picks is not None else 1) * B * T
        for i, r in enumerate(rows):
            ki = ks[i]
            d_l = inputs[i][1 : ki + 1]
            if r.plain:
                picks, coins = argmaxes[i][: ki + 1], []
            else:
                picks, coins = vals[pos : pos + ki + 1], vals[pos + ki + 1 : pos + 2 * ki + 1]
                pos += 2 * ki + 1
            a = greedy_accepted(picks, d_l) if r.sampler.greedy else sampled_accepted(coins)
            committed = d_l[:a] + [picks[a]]
            keep.append(a + 1)
            ids = mx.array(committed, dtype=mx.uint32)
            lp_entries = None
            if r.sampler.wants_logprobs:
                lp = lps[i] if i in lps else plain_lp[i, : ki + 1]
                lp_entries = logprob_entries(r.sampler.logprob_arrays(lp[: a + 1], ids))
            r.sampler.commit(ids)
            if r.grammar is not None:  # drafts that differ from the committed tokens roll back
                self._grammar_step(r, lambda: r.grammar.settle(committed))
            r.primary = committed[-1]
            if head is not None:
                r.pending_h.append(hid[i : i + 1, : a + 1])
                r.pending_t.append(ids)
                r.n_pending += a + 1
            block = bool(from_blocks and from_blocks[i])
            steps[r.row_id] = DecodeStep(tokens=committed, depth=ki, drafted=ki, accepted=a,
                                         accepted_mask=[True] * a + [False] * (ki - a), logprobs=lp_entries,
                                         draft_source="lookup" if block else "head")
            if block:
                r.lookup.record(ki, a)
                self.stats.lookup_drafted += ki
                self.stats.lookup_accepted += a
            else:
                self.stats.drafted += ki
                self.stats.accepted += a
            self.stats.tokens += a + 1

        # 4. every row keeps its own prefix of the verify; the head drops its speculative slots.
        keep_ragged(self._cache, rec, keep, T)
        if spec_slots:
            for c in self._hcache:
                c.trim(spec_slots)
        mx.async_eval([c.state for c in self._cache + (self._hcache or [])]
                      + [h for r in rows for h in r.pending_h[-1:]]
                      + ([] if ride is None or ride.hidden is None else [ride.hidden]))
        return self._end_cycle(steps, t0)

    def _end_cycle(self, steps: dict[Hashable, DecodeStep], t0: float) -> dict[Hashable, DecodeStep]:
        self.stats.cycles += 1
        self.stats.row_cycles += len(steps)
        if self.stats.cycles % 256 == 0:
            mx.clear_cache()
        dt = time.perf_counter() - t0
        for s in steps.values():
            s.cycle_s = dt
        if self.last_depth > 0 and not self.last_transition and self.last_source == "head":
            self._drafting_times.append(dt)  # a steady drafting cycle (_builds_ahead); a lookup cycle is not one
        return steps

    def _primaries(self) -> mx.array:
        return mx.array([r.primary for r in self._rows], dtype=mx.uint32)
