"""The prefix cache as the engine thread uses it: opening it, and keeping a finished turn.

``open_prefix_cache`` makes the cache for the prefill chunk in force (at start, and again
when SIGHUP changes the chunk): whether off-grid chunk splits are exact on this backend, and
the disk tier under this model's and settings' key. ``keep_continuation`` stores a finished
request's prompt and output for the seat's next turn. Lookups and chunk snapshots happen as
a request starts and prefills (decode_paths.py, worker.py).

``PrefixCacheUse`` is a part of ``EngineWorker`` (worker.py), handed the configuration, the
loaded engine (whose ``prefix_cache`` it opens and reopens) and the group.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

from protocol import messages as m

from ..logs import get_logger
from ..request_text.requests import Job

if TYPE_CHECKING:
    from .loaded_engine import LoadedEngine

log = get_logger("councild.engine")


class PrefixCacheUse:
    """Opening the prefix cache and keeping continuations."""

    def __init__(self, cfg, engine: LoadedEngine, group):
        self.cfg = cfg
        self.engine = engine
        self.group = group

    def splits_verdict(self, chunk: int) -> tuple[bool, str]:
        """Whether resuming a prefill off the chunk grid is exact here (probed, or read from
        an earlier start's verdict for this chunk, probe_verdicts.py), and "probed" or
        "cached". Not probed in a tensor-parallel group: this runs before the ranks' hello
        compares their settings, and a rank with another chunk would issue other forwards
        (other collectives); off-grid snapshots then count as inexact, the safe answer."""
        from ..engine.caches.prefix_cache import splits_agree

        if self.group is not None:
            return False, "skipped"
        return self.engine.verdicts.get("splits", str(chunk), lambda: splits_agree(self.engine.lm, chunk))

    def open_prefix_cache(self, chunk: int, splits_pending: bool = False) -> None:
        """The prefix cache for this prefill chunk: whether off-grid splits are exact on this
        backend (``splits_verdict``), and its disk tier under this model's and settings' key.
        ``splits_pending``: not asked yet (a start that serves first, warming.py): snapshots
        count as exact on the chunk grid only until ``set_splits`` has the verdict, and those
        that would be exact off it wait for it (prefix_cache.py, "Until the verdict")."""
        from ..engine.caches import prefix_disk
        from ..engine.caches.prefix_cache import PrefixCache
        from ..paths import cache_dir

        pc_cfg = self.cfg.prefix_cache
        t0 = time.perf_counter()
        probed, verdict = (False, "pending") if splits_pending else self.splits_verdict(chunk)
        exact = probed and not self.cfg.debug_inexact_splits
        probe_ms = round((time.perf_counter() - t0) * 1000, 1)
        disk = None
        # Not in a tensor-parallel group: every rank must take the same hits, and a disk
        # (a write still queued on one rank, a file torn on another) cannot promise that.
        if pc_cfg.disk and self.group is None:
            try:
                root = Path(pc_cfg.disk_dir) if pc_cfg.disk_dir else cache_dir() / "prefix"
                fingerprint = prefix_disk.model_fingerprint(self.engine.lm.path, prefix_disk.numerics_key(self.engine.lm, chunk))
                disk = prefix_disk.DiskTier(root, fingerprint, pc_cfg.disk_max_bytes, log,
                                            ttl_s=pc_cfg.disk_ttl_s or None, min_free_bytes=pc_cfg.disk_min_free_bytes)
            except OSError as exc:  # an unusable folder: RAM only, never a failed start
                log.warning("prefix_cache.disk_unusable", path=str(pc_cfg.disk_dir), error=repr(exc))
        old = self.engine.prefix_cache
        if old is not None and old.disk is not None:
            old.disk.close()
        self.engine.prefix_cache = PrefixCache(pc_cfg.max_bytes, chunk, make_cache=self.engine.lm.make_cache, disk=disk,
                                        splits_exact=exact, splits_pending=splits_pending)
        if self.engine.governance is not None:
            self.engine.governance.prefix_cache = self.engine.prefix_cache
        if not splits_pending:
            self._log_ready(probed, verdict, probe_ms)

    def set_splits(self, chunk: int, probed: bool, verdict: str, probe_ms: float) -> bool:
        """The splits verdict arrived (warming.py): off-grid snapshots count as exact from
        now on where it says so, those taken while it was pending included. False when the
        cache was reopened for another chunk since (SIGHUP: that one asked for its own verdict)."""
        pc = self.engine.prefix_cache
        if pc is None or pc.chunk != chunk:
            return False
        pending = sum(s.pending for s in pc.entries.values())
        promoted = pc.settle(probed and not self.cfg.debug_inexact_splits)
        self._log_ready(probed, verdict, probe_ms, pending=pending, promoted=promoted)
        return True

    def _log_ready(self, probed: bool, verdict: str, probe_ms: float, pending: int = 0, promoted: int = 0) -> None:
        """``pending``: snapshots taken while the verdict was pending, ``promoted`` of them
        made exact by it."""
        pc = self.engine.prefix_cache
        disk = pc.disk
        log.info("prefix_cache.ready", chunk=pc.chunk, splits_exact=pc.splits_exact, splits_bit_identical=probed,
                 pending_snapshots=pending, promoted=promoted,
                 forced_inexact=self.cfg.debug_inexact_splits, exact_reuse=pc.exact_reuse,
                 inexact_reuse=self.cfg.prefix_cache.inexact_reuse,
                 verdict=verdict, probe_ms=probe_ms, disk=None if disk is None else str(disk.dir),
                 disk_files=None if disk is None else len(disk.index))

    def _decode_keeps_cold_state(self, job: Job) -> bool:
        """Whether the state this job's decode left is the one a cold prefill of the same
        tokens leaves (given splits are exact): serial steps do; a verify does where it
        reproduces serial steps bit for bit (the exactness probe); a batch row does where the
        batch's forward equals one-row steps for every row (its probe, and no guard)."""
        if job.batched:
            return bool(self.engine.batch is not None and getattr(self.engine.batch, "exact_ok", False) and self.engine.verify_exact)
        return job.mode == "off" or self.engine.verify_exact

    def keep_continuation(self, job: Job) -> None:
        """Store a finished request's state (its prompt and what it generated) for the
        seat's next turn, where a hit on it may be used (engine/caches/prefix_cache.py)."""
        pc = self.engine.prefix_cache
        if pc is None:
            return
        session = None if job.msg.session is m.UNSET else job.msg.session
        if session == "drop":
            n, freed = pc.forget_seat(job.seat)
            log.info("prefix_cache.session_dropped", request_id=job.request_id, seat=job.seat, snapshots=n,
                     freed_bytes=freed)
            return
        # Kept when a later request may use it (it is inexact unless splits are exact here, or
        # pending until the verdict says whether they are), or when the client asked.
        if not (session == "keep" or pc.splits_exact or pc.splits_pending or self.cfg.prefix_cache.inexact_reuse) \
                or not job.decoded:
            return
        try:
            cache, history = job.decode_cache, job.decode_history
            if job.batched:
                if self.engine.batch is None or job.key not in self.engine.batch:
                    return
                # BatchDecoder gives (cache, next token), the speculating batch (cache,
                # primary, head history): either cache holds a prefix of what was decoded.
                state = self.engine.batch.extract(job.key)
                cache, history = state[0], (state[2] if len(state) == 3 else None)
            if cache is None:
                return
            snap = pc.store_final(job.prompt + job.decoded, cache, history, seat=job.seat,
                                  exact=job.exact_chain and self._decode_keeps_cold_state(job))
            if snap is not None:
                log.info("prefix_cache.continuation", request_id=job.request_id, seat=job.seat,
                         tokens=len(snap.tokens), head=snap.head is not None, exact=snap.exact, bytes=snap.nbytes)
        except Exception as exc:  # noqa: BLE001 - a lost snapshot is a later miss, never a failed request
            log.warning("prefix_cache.continuation_failed", request_id=job.request_id, error=repr(exc))
