"""The engine step's prefill phase: which prompts' pieces run after the decode phase, and how.

After the decode phase (worker._step) this part:
1. looks the prefix cache up again for prompts that have not forwarded a token yet and may
   now start from a snapshot another prompt took since (decode_paths.refresh_prefill);
2. asks the worker for the pacer's piece that keeps the decoding streams' gap within the
   bound (prefill_pacer.py; None: whole chunks) where the first prompt is longer than a
   chunk (a short one runs whole), and the scheduler for the plan (whose chunks go);
3. runs the plan: the first prompt's piece together with the other prompts whose remainder
   fits one chunk (prefix-cache hits' tails, short prompts) in one forward where that is
   allowed (engine/prefill/batched_prefill.py), else each chunk alone;
4. after each piece: a prefix-cache snapshot where the prompt reached one of its snapshot
   points, the decode path once the prompt is done, the seat charged one cycle.

``DecodePaths`` (decode_paths.py) decided at each prompt's start whether its chunks may be cut
(``prefill_may_cut``: off-grid splits bit-identical here, or a fast request).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from ..engine.kernels import chunked_prefill
from ..engine.prefill.batched_prefill import may_prefill_together, prefill_together
from ..engine.prefill.mixed_forward import Ride
from ..request_text.requests import Job

if TYPE_CHECKING:
    from .decode_paths import DecodePaths
    from .loaded_engine import LoadedEngine
    from .scheduler import Scheduler


def _short(job: Job) -> bool:
    """A prompt that had at most one chunk to prefill when it began (a turn's new message
    after a prefix-cache hit, a short prompt). The pacer leaves these whole: a turn's first
    token is what an agent waits for, and the others' stall is one chunk at most, once. A
    longer prompt is paced to its end (its last chunk too)."""
    pre = job.prefill
    return pre.total - pre.start <= pre.chunk


@dataclass
class Riding:
    """The first prompt's paced piece, offered to the decode phase's batched forward
    (``PrefillPhase.riding``): ``whole`` the piece it would run uncut, ``piece`` the pacer's
    allowance this iteration (asked once: the pacer counts its iterations); ``ride`` None
    where the piece cannot ride (the prefill phase then runs it with that allowance)."""
    job: Job
    whole: int
    n: int
    piece: int
    ride: Ride | None


def rows_for_piece(nexts: list[int], piece: int) -> int:
    """How many of a group's rows, from the first (the prefill order's), share a forward that
    may carry ``piece`` tokens in all, each row forwarding the same count (the shortest of
    their next pieces, ``nexts``, and ``piece`` // rows): the fewest rows that forward the most
    tokens. Splitting the piece evenly among every row (as before) made each row crawl
    where the rows' tails are longer than their share: an H100's council of 8 in fast mode
    prefilled ~300-token tails in 24-54 forwards each (bench/results/h100_2026-12-08); the
    rows then all finish at the last forward, where one after another the first finishes
    first and the last no later. Short tails still fill the piece together."""
    best, best_tokens, shortest = 1, 0, None
    for k, n in enumerate(nexts, start=1):
        shortest = n if shortest is None else min(shortest, n)
        tokens = k * min(shortest, piece // k)
        if tokens > best_tokens:
            best, best_tokens = k, tokens
    return best


class PrefillPhase:
    def __init__(self, engine: LoadedEngine, scheduler: Scheduler, paths: DecodePaths, jobs: dict, *,
                 failed: Callable, piece: Callable[[bool], int | None], count_prefilled: Callable[[int], None]):
        self.engine = engine
        self.scheduler = scheduler
        self.paths = paths
        self._count_prefilled = count_prefilled  # status's prompt-token counter
        self.jobs = jobs
        self._failed = failed
        self._piece = piece  # the worker's: a tensor-parallel rank never paces
        self.together_forwards = 0  # forwards that carried several prompts' pieces
        self.together_rows = 0  # the pieces those forwards carried
        self.mixed_forwards = 0  # decode forwards that carried a prompt's piece
        self.mixed_tokens = 0  # the prompt tokens they carried

    def run(self, spent: int, decoding: bool, riding: Riding | None = None) -> tuple[int, bool]:
        """This iteration's prefill phase after a decode phase that forwarded ``spent``
        tokens (``decoding``: some stream decoded; ``riding``: what ``riding`` offered it).
        Returns (tokens forwarded, whether a plan ran)."""
        if riding is not None and riding.ride is not None and riding.ride.hidden is not None:
            return self._absorb(riding), True
        if riding is None:
            self._refresh()
        order = self.scheduler.prefill_order()
        # A prompt of one chunk or less runs whole (its first token matters more); a longer
        # one gets the pacer's piece.
        if riding is not None:
            piece = riding.piece
        else:
            piece = self._piece(decoding) if order and not _short(order[0]) else None
        plan = self.scheduler.prefill_plan(spent, paced=piece is not None, order=order)
        if plan:
            group = self._together(plan[0][0], order)
            if len(group) > 1:
                return self.run_together(group, piece if piece is not None else self._budget_piece(decoding, spent)), True
        prefilled = 0
        for job, chunks in plan:
            for _ in range(chunks):
                if self.jobs.get(job.key) is not job or job.prefill is None:
                    break  # failed, or done: the plan counted its tokens as they were
                prefilled += self.run_piece(job, piece)
        return prefilled, bool(plan)

    def _refresh(self) -> None:
        for job in self.scheduler.active:  # before planning: a prompt that finds more now is shorter
            if job.prefill is not None:
                self.paths.refresh_prefill(job)

    # ------------------------------------------------------------------ riding a decode forward
    def riding(self, decoding: bool) -> Riding | None:
        """Before a batched decode phase: the first prompt's paced piece for its forward to
        carry (engine/prefill/mixed_forward.py), where mixed steps are on, a stream decodes, the pacer
        cuts this iteration's prefill to one piece, and exactness allows (the start-up probe
        found mixed forwards bit-identical, or neither the prompt nor any batched row is exact
        greedy); None: the prefill phase runs its own forwards."""
        verdict = self.engine.mixed_exact
        if verdict is None or not decoding:
            return None
        self._refresh()
        order = self.scheduler.prefill_order()
        if not order or _short(order[0]):
            return None
        job = order[0]
        if not verdict and (self._exact_greedy(job) or any(self._exact_greedy(j) for j in self.jobs.values() if j.batched)):
            return None
        if len(self._together(job, order)) > 1:
            return None  # other prompts' tails share its forward instead (run_together)
        piece = self._piece(decoding)
        if piece is None:
            return None
        pre = job.prefill
        whole = pre.next_piece()
        n = pre.next_piece(piece if job.prefill_may_cut else None)
        tokens = pre.piece_ids(n)[None]
        if self.engine.lm.chunked_prefill and chunked_prefill.applies(self.engine.lm, tokens, pre.cache):
            # Its own forward would run the chunked recurrence, which rounds differently.
            return Riding(job, whole, n, piece, None)
        pre.check_head()
        self.scheduler.prefill_plan(0, paced=True, order=order)  # its turn is taken (the plan's round robin)
        return Riding(job, whole, n, piece, Ride(tokens, pre.cache))

    @staticmethod
    def _exact_greedy(job: Job) -> bool:
        return job.exact and job.sampler is not None and job.sampler.greedy

    def _absorb(self, riding: Riding) -> int:
        """After a decode forward carried the piece: the prompt's bookkeeping, as after its own."""
        job = riding.job
        if self.jobs.get(job.key) is not job or job.prefill is None:
            return 0  # failed with the forward that carried it
        try:
            job.prefill.ridden(riding.ride.hidden, riding.n)
            self._after_piece(job, riding.n, riding.whole)
        except Exception as exc:
            self._failed(job, exc)
            return 0
        self.mixed_forwards += 1
        self.mixed_tokens += riding.n
        return riding.n

    # ------------------------------------------------------------------ one prompt
    def run_piece(self, job: Job, piece: int | None = None) -> int:
        """One chunk of a job's prefill, cut at ``piece`` tokens where the pacer asks and the
        job may be cut; returns the tokens forwarded."""
        try:
            limit = piece if job.prefill_may_cut else None
            whole = job.prefill.next_piece()
            n = job.prefill.step(limit)
            self._after_piece(job, n, whole)
        except Exception as exc:
            self._failed(job, exc)
            return 0
        return n

    # ------------------------------------------------------------------ prompts together
    def _together(self, lead: Job, order: list[Job]) -> list[Job]:
        """The plan's first prompt and the prompts that may share its forward: of its class
        (``order``, the prefill order's), remainder within one chunk, each allowed by the probe
        (``may_prefill_together``) and allowed to be cut (its piece may end where the
        shortest one's does), up to the batch height the probe covered."""
        verdict = self.engine.prefill_together_exact
        if verdict is None or lead.prefill is None or not self._joins(lead, verdict):
            return [lead]
        group = [lead]
        for job in order:
            if len(group) >= self.scheduler.max_active:
                break
            if job is lead or job.prefill is None or job.prefill_left > job.prefill.chunk:
                continue
            if self._joins(job, verdict):
                group.append(job)
        return group

    @staticmethod
    def _joins(job: Job, verdict: bool) -> bool:
        return job.prefill_may_cut and may_prefill_together(job.exact, job.sampler.greedy, verdict)

    def _budget_piece(self, decoding: bool, spent: int) -> int | None:
        """Unpaced (pacing off, or nobody decoding): while others decode, the rows' pieces
        together stay within what one iteration may spend (``step_token_budget`` less the
        decode phase's tokens, at least a chunk); with nobody decoding, each a whole piece."""
        if not decoding:
            return None
        cfg = self.scheduler.cfg
        return max(cfg.step_token_budget - spent, cfg.prefill_chunk)  # run_together splits it among the rows

    def run_together(self, group: list[Job], piece: int | None) -> int:
        """One forward carrying a piece of each prompt in ``group``; with ``piece`` (the
        pacer's, or the budget's) the pieces together stay within it, carried by as few of
        the group's first rows as carry the most of it (``rows_for_piece``). Returns the
        tokens forwarded. A failed forward fails every prompt in it."""
        limit = None
        try:
            wholes = [job.prefill.next_piece() for job in group]
            if piece is not None:
                rows = rows_for_piece(wholes, piece)
                group, wholes, limit = group[:rows], wholes[:rows], max(1, piece // rows)
            ns = prefill_together([job.prefill for job in group], limit)
        except Exception as exc:
            for job in group:
                self._failed(job, exc)
            return 0
        if len(group) > 1:  # one row left (rows_for_piece) is a lone prompt's piece
            self.together_forwards += 1
            self.together_rows += len(group)
        for job, n, whole in zip(group, ns, wholes):
            try:
                self._after_piece(job, n, whole)
            except Exception as exc:
                self._failed(job, exc)
        return sum(ns)

    # ------------------------------------------------------------------ after a piece
    def _after_piece(self, job: Job, n: int, whole: int) -> None:
        """A piece of ``n`` tokens of the job's prompt ran (``whole``: the piece it would have
        run uncut)."""
        job.prefill_forwards += n > 0
        if n < whole and not job.prefill_splits_exact:
            job.exact_chain = False  # cut off the grid where that changes the numbers (fast only)
        pc = self.engine.prefix_cache
        if job.prefill.pos in job.snapshot_at and pc is not None:
            pos = job.prefill.pos
            pc.store(job.prompt[:pos], job.prefill.cache, job.prefill.history,
                     exact=pc.is_exact(pos, job.exact_chain), seat=job.seat,
                     pending=pc.is_pending(pos, job.exact_chain))
        if job.prefill.done:
            self.paths.begin_decode(job)
        # One cycle, as a decode step is: the seat's solo decoders are picked by this share.
        self.scheduler.charge(job, 1)
        self._count_prefilled(n)

    def to_dict(self) -> dict:
        return {"enabled": self.engine.prefill_together_exact is not None,
                "exact_rows": bool(self.engine.prefill_together_exact), "forwards": self.together_forwards,
                "rows": self.together_rows}

    def mixed_dict(self) -> dict:
        return {"enabled": self.engine.mixed_exact is not None, "exact_rows": bool(self.engine.mixed_exact),
                "forwards": self.mixed_forwards, "tokens": self.mixed_tokens}
