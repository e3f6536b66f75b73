"""The speculating batch's cycles queued ahead of the host's read (``CyclesAhead``, a part of
batch_spec.SpecBatchDecoder, which holds the rows, caches, head and stats it works on).

Depth 0 (``_step_ahead``): a depth-0 cycle of rows without a grammar needs nothing from the
host, its input being the last cycle's token, still on the device; it is queued before the
last one's tokens are read (as BatchDecoder's step is).

Cycles built ahead (``spec_ahead``; on CUDA by default, as speculative.py's pipeline): a
drafting cycle of plain greedy rows needs nothing from the host. Acceptance is decided on
the device (a row accepts while its draft equals the verify's argmax: a cumulative product
of the matches), and so is everything the next cycle starts from: the bonus token
(the argmax at the first mismatch), the head's pairs (the verify's hiddens and argmaxes,
of which the row keeps a_i + 1), the holes (``RaggedKVCache.punch_lazy``) and the
recurrent states at each row's last kept position (``keep_ragged`` with the counts on the
device). So the next cycle is built and queued while the device runs this one, and the
host reads this one after: the device never waits for Python to build a graph, which on a
64-layer model is most of a step (bench/step_split.py). Unlike speculative.py's pipeline
nothing is guessed: every cycle built ahead is the cycle the host would have built, so
its tokens stand (the same tokens as cycles built one at a time; a test). A row joining,
leaving or being taken out, or the head being replaced, undoes the cycle queued ahead
(``ragged_cache.BatchMark``; its device work is lost). A row capped below the batch's
depth accepts at most its cap, as in a cycle built one at a time. Rows with processors,
logprobs, a grammar or a sampler, and a lone row (whose caches trim on the host) take the
cycles built one at a time, as do drafting cycles shorter than 10 ms (``_builds_ahead``:
there the host is the bottleneck anyway and undone cycles cost).

Either kind of cycle, once queued, is undone (``_discard_ahead``) before anything else touches
the caches: a row joining, leaving or taken out, the head replaced, a cycle of another kind.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from ..caches.ragged_cache import BatchMark, RaggedKVCache, keep_kv, keep_ragged
from ..model.capture import capture_hidden
from ..prefill.mixed_forward import Ride, hidden_with
from ..types import DecodeStep
from .sampling import logprob_entries, logprobs as _logprobs
from .speculative import FLUSH_PENDING, PIPELINE_WINDOW

# Whether drafting cycles are long enough to build ahead is the shortest of the last
# AHEAD_WINDOW steady ones, decided once AHEAD_MIN_CYCLES are in: a fresh machine's first
# cycles trace and compile and cost several times a steady one (a cycle is never cheaper
# than its work, so the shortest is the cycle's own cost). A running mean seeded with them
# (call 7) and then their median (call 8) let a council of the bundled model on an H100
# (3-6 ms cycles) build cycles ahead in its first round, every one of them undone as rows
# left (bench/results/h100_2026-12-07c). Solo speculation reads its cycles the same way.
AHEAD_WINDOW = PIPELINE_WINDOW
AHEAD_MIN_CYCLES = 8
# Token ids gathered as float32 are exact below 2**24 (see _issue_drafting).
FLOAT32_EXACT_IDS = 1 << 24


class CyclesAhead:
    """Queues a cycle before the host reads the one before it. Mixed into SpecBatchDecoder:
    it reads the decoder's ``_rows``, ``_cache``, ``_hcache``, ``lm``, ``stats``, ``pipeline``,
    ``spec_ahead``, ``ahead_min_cycle_s``, ``depth_for`` and ``last_*`` fields and calls its
    ``_feed``, ``_drafts``, ``_primaries``, ``_row_cap`` and ``_end_cycle``."""

    # ------------------------------------------------------------------ depth 0, issued ahead
    # A depth-0 cycle of rows without a grammar needs nothing from the host: its input is the
    # last cycle's token, still on the device (processors count it there too). So, as BatchDecoder does, the next cycle's forward
    # is queued before this one's tokens are read, and the host's work (reading, committing,
    # the caller delivering) overlaps the device's. The cycle queued ahead has written its
    # position into the caches; until a later ``step`` adopts it, it is undone (one KV slot
    # trimmed, the GatedDeltaNet states it replaced put back) before anything else touches
    # the caches: a row joining or leaving, a cycle that drafts. Undoing restores the caches
    # exactly, and an adopted cycle computed what the cycle would compute anyway, so tokens
    # are the unpipelined decoder's, bit for bit.

    def _pipelines(self) -> bool:
        """Whether a depth-0 cycle may be issued ahead: no row with a grammar (its mask
        follows the token the host reads). A sampled row draws from its own key (undoing the
        cycle puts it back); a row with processors counts its tokens on the device."""
        return self.pipeline and all(r.sampler.constraint is None for r in self._rows)

    def _issue_d0(self, inputs: mx.array, ride: Ride | None = None) -> QueuedDepthZero:
        """Queue one depth-0 forward over ``inputs`` [B] (lazy) and each row's next token,
        carrying ``ride``'s piece where given. Undoing the cycle (``_discard_ahead``) undoes the
        rows' part only: the piece's cache is its own, and its result stands."""
        rows = self._rows
        saved = [list(c.cache) if isinstance(c, ArraysCache) else None for c in self._cache]
        # Before the draws: what undoing puts back. (Processors' counts need nothing: a cycle
        # queued ahead commits nothing; its tokens are counted when a step adopts it.)
        keys = [r.sampler._key for r in rows]
        hid = hidden_with(self.lm, inputs[:, None], self._cache, ride)
        logits = self.lm.logits(hid)  # [B, 1, V]
        # serial_decode's ops: the argmax of the logprobs (a near-tie can merge in the
        # subtraction); other rows through their own processors, drawing with their own key
        # (the ops the unpipelined cycle runs for them).
        plain_lp = _logprobs(logits[:, -1, :])
        picks, lps = mx.argmax(plain_lp, axis=-1), [plain_lp[i : i + 1] for i in range(len(rows))]
        if not all(r.plain for r in rows):
            cols = []
            for i, r in enumerate(rows):
                if r.plain:
                    cols.append(picks[i : i + 1])
                    continue
                lp = lps[i] = _logprobs(r.sampler.process(logits[i, :1]))
                cols.append(mx.argmax(lp, axis=-1) if r.sampler.greedy else r.sampler(lp).reshape(-1))
            picks = mx.concatenate(cols)
        picks = picks.astype(mx.uint32)
        mx.async_eval([picks, hid] + [c.state for c in self._cache]
                      + ([] if ride is None else [ride.hidden] + [c.state for c in ride.cache]))
        return QueuedDepthZero(hid, picks, lps, saved, keys)

    def _discard_ahead(self) -> None:
        """Undo the cycle issued ahead, if any: the caches as they were before it."""
        drafting, self._spec_ahead = self._spec_ahead, None
        if drafting is not None:
            self.stats.spec_ahead_undone += 1
            drafting.mark.restore()  # the rows' pending pairs are the read cycle's (_settle_drafting)
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return
        self.stats.ahead_undone += 1
        for r, key in zip(self._rows, ahead.keys):
            r.sampler._key = key
        for c, saved in zip(self._cache, ahead.saved):
            if saved is None:
                c.trim(1)
            else:
                c.cache = saved

    def _next_is_d0(self, k: int) -> bool:
        """Whether the next cycle (every row then has a pair to draft from) is depth 0."""
        return k == 0 or all(r.depth is not None and int(r.depth()) <= 0 for r in self._rows)

    def _step_ahead(self, head, k: int, t0: float, ride: Ride | None = None) -> dict[Hashable, DecodeStep]:
        rows, B = self._rows, len(self._rows)
        if head is not None and max(r.n_pending for r in rows) >= FLUSH_PENDING:
            self._feed(head)  # keep the head's history whole while nobody drafts
            # Evaluate the fed history now: left lazy, the head's KV graph holds the head's
            # weights, so an eviction between depth-0 cycles could not free them.
            mx.async_eval([c.state for c in self._hcache])
        # The piece rides in the first forward this step issues: this cycle's where none was
        # queued ahead, else the next one's (queued now, evaluated when the caller absorbs the
        # piece's hidden states: this iteration pays for it, as for a piece of its own).
        if self._ahead is not None:
            cur = self._ahead
            self.stats.ahead_used += 1
        else:
            cur, ride = self._issue_d0(self._primaries(), ride), None
        for i, r in enumerate(rows):  # processors count this cycle's tokens (lazily) before the next reads them
            r.sampler.commit(cur.picks[i : i + 1])
        # Queue the next cycle behind this one before reading it (the read waits for this one only).
        self._ahead = self._issue_d0(cur.picks, ride) if self._next_is_d0(k) else None
        picks = cur.picks.tolist()
        steps = {}
        for i, (r, tok) in enumerate(zip(rows, picks)):
            r.primary = tok
            if head is not None:
                r.pending_h.append(cur.hid[i : i + 1])
                r.pending_t.append(cur.picks[i : i + 1])
                r.n_pending += 1
            lp_entries = None
            if r.sampler.wants_logprobs:
                lp_entries = logprob_entries(r.sampler.logprob_arrays(cur.lps[i], cur.picks[i : i + 1]))
            steps[r.row_id] = DecodeStep(tokens=[tok], depth=0, drafted=0, accepted=0, accepted_mask=[],
                                         logprobs=lp_entries)
        self.stats.tokens += B
        return self._end_cycle(steps, t0)

    # ------------------------------------------------------------------ drafting cycles, built ahead
    @property
    def drafting_s(self) -> float | None:
        """A steady drafting cycle's wall time (the shortest of the last AHEAD_WINDOW), once
        AHEAD_MIN_CYCLES have run; None before."""
        times = self._drafting_times
        return min(times) if len(times) >= AHEAD_MIN_CYCLES else None

    def _builds_ahead(self, head, k: int) -> bool:
        """Whether a drafting cycle at depth k can be decided on the device (the module's
        docstring), and whether that pays: plain greedy rows without logprobs (a row capped
        below k accepts at most its cap, as in a cycle built one at a time), two or more
        (ragged caches: a lone row's trim is the host's), no compaction due, and drafting
        cycles that take PIPELINE_MIN_CYCLE_S or more. Where they
        are shorter the host is the bottleneck anyway and rows joining and leaving undo cycles
        built ahead: a council of the bundled model on an H100 (3-6 ms cycles) decoded at
        0.85x with them, its first round far slower (bench/results/h100_2026-12-07c, call 6);
        the 27B shape's 20-35 ms cycles gained 1.19-1.24x (call 5). (``drafting_s``: after
        AHEAD_MIN_CYCLES steady ones.)"""
        rows = self._rows
        if not (self.spec_ahead and head is not None and k > 0 and len(rows) >= 2):
            return False
        if self.ahead_min_cycle_s > 0 and (self.drafting_s is None or self.drafting_s < self.ahead_min_cycle_s):
            return False  # (a floor of 0: at once, what the tests and the benchmark's arm ask)
        if not all(r.plain and not r.sampler.wants_logprobs for r in rows):
            return False
        attention = [c for c in self._cache + (self._hcache or []) if not isinstance(c, ArraysCache)]
        return all(isinstance(c, RaggedKVCache) and not c.holes_due() for c in attention)

    def _issue_drafting(self, head, ks: list[int], prev: QueuedDrafting | None) -> QueuedDrafting:
        """Build and queue one drafting cycle, row i drafting ks[i] (the batch drafts max(ks):
        a row accepts at most its own), acceptance and rollback included, without reading
        anything: from the rows' pending pairs and primaries (``prev`` None), or from
        ``prev``, the cycle queued before it and not yet read."""
        K = max(ks)
        T = K + 1
        mark = BatchMark(self._cache + self._hcache)
        if prev is None:
            g, primaries = self._feed(head), self._primaries()
        else:
            g, primaries = self._feed_lazy(head, prev), prev.bonus
        drafts, _ = self._drafts(head, K, ks, g)
        tokens = mx.stack([primaries] + drafts, axis=1)  # [B, T]
        rec: list = []
        hid = capture_hidden(self.lm, tokens, self._cache, rec)
        picks = mx.argmax(_logprobs(self.lm.logits(hid)), axis=-1).astype(mx.uint32)  # [B, T], as step's plain rows
        # greedy_accepted on the device: a row accepts while its draft equals the argmax before
        # it, up to its own depth.
        matched = mx.cumprod((tokens[:, 1:] == picks[:, :-1]).astype(mx.int32), axis=1).sum(axis=1)  # [B]
        accepted = mx.minimum(matched, mx.array(ks, dtype=mx.int32))
        keep_ragged(self._cache, rec, accepted + 1, T)
        if K > 1:
            for c in self._hcache:
                c.trim(K - 1)  # the head's speculative slots
        # The next primary. Gathered as float32 where that is exact: MLX-on-CUDA compiles a
        # module per (values, indices) dtype pair at its first use (2.5-8 s on a fresh machine)
        # and the prebuild compiled float32's before ready (jit/prebuild_recipes.py), not uint32's.
        if self.lm.text_args.vocab_size < FLOAT32_EXACT_IDS:
            bonus = mx.take_along_axis(picks.astype(mx.float32), accepted[:, None], axis=1)[:, 0].astype(mx.uint32)
        else:
            bonus = mx.take_along_axis(picks, accepted[:, None], axis=1)[:, 0]
        host = mx.concatenate([picks.reshape(-1).astype(mx.int32), accepted.astype(mx.int32)])
        mx.async_eval([host, hid, bonus] + [c.state for c in self._cache + self._hcache])
        return QueuedDrafting(list(ks), hid, picks, accepted, bonus, host, mark)

    def _feed_lazy(self, head, prev: QueuedDrafting) -> mx.array:
        """``_feed`` of ``prev``'s pairs before the host has read it: every row's K + 1 verify
        hiddens with the argmaxes after them, of which it keeps accepted + 1 (the rest become
        holes in the head's cache); returns each row's head output at its last kept pair."""
        T = prev.picks.shape[1]
        out = head(prev.hid, prev.picks, self._hcache)
        for c in self._hcache:
            keep_kv(c, prev.accepted + 1, T)
        return mx.take_along_axis(out, prev.accepted[:, None, None], axis=1)  # [B, 1, H]

    def _adopt_drafting(self, head, t0: float) -> dict[Hashable, DecodeStep]:
        """This step's cycle was queued by the last one: its feed took the rows' pending pairs."""
        cur, self._spec_ahead = self._spec_ahead, None
        self.stats.spec_ahead_used += 1
        for r in self._rows:
            r.pending_h, r.pending_t, r.n_pending = [], [], 0
        K = max(cur.ks)
        self.last_transition = K != self.last_depth
        self.last_depth, self.last_positions = K, len(self._rows) * (K + 1)
        return self._run_drafting(head, cur, t0)

    def _run_drafting(self, head, cur: QueuedDrafting, t0: float) -> dict[Hashable, DecodeStep]:
        """Queue the next drafting cycle behind ``cur`` where it can be decided on the device,
        then read ``cur`` (the read waits for ``cur`` only) and commit it."""
        k = max(0, int(self.depth_for(len(self._rows))))
        ks = [self._row_cap(r, k) for r in self._rows]  # every row has cur's pairs to draft from
        nxt = self._issue_drafting(head, ks, cur) if self._builds_ahead(head, max(ks)) else None
        steps = self._settle_drafting(cur)
        self._spec_ahead = nxt
        if nxt is None:  # nothing queued on these caches: compact where holes are due
            for c in self._cache + self._hcache:
                if isinstance(c, RaggedKVCache) and c.holes_due():
                    c.compact()
        return self._end_cycle(steps, t0)

    def _settle_drafting(self, cur: QueuedDrafting) -> dict[Hashable, DecodeStep]:
        """The host's one read of a drafting cycle: each row commits accepted + 1 tokens and
        queues its pairs (fed by the next cycle, or kept should it be undone)."""
        t_read = time.perf_counter()
        vals = cur.host.tolist()
        self.stats.read_wait_s += time.perf_counter() - t_read
        rows, B, K = self._rows, len(self._rows), max(cur.ks)
        T = K + 1
        steps, holes = {}, 0
        for i, r in enumerate(rows):
            a = vals[B * T + i]
            committed = vals[i * T : i * T + a + 1]  # greedy: the accepted drafts are the argmaxes
            ids = mx.array(committed, dtype=mx.uint32)
            r.sampler.commit(ids)
            r.primary = committed[-1]
            r.pending_h, r.pending_t, r.n_pending = [cur.hid[i : i + 1, : a + 1]], [ids], a + 1
            ki = cur.ks[i]
            steps[r.row_id] = DecodeStep(tokens=committed, depth=ki, drafted=ki, accepted=a,
                                         accepted_mask=[True] * a + [False] * (ki - a))
            holes += K - a
            self.stats.drafted += ki
            self.stats.accepted += a
            self.stats.tokens += a + 1
        # The verify's holes, and the same in the head's cache (the next feed punches them).
        for c in self._cache + self._hcache:
            if isinstance(c, RaggedKVCache):
                c.n_holes += holes
        return steps


@dataclass
class QueuedDrafting:
    """A drafting cycle built and queued, decided on the device: each row's depth, the verify
    hiddens [B, K+1, H], argmaxes [B, K+1], accepted counts [B], the next primaries [B], what
    the host reads (argmaxes then counts, int32), and the caches before it."""
    ks: list
    hid: mx.array
    picks: mx.array
    accepted: mx.array
    bonus: mx.array
    host: mx.array
    mark: BatchMark


@dataclass
class QueuedDepthZero:
    """A depth-0 cycle queued ahead: its hiddens, next tokens and each row's logprobs (lazy),
    the GatedDeltaNet states its forward replaced, per layer (None for attention layers: one
    slot to trim), and each row's sampler key before it drew."""
    hid: mx.array
    picks: mx.array
    lps: list
    saved: list
    keys: list
