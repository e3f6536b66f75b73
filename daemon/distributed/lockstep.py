"""The engine worker on each rank of a group: rank 0 leads, the others follow.

Both run EngineWorker's own step loop (daemon/engine_thread/worker.py); they differ only where the loop
reads something that is not deterministic (see the package docstring): the commands it
drains, the clock, and the governor's settings. ``LeaderWorker._drain_commands`` drains
the queue as the single-process worker does, applies the commands, and sends them with the
clock and the settings as one Tick; ``FollowerWorker._drain_commands`` receives the Tick and
applies the same. Everything after the drain is the single-process code.
"""

from __future__ import annotations

import hashlib
import json
import queue
import secrets
import time
import traceback
import zlib

import msgspec

from protocol import encode
from protocol.codec import decode_client

from ..engine_thread.commands import CancelAll, CancelJob, ReloadGovernor, ReloadScheduler, Stop, Submit
from ..config import SchedulerConfig
from ..engine_thread.decode_paths import InjectedFault
from ..exits import EXIT_CONFIG, EXIT_SOFTWARE
from ..logs import get_logger
from ..request_text.requests import Job
from ..engine_thread.worker import EngineWorker
from .channel import (CancelAllWire, CancelWire, Hello, JobWire, LockstepChannel, Report, SchedulerWire, Settings,
                      StopWire, Tick)
from .group import PeerMemoryProbe, RankProbe, backend_name, describe
from .watchdog import GroupWatchdog, leave_group

log = get_logger("councild.group")

# Words in the error a collective raises when a peer's link broke (ring, JACCL, NCCL, MPI).
_LINK_WORDS = ("peer", "connection", "socket", "[ring]", "[jaccl]", "nccl", "mpi")


def _fault(rank: int, exc: BaseException, **fields) -> None:
    """Any exception in engine work ends the group: a rank that skipped (or half ran) a
    forward can never line up with the others again."""
    text = str(exc).lower()
    fields.update(rank=rank, exit_code=EXIT_SOFTWARE, error=repr(exc), traceback=traceback.format_exc())
    if any(w in text for w in _LINK_WORDS):
        log.error("group.peer_lost", reason="a collective with the group failed: a rank died or its link broke",
                  **fields)
    else:
        log.error("group.engine_fault", **fields)
    leave_group()


def fingerprint(cfg, lm) -> str:
    """What every rank's step loop must agree on to stay in lockstep: the settings the
    engine reads (scheduling, speculation, prefix cache, decode path, fault injection) and
    the model (its config and each weight's name, shape and dtype, as this rank holds it;
    the split makes the shards' shapes equal). Settings only rank 0 reads (the socket, the
    governor, logs) may differ: a rank reads its own [governor] table for its memory probes."""
    from mlx.utils import tree_flatten

    engine = {k: msgspec.to_builtins(getattr(cfg, k)) for k in
              ("scheduler", "speculation", "prefix_cache", "compile_decode", "debug_fail_after_tokens",
               "debug_inexact_verify")}
    weights = [(k, list(v.shape), str(v.dtype)) for k, v in tree_flatten(lm.model.parameters())]
    blob = json.dumps({"engine": engine, "model": lm.config, "weights": weights}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _mismatch(rank: int, mine: str, theirs: str, peer: int) -> None:
    log.error("group.config_mismatch", rank=rank, peer=peer, fingerprint=mine, peer_fingerprint=theirs,
              exit_code=EXIT_CONFIG,
              reason="the ranks' engine settings ([scheduler], [speculation], [prefix_cache], compile_decode) "
                     "or models differ; every rank must serve the same model with the same settings")
    leave_group(EXIT_CONFIG)


class _GroupMember:
    """What leader and followers share: the channel, the watchdog, the tick's clock."""

    def _join(self, group, rank: int) -> None:
        d = self.cfg.distributed
        self.group = group
        self.rank = rank
        self.size = group.size()
        self._tick_now = time.monotonic()
        self.scheduler.clock = self._now
        self.watchdog = GroupWatchdog(rank, self.size, d.peer_timeout_s, d.startup_timeout_s)
        self.channel = LockstepChannel(group, on_exchange=self.watchdog.beat)
        self.rank_probe = RankProbe(rank, self.cfg.governor)
        self.digest = 0

    def _report(self) -> Report:
        return msgspec.structs.replace(self.rank_probe.report(), digest=self.digest)

    def _deliver(self, job: Job, step) -> None:
        self.digest = zlib.crc32(b"".join(int(t).to_bytes(4, "little") for t in step.tokens), self.digest)
        super()._deliver(job, step)

    def _prefill_piece(self, decoding: bool) -> int | None:
        """Whole chunks: the pacer's piece comes from this rank's clock, and every rank must
        run the same forwards (a group does not pace its prefill; OPERATIONS.md)."""
        return None

    def _now(self) -> float:
        return self._tick_now

    def _exchange(self, call):
        try:
            return call()
        except Exception as exc:
            _fault(self.rank, exc, exchanges=self.channel.exchanges)

    def _failed(self, job: Job, exc: BaseException) -> None:
        if isinstance(exc, InjectedFault):  # the same fault on every rank, at the same token
            return super()._failed(job, exc)
        _fault(self.rank, exc, request_id=job.request_id, seat=job.seat)


# ---------------------------------------------------------------------- rank 0
def _job_wire(job: Job) -> JobWire:
    return JobWire(msg=encode(job.msg), identity=job.identity, seat=job.seat, priority=job.priority,
                   weight=job.weight, deadline=job.deadline, received_at=job.received_at,
                   enqueued_at=job.enqueued_at, prompt=list(job.prompt), segment_ends=list(job.segment_ends))


class LeaderWorker(_GroupMember, EngineWorker):
    def __init__(self, cfg, ctx, model_path, hooks=None, *, group):
        super().__init__(cfg, ctx, model_path, hooks=hooks)
        self._join(group, 0)
        self.backend = backend_name(group, cfg.distributed.backend)
        self.reports: dict[int, tuple[float, Report]] = {}
        self.watchdog.start()

    def run(self) -> None:
        try:
            super().run()
        finally:
            self.watchdog.stop()

    def _load(self) -> None:
        super()._load()
        self._attach_peer_probes()
        hello = Hello(verify_exact=self.engine.verify_exact,
                      batch_exact=self.engine.batch.exact_ok if self.engine.batch is not None else None,
                      compiled=self.engine.lm.compiled_decode is not None, tuned_profile=self.engine.tuned_profile,
                      warmup=self.startup.warmup_mode(),
                      compiled_batch=self.engine.lm.compiled_decode is not None and self.engine.lm.compiled_decode.batched)
        mine = fingerprint(self.cfg, self.engine.lm)
        hello.fingerprint = mine
        reports = self._exchange(lambda: self.channel.send(hello))
        for r in reports:
            if r.fingerprint != mine:
                _mismatch(0, mine, r.fingerprint, r.rank)
        self._collect(reports)
        self.startup.warm_up(hello.warmup)  # after the hello: every rank runs the same warm-up forwards
        self.watchdog.started()
        log.info("group.ready", rank=0, size=self.size, backend=self.backend,
                 ranks=[{"rank": k, "host": r.host, "pid": r.pid} for k, (_, r) in sorted(self.reports.items())])

    def _attach_peer_probes(self) -> None:
        """The governor reads every other rank's memory too, and so acts on the worst."""
        if self.engine.governance is not None:
            self.engine.governance.gov.memory_probes += [PeerMemoryProbe(r, self.reports) for r in range(1, self.size)]

    def _collect(self, reports: list[Report], digest: int | None = None) -> None:
        """Keep each rank's report; ``digest``: this rank's token digest when the tick
        was sent, which every other rank's report (from the same point of the loop) must equal."""
        now = time.monotonic()
        for r in reports:
            self.reports[r.rank] = (now, r)
            if digest is not None and r.digest != digest:
                log.error("group.diverged", rank=0, exit_code=EXIT_SOFTWARE, peer=r.rank, peer_host=r.host,
                          digest=digest, peer_digest=r.digest,
                          reason="another rank committed different tokens (its numerics or inputs differ); "
                                 "the group cannot serve consistent output")
                leave_group()

    def _settings(self) -> Settings:
        pc = self.engine.prefix_cache
        return Settings(depth=self.engine.slot.depth, head=self.engine.slot.resident, pinned=self.depth_pinned(),
                        prompt_cache_limit=pc.limit if pc is not None else None)

    def _wire(self, cmd):
        if isinstance(cmd, Submit):
            job = cmd.job
            if job.rejection is not None or job.msg.count_only:  # answered here; never reaches the engine
                return None
            if job.msg.seed is None:  # every rank must draw the same samples
                job.msg = msgspec.structs.replace(job.msg, seed=secrets.randbits(63))
            return _job_wire(job)
        if isinstance(cmd, CancelJob):
            return CancelWire(seat=cmd.key[0], request_id=cmd.key[1], reason=cmd.reason)
        if isinstance(cmd, CancelAll):
            return CancelAllWire(code=cmd.code, message=cmd.message)
        if isinstance(cmd, ReloadScheduler):
            return SchedulerWire(cfg=msgspec.to_builtins(cmd.cfg))
        if isinstance(cmd, Stop):
            return StopWire()
        return None  # governor commands: their effect travels in the settings

    def _apply_command(self, cmd) -> bool:
        go = super()._apply_command(cmd)
        if isinstance(cmd, ReloadGovernor):  # reconfigure rebuilt the probe list
            self._attach_peer_probes()
        return go

    def _drain_commands(self, block: bool) -> bool:
        timeout = 0.1 if block else 0.0
        cmds = []
        while True:
            try:
                cmds.append(self._ready.get(timeout=timeout) if timeout else self._ready.get_nowait())
            except queue.Empty:
                break
            timeout = 0.0
        self._tick_now = time.monotonic()
        go, shipped = True, []
        for cmd in cmds:
            wire = self._wire(cmd)
            if wire is not None:
                shipped.append(wire)
            if not self._apply_command(cmd):
                go = False
                break
        tick = Tick(now=self._tick_now, commands=shipped, settings=self._settings())
        digest = self.digest  # no token is committed during a drain
        self._collect(self._exchange(lambda: self.channel.send(tick)), digest)
        return go

    def _publish(self) -> None:
        published = self.status.published_at
        super()._publish()
        if self.status.published_at == published:
            return
        mine = self.rank_probe.report()
        ranks = [describe(mine)] + [describe(r) for _, (_, r) in sorted(self.reports.items())]
        with self.status.snapshot_lock:
            self.status.snapshot.group = {"size": self.size, "backend": self.backend, "ranks": ranks,
                                   "exchanges": self.channel.exchanges, "overflow_exchanges": self.channel.overflows,
                                   "peer_timeout_s": self.cfg.distributed.peer_timeout_s}


# ---------------------------------------------------------------------- ranks 1..n-1
class FollowerWorker(_GroupMember, EngineWorker):
    """Runs on the main thread of a rank > 0 (``serve``): no socket, no intake, no governor."""

    def __init__(self, cfg, model_path, *, group):
        cfg = msgspec.structs.replace(cfg, governor_enabled=False)
        super().__init__(cfg, None, model_path, hooks=None)
        self._join(group, group.rank())
        self._pinned = False

    def serve(self) -> int:
        self.watchdog.start()
        self._load()  # a refusal (ShardingRefused) or failure propagates to the caller
        mine = fingerprint(self.cfg, self.engine.lm)
        report = msgspec.structs.replace(self._report(), fingerprint=mine)
        hello = self._exchange(lambda: self.channel.receive_hello(report))
        if hello.fingerprint != mine:
            _mismatch(self.rank, mine, hello.fingerprint, 0)
        self.engine.verify_exact = hello.verify_exact
        if self.engine.batch is not None and hello.batch_exact is not None:
            self.engine.batch.exact_ok = hello.batch_exact
        if not hello.compiled:
            self.engine.lm.compiled_decode = None
        elif not hello.compiled_batch and self.engine.lm.compiled_decode is not None:
            self.engine.lm.compiled_decode.batched = False
            self.engine.lm.compiled_decode.batch_reason = "rank 0's batch self-check refused it"
        self.engine.tuned_profile = hello.tuned_profile
        self.startup.warm_up(hello.warmup)  # rank 0's mode, as rank 0 does, after the hello
        self.watchdog.started()
        log.info("group.following", rank=self.rank, size=self.size, verify_exact=self.engine.verify_exact)
        self._loop()
        self.watchdog.stop()
        log.info("group.stopped", rank=self.rank, exchanges=self.channel.exchanges, reason="rank 0 stopped")
        return 0

    def depth_pinned(self) -> bool:
        return self._pinned

    def _send(self, *args, **kwargs) -> None:  # rank 0 answers the clients
        pass

    def _publish(self) -> None:
        pass

    def _drain_commands(self, block: bool) -> bool:
        tick = self._exchange(lambda: self.channel.receive_tick(self._report()))
        self._tick_now = tick.now
        for wire in tick.commands:
            if not self._apply_command(self._command(wire)):
                return False
        self._apply_settings(tick.settings)
        return True

    def _command(self, w):
        if isinstance(w, JobWire):
            job = Job(msg=decode_client(w.msg, max_bytes=1 << 30), identity=w.identity, seat=w.seat,
                      priority=w.priority, weight=w.weight, deadline=w.deadline, received_at=w.received_at)
            job.enqueued_at = w.enqueued_at
            job.prompt = list(w.prompt)
            job.segment_ends = list(w.segment_ends)
            return Submit(job)
        if isinstance(w, CancelWire):
            return CancelJob((w.seat, w.request_id), w.reason)
        if isinstance(w, CancelAllWire):
            return CancelAll(w.code, w.message)
        if isinstance(w, SchedulerWire):
            return ReloadScheduler(msgspec.convert(w.cfg, SchedulerConfig))
        return Stop()

    def _apply_settings(self, s: Settings) -> None:
        self.engine.slot.depth = s.depth
        self._pinned = s.pinned
        if s.head and not self.engine.slot.resident:
            self._follow_head_load()
        elif not s.head and self.engine.slot.resident:
            nbytes, freed = self.engine.slot.evict()
            log.info("head.evicted", rank=self.rank, bytes=nbytes, freed_bytes=freed, reason="rank 0 evicted it")
        pc = self.engine.prefix_cache
        if pc is not None and pc.limit != s.prompt_cache_limit:
            pc.set_limit(s.prompt_cache_limit)

    def _follow_head_load(self) -> None:
        from ..engine.model.mtp_head import load_mtp_head

        t0 = time.perf_counter()
        try:
            head = load_mtp_head(self.engine.lm)
        except Exception as exc:
            _fault(self.rank, exc, during="head load")
        self.engine.slot.install(head)
        log.info("head.loaded", rank=self.rank, bytes=head.nbytes, ms=round((time.perf_counter() - t0) * 1000, 1),
                 reason="rank 0 loaded it")
