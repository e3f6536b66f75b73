"""How an admitted request decodes: its start, then the decode path it takes.

``start`` begins a request's chunked prefill (from the longest prefix the prefix cache
holds); when the prefill ends ``begin_decode`` picks its path: speculation when it runs
alone (the MTP head and prompt lookup draft, one verify checks), a row of the continuous
batch when others run too (speculating there where the batch does), else serial decode.
A solo speculative decode moves into the batch at its cycle boundary when others arrive
(``_hand_solo_to_batch``); a parked batch row rejoins with the state it left with.

``DecodePaths`` is a part of ``EngineWorker`` (worker.py): it is handed the configuration,
the loaded engine, the scheduler, the group, the prefix cache's use and the worker's
``_failed`` / ``_deliver`` / ``depth_pinned`` (a tensor-parallel rank overrides them) and
start-up's ``build_ahead``; the step loop there advances what these methods set up.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from protocol import messages as m

from ..engine.decoders.batch_spec import resolve_batch_lookup
from ..engine.decoders.lookup import LookupConfig
from ..engine.decoders.sampling import GREEDY_BELOW
from ..request_text.detokenize import CommittedText
from ..logs import get_logger
from ..request_text.requests import Job
from .kernel_choice import MAX_VERIFY_POSITIONS

if TYPE_CHECKING:
    from .loaded_engine import LoadedEngine
    from .prefix_cache_use import PrefixCacheUse
    from .scheduler import Scheduler

log = get_logger("councild.engine")


class InjectedFault(RuntimeError):
    """Raised by the debug_fail_after_tokens fault injection (config.py)."""


def _fail_after(gen, limit: int):
    """Pass decode steps through until ``limit`` tokens were committed, then raise from the
    next cycle, as a model failing mid-decode would. Test-only (debug_fail_after_tokens)."""
    n = 0
    try:
        for step in gen:
            yield step
            n += len(step.tokens)
            if n >= limit:
                raise InjectedFault(f"injected fault after {n} tokens (debug_fail_after_tokens = {limit})")
    finally:
        gen.close()


def requested_mode(msg, cfg) -> str:
    """The speculation mode a request asked for, else the configured one."""
    return msg.speculation or cfg.speculation.mode


def exact_greedy(msg, cfg) -> bool:
    """Exact at temperature 0 (as its sampler will count greedy): the requests the exactness
    verdicts (verify, batch, splits) speed up."""
    return requested_mode(msg, cfg) != "fast" and msg.temperature < GREEDY_BELOW


class DecodePaths:
    """Starting requests and choosing their decode path: ``start``, ``begin_decode``."""

    def __init__(self, cfg, engine: LoadedEngine, scheduler: Scheduler, group, prefix_use: PrefixCacheUse, *,
                 failed: Callable, deliver: Callable, depth_pinned: Callable[[], bool],
                 build_ahead: Callable[[], bool | None]):
        self.cfg = cfg
        self.engine = engine
        self.scheduler = scheduler
        self.group = group
        self.prefix_use = prefix_use
        self._failed = failed
        self._deliver = deliver
        self.depth_pinned = depth_pinned
        self._build_ahead = build_ahead

    def start(self, job: Job) -> None:
        """Begin an admitted job: its prompt's chunked prefill (engine/prefill/prefill.py), run one
        chunk per cycle by the worker's ``_advance``; its decode path is chosen when that ends."""
        from ..engine.decoders.sampling import Sampler
        from ..engine.types import SamplingParams

        if job.generator is not None:  # back from parking: its state was kept
            if job.parked_state is not None:
                state, job.parked_state = job.parked_state, None
                self._rejoin_batch(job, state)
            return
        if job.prefill is not None:  # parked mid-prefill: it continues where it stopped
            return
        p = job.msg
        job.sampler = Sampler(SamplingParams(
            temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed,
            **{name: p.option(name) for name in m.SAMPLING_DEFAULTS}), prompt=job.prompt,
            constraint=job.constraint)
        job.mode = requested_mode(p, self.cfg)
        # Only "fast" accepts batch-height rounding flips; "exact" and "off" promise serial's
        # tokens at temperature 0 (BatchDecoder.admits knows whether this backend keeps them).
        job.exact = job.mode != "fast"
        if job.mode == "exact" and self._exact_only_serially(job):
            # This backend's verify rounds unlike serial steps (or its verdict is not in yet,
            # warming.py): only serial is exact.
            job.mode = "off"
            # Until the verdict is in, its prompt's snapshots still carry the head's history:
            # the requests after the verdict speculate, and resume only from such snapshots
            # (a council's first turn would otherwise leave its second nothing to resume from).
            # begin_decode looks again: a verdict that came during the prefill lets it speculate.
            job.prefill_head = self.engine.verify_exact is None
        job.started_at = time.monotonic()
        self._open_prefill(job)

    def _exact_only_serially(self, job: Job) -> bool:
        """An exact greedy request is exact only as serial decode: the verify verdict is not
        in yet, or says verify rounds unlike serial steps and the operator chose serial then."""
        return job.sampler.greedy and not self.engine.verify_exact and (
            self.engine.verify_exact is None or self.cfg.speculation.exact_on_inexact_backend == "serial")

    def _open_prefill(self, job: Job, relook: bool = False) -> bool:
        """Give the job its chunked prefill from the longest prefix the prefix cache holds
        now. ``relook``: the job's prefill has not forwarded a token yet and the cache took
        snapshots since it looked: it starts from a longer prefix if one is there now (False,
        and the job untouched, if not)."""
        from ..engine.prefill.prefill import ChunkedPrefill

        chunk = self.scheduler.cfg.prefill_chunk
        want_head = (job.mode != "off" or job.prefill_head) and self.engine.slot.resident
        cache, history, start, stops = None, None, 0, ()
        pc = self.engine.prefix_cache
        if pc is not None:
            if chunk != pc.chunk:  # SIGHUP changed it: exact snapshots are per chunk size
                self.prefix_use.open_prefix_cache(chunk)
                pc = self.engine.prefix_cache
            # Inexact snapshots (engine/caches/prefix_cache.py) only for requests that accept
            # near-tie flips, unless the operator allows them for all.
            allow_inexact = self.cfg.prefix_cache.inexact_reuse or job.mode == "fast"
            job.looked_at = pc.generation
            if relook:
                snap, start = pc.relookup(job.prompt, want_head, allow_inexact, held=job.cached_tokens)
                if snap is None:
                    return False
            else:
                snap, start = pc.lookup(job.prompt, want_head, allow_inexact=allow_inexact)
            job.exact_chain = snap is None or snap.exact
            if snap is not None:
                cache, history = pc.restore(snap, job.prompt[start], self.engine.slot.head if want_head else None)
            # The prompt's exact end: exact where splits are, pending until the verdict is in.
            job.snapshot_at = pc.boundaries(len(job.prompt), start, job.segment_ends,
                                            fine=pc.splits_exact or pc.splits_pending or allow_inexact)
        elif relook:
            return False
        # The pacer may cut this prompt's chunks anywhere where that leaves a cold run's state
        # (off-grid splits bit-identical here), and a fast request's anyway (its snapshots
        # then count as inexact: prefill_phase._after_piece).
        job.prefill_splits_exact = pc is not None and pc.splits_exact
        job.prefill_may_cut = job.prefill_splits_exact or job.mode == "fast"
        if pc is not None and job.prefill_may_cut:
            stops = job.snapshot_at  # a chunk may end anywhere: end one at each snapshot point
        if history is None and want_head:
            from ..engine.caches.head_history import HeadHistory

            history = HeadHistory(self.engine.slot.head)  # primed during prefill, in case it speculates
        job.cached_tokens = start
        job.prefill = ChunkedPrefill(self.engine.lm, job.prompt, chunk, cache if cache is not None else self.engine.lm.make_cache(),
                                     history, start=start, stops=stops)
        return True

    def refresh_prefill(self, job: Job) -> bool:
        """A prompt admitted beside others that share its prefix (a council's system prompt)
        looked the prefix cache up before any of them had prefilled it, and waits while the
        first one does (prompts keep the chunks first-come). Before its own first chunk, look
        again: where the prefix is cached now, it starts from there instead of prefilling it
        once more. True when the job now starts from a longer prefix."""
        pc = self.engine.prefix_cache
        pre = job.prefill
        if pc is None or pre is None or pre.pos != pre.start or job.looked_at == pc.generation:
            return False
        before = job.cached_tokens
        if not self._open_prefill(job, relook=True):
            return False
        log.info("prefix_cache.relooked", request_id=job.request_id, seat=job.seat, cached_tokens=job.cached_tokens,
                 was=before, prompt_tokens=len(job.prompt))
        return True

    def begin_decode(self, job: Job) -> None:
        """The prefill is done: give the job its decode path, continuing from the prefilled
        cache: speculation when it runs alone, a row in the continuous batch when others
        run too (speculating there where the batch does, engine/decoders/batch_spec.py), else its
        own serial generator."""
        from ..engine.decoders.serial import serial_decode

        pre, job.prefill = job.prefill, None
        job.decode_cache = pre.cache  # the decoder advances it in place: the continuation
        if job.prefill_head and not self._exact_only_serially(job):
            # Served serially for want of the verify verdict, which came during its prefill
            # (a fresh start's first council turn): it decodes as the exact request it asked
            # to be, batched and speculating, from the head history its prefill primed.
            job.mode, job.prefill_head = "exact", False
        last = [pre.last_token]
        sampler, mode = job.sampler, job.mode
        # The head history its prefill primed, where that head is still the resident one.
        primed = pre.history if pre.history is not None and pre.history.head is self.engine.slot.head else None
        # Interactive work is latency-bound: it decodes on its own (the scheduler's class
        # order gives it every forward first), speculating if it can, rather than sharing
        # each forward with background rows.
        latency_first = job.priority == "interactive"
        alone = len(self.scheduler.active) <= 1 or latency_first
        drafting = self._drafting_options()
        # Prompt lookup drafts at depth 0 too, and without a resident head (hybrid models).
        can_draft = self.engine.slot.resident and self.engine.slot.current_depth() > 0 or "lookup" in drafting
        speculate = mode != "off" and can_draft and alone
        if not speculate and self._batchable(job):
            if self.engine.batch_speculates:
                history = primed if mode != "off" else None  # a serial row drafts nothing
                self.engine.batch.add(job.key, sampler, last, cache=pre.cache, history=history, exact=job.exact,
                               depth=self._row_depth(job), lookup=self._row_lookup(job, drafting),
                               context=job.prompt[:-1])
                job.batched = True
                self._hand_solo_to_batch()
            else:
                self.engine.batch.add(job.key, sampler, last, cache=pre.cache, exact=job.exact)
                job.batched = True
                mode = "off"
            job.start(self.engine.batch.handle(job.key), CommittedText(self.engine.lm.tokenizer, job.prompt), mode)
            return
        if mode != "off" and (self.engine.slot.resident or "lookup" in drafting):
            from ..engine.decoders.speculative import speculative_decode

            spec = self.cfg.speculation
            history = job.decode_history = primed
            # The cache holds the prompt but its last token (prefilled in chunks, or restored
            # from the prefix cache); prompt lookup and the loop guard read the whole prompt.
            # Where the start-up probe proved verify bit-identical to serial steps, the
            # near-tie guard cannot change a token: exact mode runs without it (its serial
            # re-decisions would cost a step each and protect nothing).
            job.handoff = False  # set to move this solo decode into the batch (_hand_solo_to_batch)
            gen = speculative_decode(self.engine.lm, self.engine.slot.head, last, sampler, depth=self._request_depth(job),
                                     exact=mode == "exact",
                                     guard_margin=None if self.engine.verify_exact else spec.guard_margin,
                                     rollback=spec.rollback, cache=pre.cache, history=history,
                                     context=job.prompt,
                                     pipeline=self._build_ahead(), handoff=lambda: job.handoff, **drafting)
            job.solo_spec = True
        else:
            mode = "off"
            # Before the verify verdict an exact greedy request decodes serially but keeps the
            # head's history (as its prefill did, prefill_head): its continuation then serves
            # the seat's next turn, which speculates once the verdict is in. Without it that
            # turn resumed at the prompt's snapshot and prefilled the whole reply again.
            history = job.decode_history = primed if job.prefill_head else None
            gen = serial_decode(self.engine.lm, last, sampler, cache=pre.cache, history=history)
        if self.cfg.debug_fail_after_tokens is not None:  # fault injection, off by default
            gen = _fail_after(gen, self.cfg.debug_fail_after_tokens)
        job.start(gen, CommittedText(self.engine.lm.tokenizer, job.prompt), mode)

    def _batchable(self, job: Job) -> bool:
        """Whether the job may decode as a row of the continuous batch."""
        return (job.priority != "interactive" and self.engine.batch is not None and self.cfg.debug_fail_after_tokens is None
                and self.engine.batch.admits(job.sampler, job.exact))

    def _row_depth(self, job: Job):
        """A batched row's own depth ceiling (the batch's depth is ``HeadSlot.depth_for``)."""
        if job.mode == "off":
            return lambda: 0
        request_depth = self._request_depth(job)
        return None if request_depth == self.engine.slot.current_depth else request_depth

    def _row_lookup(self, job: Job, drafting: dict) -> LookupConfig | None:
        """A batched row's prompt-lookup blocks (engine/decoders/batch_spec.py): where its
        mode speculates and the options have lookup, its blocks capped so that a verify of
        every row stays within the forward the invariant kernels and probes cover."""
        cfg, setting = drafting.get("lookup"), self.cfg.speculation.batch_lookup
        if job.mode == "off" or cfg is None or not resolve_batch_lookup(None if setting == "auto" else setting):
            return None
        return LookupConfig(cfg.min_ngram, cfg.max_ngram, min(cfg.max_draft, MAX_VERIFY_POSITIONS - 1), cfg.max_skip)

    @staticmethod
    def _so_far(job: Job) -> list[int]:
        """The tokens before a rejoining row's primary (its last committed token)."""
        return (list(job.prompt) + list(job.token_ids))[:-1]

    def _rejoin_batch(self, job: Job, state: tuple) -> None:
        """A parked batch row comes back with the state ``extract`` gave it."""
        if self.engine.batch_speculates:
            cache, primary, history = state
            self.engine.batch.add(job.key, job.sampler, [primary], cache=cache, history=history, exact=job.exact,
                           depth=self._row_depth(job), lookup=self._row_lookup(job, self._drafting_options()),
                           context=self._so_far(job))
        else:
            cache, next_token = state
            self.engine.batch.add(job.key, job.sampler, cache=cache, next_token=next_token, exact=job.exact)

    def _hand_solo_to_batch(self) -> None:
        """Others now decode in the speculating batch: move each running solo speculative
        decode that may batch into it at its cycle boundary (its generator hands back its
        cache, primary token and head history), so they all share one verify per cycle."""
        for job in list(self.scheduler.active):
            if not job.solo_spec or job.batched or job.generator is None:
                continue
            if not self._batchable(job) or len(self.engine.batch) >= self.engine.batch.max_rows:
                continue
            job.handoff = True
            try:
                step = next(job.generator)
            except StopIteration as done:
                job.solo_spec = False
                cache, primary, history = done.value
                self.engine.batch.add(job.key, job.sampler, [primary], cache=cache, history=history, exact=job.exact,
                               depth=self._row_depth(job), lookup=self._row_lookup(job, self._drafting_options()),
                               context=self._so_far(job))
                job.batched = True
                job.generator = self.engine.batch.handle(job.key)
                log.info("batch.joined", request_id=job.request_id, seat=job.seat, rows=len(self.engine.batch),
                         completion_tokens=len(job.token_ids))
                continue
            except Exception as exc:
                self._failed(job, exc)
                continue
            job.handoff = False  # a cycle built ahead was running: it stays solo this time
            self._deliver(job, step)

    def _request_depth(self, job: Job):
        """The depth a request drafts at: the governor's, capped by the best depth `councild
        tune` measured at the request's sampling settings (when it measured them)."""
        from .profile import best_depth, sampling_entry

        p = job.msg
        entry = sampling_entry(self.engine.tuned_profile, p.temperature, p.top_p, p.top_k)
        if entry is None:
            job.depth_ceiling = None
            return self.engine.slot.current_depth
        ceiling = job.depth_ceiling = best_depth(entry)
        return lambda: min(self.engine.slot.current_depth(), ceiling)

    def _drafting_options(self) -> dict:
        """speculative_decode's prompt-lookup, per-request-depth and loop-guard options."""
        from ..engine.decoders.lookup import DraftStopConfig, LookupConfig
        from ..engine.model.model import HYBRID_MTP_TYPES

        spec = self.cfg.speculation
        out: dict = {}
        if spec.prompt_lookup and self.engine.lm.model_type in HYBRID_MTP_TYPES:  # rollback needs the hybrid cache
            out["lookup"] = LookupConfig(max_draft=spec.lookup_max_draft)
        # An operator's pinned depth is drafted in full; under the governor it is a ceiling.
        pinned = self.depth_pinned()
        if spec.draft_stop_threshold > 0 and not pinned:
            out["draft_stop"] = DraftStopConfig(threshold=spec.draft_stop_threshold)
        if spec.loop_guard:  # speculative_decode arms it for sampled requests only
            from ..engine.decoders.loop_guard import LoopGuardConfig

            out["loop_guard"] = LoopGuardConfig()
        return out
