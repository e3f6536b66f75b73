"""The MTP head's slot: which head is resident, the depth it drafts at, and the loading and
unloading of its weights.

The engine worker reads the slot at every cycle (a request's generator asks
``current_depth`` at each cycle start); governance, the governor's hands, changes it between
cycles. Both hold the slot and neither holds the other, so the governor's side cannot reach
into the scheduler, the jobs or the sockets, and the worker's decode code does not need to
know who decides depth or residency.

Everything here runs on the engine thread, except reading a head's weights from disk: that
runs on a loader thread so a reload never stalls decoding, and the finished head is swapped
in by ``finish_load`` at the next safe point.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx

from governor.heights import depth_at

from ..logs import get_logger

log = get_logger("councild.head")


@dataclass
class LoadOutcome:
    """What a finished background load brought: a head, or the error that stopped it."""

    head: Any | None
    error: BaseException | None
    ms: float


class HeadSlot:
    def __init__(self, lm, depth: int, on_change: Callable[[bool, int], None] | None = None):
        self.lm = lm
        self.head = None
        # The depth speculation drafts at while a head is resident (the governor's or the
        # config's); 0 turns speculation off without unloading anything.
        self.depth = depth
        # The governor's depth per bucket of batch heights 2, 3-4, 5-8, 9+ (governor/heights.py);
        # None where it has not chosen one (no measurement there yet): such a batch drafts at
        # the nearest chosen height's depth, or at ``depth`` while none is. Empty without a
        # governor.
        self.height_depths: tuple[int | None, ...] = ()
        # Whether the checkpoint has a head at all, and its size before it is resident: the
        # governor plans a load from these.
        self.available = False
        self.bytes_hint = 0
        self.error: str | None = None
        # Told (resident, bytes) at every install and drop, so status shows a change at once.
        self._on_change = on_change or (lambda resident, nbytes: None)
        self._loader: threading.Thread | None = None
        self._loaded = None
        self._load_error: BaseException | None = None
        self._load_started = 0.0

    # ------------------------------------------------------------------ reading
    @property
    def resident(self) -> bool:
        return self.head is not None

    @property
    def nbytes(self) -> int:
        """The resident head's bytes, else what a load would cost."""
        return self.head.nbytes if self.head is not None else self.bytes_hint

    def current_depth(self) -> int:
        """Read by speculative generators at the start of every cycle."""
        return self.depth if self.head is not None else 0

    def depth_for(self, batch_height: int) -> int:
        """The depth a batched cycle of ``batch_height`` rows drafts at: the governor's for
        that height (or the nearest height it measured), else ``current_depth()`` (no
        governor, no batch measured yet, or one row). 0 while no head is resident."""
        if self.head is None:
            return 0
        return depth_at(self.height_depths, self.depth, batch_height)

    @property
    def loading(self) -> bool:
        return self._loader is not None and self._loader.is_alive()

    # ------------------------------------------------------------------ start-up
    def load_at_startup(self, keep: bool) -> None:
        """Learn whether the checkpoint has a head and its size; with ``keep`` make it resident."""
        from ..engine.model.mtp_head import NoMTPHead, load_mtp_head

        before = mx.get_active_memory()
        t0 = time.perf_counter()
        try:
            head = load_mtp_head(self.lm)
        except NoMTPHead as exc:
            log.warning("head.absent", reason=str(exc), message="serving serially")
            self.error = str(exc)
            return
        self.available = True
        self.bytes_hint = head.nbytes
        if not keep:
            del head
            mx.clear_cache()
            return
        log.info("head.loaded", bytes=head.nbytes, active_memory_delta=mx.get_active_memory() - before,
                 ms=round((time.perf_counter() - t0) * 1000, 1), source=head.source, reason="start-up")
        self.install(head)

    # ------------------------------------------------------------------ changing
    def install(self, head) -> None:
        self.head = head
        self._on_change(True, head.nbytes)

    def evict(self) -> tuple[int, int] | None:
        """Unload the resident head: ``(bytes, freed_bytes)``, or None when none was resident.

        New requests decode serially at once. The weights are deleted in place: a request
        that is drafting holds a reference to the same head, sees it unloaded at its next
        cycle and carries on serially, so the memory comes back now rather than when the
        last such request ends."""
        head = self.head
        if head is None:
            return None
        # A decode step queued ahead (async eval) may still be allocating its outputs: let it
        # finish, or its buffers land between the two reads and hide part of what was freed.
        mx.synchronize()
        before = mx.get_active_memory()
        self.head = None
        self._on_change(False, 0)
        nbytes = head.nbytes
        head.unload()
        del head
        mx.clear_cache()
        return nbytes, before - mx.get_active_memory()

    def start_load(self) -> bool:
        """Start reading the head on a loader thread; False when one is resident or loading."""
        if self.head is not None or self.loading:
            return False
        self._load_started = time.perf_counter()
        lm = self.lm

        def load() -> None:
            from ..engine.model.mtp_head import load_mtp_head

            try:
                # Its own stream: reading and converting the weights does not queue behind
                # (or ahead of) the decode work on the engine thread's stream.
                with mx.stream(mx.new_stream(mx.default_device())):
                    head = load_mtp_head(lm)
                    mx.eval(head.parameters())
                self._loaded = head
            except BaseException as exc:  # reported by finish_load at the next safe point
                self._load_error = exc

        self._loader = threading.Thread(target=load, name="councild-head-loader", daemon=True)
        self._loader.start()
        return True

    def finish_load(self) -> LoadOutcome | None:
        """At a safe point: install a head the loader finished. None while nothing finished."""
        if self._loader is None or self._loader.is_alive():
            return None
        self._loader = None
        ms = round((time.perf_counter() - self._load_started) * 1000, 1)
        if self._load_error is not None:
            err, self._load_error = self._load_error, None
            return LoadOutcome(None, err, ms)
        head, self._loaded = self._loaded, None
        self.install(head)
        return LoadOutcome(head, None, ms)
