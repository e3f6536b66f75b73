"""Bringing the engine up: what must run before ready, and the parts that run after.

``EngineStartup.load`` does what ``EngineWorker.run`` needs before the daemon answers: load
the weights (reporting progress), set the prompt limit from the model's context, load the
MTP head, choose the kernels, run one eager step, open the prefix cache, build the
continuous batch and the governance, each faster path on its safe setting. The rest is a
list of parts (warming.py, ``_parts`` says their order): the compiled step's self-checks,
the exactness probes (verify, batch, chunk splits; verdicts cached across starts,
probe_verdicts.py), the warm-up (warmup.py) and the cost probes (prefill_together,
mixed_steps). The worker runs them between requests (``warm_in_background``, the default),
or ``load`` runs them before returning (a group; ``warm_in_background = false``). It returns a
``LoadedEngine``: the objects the engine thread's parts share.

A part of ``EngineWorker`` (worker.py) with its own state: what it is given in its
constructor, and the engine it builds.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from .loaded_engine import LoadedEngine
from ..engine.jit import backend_env
from ..engine.kernels import custom_kernel_cache
from ..engine.jit.prebuild import KernelPrebuild
from ..logs import get_logger
from ..paths import cache_dir

if TYPE_CHECKING:
    from .status_snapshot import EngineStatus

log = get_logger("councild.engine")
# The longest the first forward waits for the prebuild's workers (each compiles one module in
# 2.5-8 s on the H200); after it, this process compiles what is still missing itself.
PREBUILD_WAIT_S = 120.0


class EngineStartup:
    """The start-up steps: ``load`` builds the engine; ``warm_up`` and ``warmup_mode`` are
    also a group's (lockstep.py), which warms up after its ranks agree."""

    def __init__(self, cfg, model_path: str, group, status: EngineStatus, hooks: Any = None,
                 requests_holding_head: Callable[[], int] | None = None, prebuild: KernelPrebuild | None = None):
        self.cfg = cfg
        self.prebuild = prebuild  # the CUDA modules' workers (prebuild_start.py), or None
        self.model_path = model_path
        self.group = group
        self.status = status
        self.hooks = hooks
        self.requests_holding_head = requests_holding_head
        self.engine = LoadedEngine(max_prompt_tokens=cfg.max_prompt_tokens or 0)
        self.warming = None  # the parts still to run (warming.py), made by ``load``
        self.prefix_use = None
        self.compile_check = None
        self.compile_later = False

    def load(self) -> LoadedEngine:
        """What must run before ready: the weights, the head, the kernels, one eager step, and
        the objects requests use, each on its safe setting; then ``warming`` holds the parts
        that switch faster paths in (warming.py), run before returning where ``background``
        is False, else by the worker between requests."""
        from ..engine.model.loading import load_model
        from ..logs import route_library_logs
        from .prefix_cache_use import PrefixCacheUse
        from .probe_verdicts import CompiledStepCheck, verdicts_for

        route_library_logs()
        self._configure_backend()
        t0 = time.perf_counter()
        self.compile_check = CompiledStepCheck(self.group)
        # The compiled step's self-check waits for idle, unless the kernel choice must probe
        # before ready (its verdicts are keyed by the decode path the check decides).
        compile_now = self.cfg.compile_decode and (not self.background or self._kernels_probe())
        self.engine.lm = load_model(self.model_path, compile_decode=compile_now, progress=self._load_progress,
                                    group=self.group, compile_check=self.compile_check,
                                    fused_recurrence=None if self.cfg.gdn_kernel == "auto" else False,
                                    fold_conv=self.cfg.gdn_conv_fold == "auto",
                                    merge_linears=None if self.cfg.merge_linears == "auto" else False,
                                    before_forward=self._await_prebuild)
        lm = self.engine.lm
        self.compile_later = self.cfg.compile_decode and not compile_now and lm.supports_mtp
        if self.compile_later:
            lm.decode_path = "eager: the compiled step's self-check is pending"
        context = self._prompt_limit()
        log.info("model.loaded", path=str(lm.path), model_type=lm.model_type,
                 decode_path=lm.decode_path, compile_check=self.compile_check.verdict, recurrence=lm.recurrence,
                 linears=lm.linears,
                 batch_decode_path=lm.batch_decode_path, batch_compile_check=self.compile_check.batch_verdict,
                 seconds=round(time.perf_counter() - t0, 3),
                 context_tokens=context, max_prompt_tokens=self.engine.max_prompt_tokens,
                 custom_kernels=custom_kernel_cache.CACHE.summary())
        from .head_slot import HeadSlot

        self.engine.slot = HeadSlot(lm, self.cfg.speculation.depth, on_change=self.status.head_changed)
        if self.cfg.speculation.mode != "off" or self.cfg.speculation.load_head:
            self.engine.slot.load_at_startup(keep=self.cfg.speculation.load_head)
            if self.engine.slot.error is not None:
                with self.status.snapshot_lock:
                    self.status.snapshot.head_error = self.engine.slot.error
        self._first_step()
        self.engine.verdicts = verdicts_for(lm, self.group)
        self._choose_kernels()
        # The safe settings, until each part's verdict switches its path in (warming.py).
        # Without a head nothing speculates: the verify's verdict is not asked. With one, until
        # it is in (None), exact greedy requests decode serially whatever
        # exact_on_inexact_backend says: the guard bounds flips, only serial excludes them.
        self.engine.verify_exact = None if self.engine.slot.available else True
        if self.engine.slot.available:
            with self.status.snapshot_lock:
                self.status.snapshot.exact_decode = "serial"
        self.engine.batch = None
        self.engine.prefix_cache = None
        self.prefix_use = PrefixCacheUse(self.cfg, self.engine, self.group)
        if self.cfg.prefix_cache.enabled:
            self.prefix_use.open_prefix_cache(self.cfg.scheduler.prefill_chunk, splits_pending=True)
        self._build_batch()
        self.engine.prefill_together_exact = None
        self.engine.mixed_exact = None
        if self.cfg.governor_enabled:
            from ..engine.caches.cache_size import row_cache_bytes
            from .governance import Governance

            self.engine.row_cache_bytes = row_cache_bytes(self.engine.lm, self.engine.max_prompt_tokens)
            self.engine.governance = Governance(self.engine.slot, self.cfg.governor, lm.path, prefix_cache=self.engine.prefix_cache,
                                         holding_head=self.requests_holding_head, trace=self.cfg.governor_trace,
                                         learn=self.group is None)
            self.engine.tuned_profile = self.engine.governance.tuned_profile
        from .warming import Warming

        self.warming = Warming(self._parts(), self._publish_warming, forced_failures=self.cfg.debug_fail_warm)
        if not self.background:
            self.warming.run_all()
        return self.engine

    @property
    def background(self) -> bool:
        """Whether the parts run between requests (warming.py) or before ready."""
        return self.cfg.warm_in_background and self.group is None

    def _kernels_probe(self) -> bool:
        """Whether the kernel choice runs probes (kernel_choice.py): it stays before ready,
        since swapping kernels under requests in flight would change an exact request's
        numbers mid-stream and every cached prefix's."""
        from ..engine.kernels import invariant

        mode = self.cfg.kernels
        return mode == "invariant" or (mode == "auto" and invariant.backend() is not None and self.group is None)

    def _first_step(self) -> None:
        """One plain eager step before ready: a short prompt and one decode step, so the
        first request is not the first forward the process ever ran, and a model whose
        numbers are broken says so at start (``engine.first_step``)."""
        import mlx.core as mx

        from ..engine.decoders.sampling import Sampler
        from ..engine.decoders.serial import serial_decode
        from ..engine.types import SamplingParams

        lm = self.engine.lm
        t0 = time.perf_counter()
        cache = lm.make_cache()
        prompt = [1 + 31 * i % max(2, min(lm.text_args.vocab_size, 4096) - 1) for i in range(4)]
        gen = serial_decode(lm, prompt, Sampler(SamplingParams(temperature=0.0, seed=0)), cache=cache)
        try:
            step = next(gen)
        finally:
            gen.close()
        logits = lm.logits(lm.hidden(mx.array([[step.tokens[-1]]], dtype=mx.uint32), cache))
        finite = bool(mx.all(mx.isfinite(logits.astype(mx.float32))).item())
        fields = {"ms": round((time.perf_counter() - t0) * 1000, 1), "finite": finite}
        if finite:
            log.info("engine.first_step", **fields)
        else:
            log.warning("engine.first_step", **fields, message="the model's logits are not finite: its output "
                        "will be meaningless (a corrupt or mis-converted checkpoint?)")

    def _set_exact_decode(self, verify_exact: bool) -> None:
        exact_decode = "speculate" if verify_exact else self.cfg.speculation.exact_on_inexact_backend
        with self.status.snapshot_lock:
            self.status.snapshot.exact_decode = exact_decode

    def _build_batch(self) -> None:
        """The continuous batch, built before ready with exact rows kept out of it
        (``exact_ok`` False) until the batch part's verdict (``_batch_part``)."""
        self.engine.batch_speculates = False
        if not self.cfg.scheduler.batching:
            return
        from ..engine.decoders.batch import BatchDecoder

        spec = self.cfg.speculation
        rows = self.cfg.scheduler.batch_rows
        if spec.in_batch and spec.mode != "off" and self.engine.slot.available and self.group is None:
            from ..engine.decoders.batch_spec import SpecBatchDecoder

            slot = self.engine.slot
            self.engine.batch = SpecBatchDecoder(self.engine.lm, head=lambda: slot.head, depth_for=slot.depth_for,
                                                 max_rows=rows, exact_ok=False, spec_ahead=self.build_ahead())
            self.engine.batch_speculates = True
        else:
            self.engine.batch = BatchDecoder(self.engine.lm, max_rows=rows, exact_ok=False)

    # ------------------------------------------------------------------ the parts (warming.py)
    def _parts(self) -> list:
        """The parts, the compiled step first (the others' verdicts are keyed by the decode
        path it decides), then what serving gains most from soonest: exact rows speculating
        and batching, exact snapshots anywhere (a council's seats resume at the shared
        system prompt's end, not a grid point up to a chunk before it), each shape's first
        use paid; then the cost probes. Each verdict depends only on the model, backend and
        code (probe_verdicts.py), not on the order it is asked in. A group's warm-up comes
        after its hello (lockstep.py)."""
        from .warming import WarmPart

        parts = []
        if self.compile_later:
            parts.append(WarmPart("compiled_step", self._compiled_part, refused=self._compiled_refused))
        if self.engine.slot.available:
            parts.append(WarmPart("verify", self._verify_part, waited_by="exact"))
        if self.engine.batch is not None:  # after verify: a speculating batch's verdict needs its answer
            parts.append(WarmPart("batch", self._batch_part, waited_by="exact"))
        if self.engine.prefix_cache is not None:
            parts.append(WarmPart("splits", self._splits_part, waited_by="exact", refused=self._splits_refused))
        if self.group is None:  # the shapes' first uses, paid before the requests that bring them
            parts.append(WarmPart("warmup", self._warmup_part))
        if self.cfg.scheduler.prefill_together != "off" and self.group is None:
            parts.append(WarmPart("prefill_together", self._prefill_together, waited_by="none"))
        if self.engine.batch is not None and self.cfg.scheduler.mixed_steps != "off" and self.group is None:
            parts.append(WarmPart("mixed_steps", self._mixed_steps, waited_by="none"))
        if self.group is None and self._warms("warm_prefill_depths"):
            parts.append(WarmPart("prefill_depths", self._prefill_depths_part, waited_by="idle"))
        if self.group is None and self._warms("warm_prefill_lengths"):  # last: the longest, and serving warms counts too
            parts.append(WarmPart("prefill_lengths", self._prefill_lengths_part, waited_by="idle"))
        return parts

    def _publish_warming(self, warming: dict) -> None:
        with self.status.snapshot_lock:
            self.status.snapshot.warming = warming

    def _set_decode_path(self, compiled, reason: str | None) -> None:
        """Switch the compiled step in (``compiled``) or say why the step stays eager."""
        from .probe_verdicts import verdicts_for

        lm = self.engine.lm
        lm.compiled_decode = compiled
        lm.decode_path = "compiled" if compiled is not None else f"eager: {reason}"
        # The probes after this one key their verdicts by the decode path, as at a slow start.
        self.engine.verdicts = verdicts_for(lm, self.group)
        with self.status.snapshot_lock:
            self.status.snapshot.decode_path = lm.decode_path
            self.status.snapshot.batch_decode_path = lm.batch_decode_path

    def _compiled_refused(self, reason: str) -> None:
        self._set_decode_path(None, reason)

    def _compiled_part(self):
        from ..engine.model.compiled import checked_compiled_decode
        from .warming import Outcome

        lm = self.engine.lm
        compiled, reason = checked_compiled_decode(lm, self.compile_check)

        return Outcome(compiled is not None, reason or "the compiled step is bit for bit the eager one",
                       lambda: self._set_decode_path(compiled, reason),
                       {"compile_check": self.compile_check.verdict, "batch_compile_check": self.compile_check.batch_verdict,
                        "batch_decode_path": "compiled" if compiled is not None and compiled.batched
                        else f"eager: {reason or compiled.batch_reason}"})

    def _verify_part(self):
        """Whether a verify reproduces serial decode bit for bit on this backend, and so
        what exact temperature-0 requests get (engine/decoders/exactness.py). Until it answers they
        decode serially (the safe setting ``load`` left)."""
        from ..engine.decoders.exactness import verify_matches_serial
        from ..engine.decoders.speculative import resolve_rollback
        from .warming import Outcome

        spec = self.cfg.speculation
        rollback = resolve_rollback(spec.rollback)
        t0 = time.perf_counter()
        bit_identical, verdict = self.engine.verdicts.get("verify", rollback,
                                                          lambda: verify_matches_serial(self.engine.lm, rollback))
        verify_exact = bit_identical and not self.cfg.debug_inexact_verify
        exact_decode = "speculate" if verify_exact else spec.exact_on_inexact_backend
        reason = ("a verify here computes what serial steps compute, bit for bit" if verify_exact else
                  "a verify here rounds differently from serial steps, so speculation cannot promise "
                  "serial's tokens at temperature 0: exact requests "
                  + ("decode serially" if exact_decode == "serial" else
                     "speculate with the near-tie guard, which bounds flips but cannot exclude them"))
        probe_ms = round((time.perf_counter() - t0) * 1000, 1)

        def apply() -> None:
            self.engine.verify_exact = verify_exact
            self._set_exact_decode(verify_exact)
            log.info("speculation.exactness", verify_bit_identical=verify_exact, rollback=rollback,
                     forced_inexact=self.cfg.debug_inexact_verify, verdict=verdict,
                     exact_requests=exact_decode, near_tie_guard="off" if verify_exact else "on",
                     probe_ms=probe_ms, reason=reason)

        return Outcome(verify_exact, reason, apply, {"verdict": verdict})

    def _splits_part(self):
        """Whether the prefix cache may snapshot off the chunk grid (prefix_cache_use.py);
        until it answers, exact snapshots are taken on the grid only."""
        from .warming import Outcome

        chunk = self.engine.prefix_cache.chunk
        t0 = time.perf_counter()
        probed, verdict = self.prefix_use.splits_verdict(chunk)
        probe_ms = round((time.perf_counter() - t0) * 1000, 1)
        exact = probed and not self.cfg.debug_inexact_splits

        def apply() -> None:
            self.prefix_use.set_splits(chunk, probed, verdict, probe_ms)

        reason = (f"resuming a prefill off the {chunk}-token grid leaves a cold run's state, bit for bit"
                  if exact else f"off-grid splits are not bit-identical here (or forced): exact snapshots on the "
                                f"{chunk}-token grid only")
        return Outcome(exact, reason, apply, {"verdict": verdict, "chunk": chunk})

    def _splits_refused(self, reason: str) -> None:
        """The probe raised (or was forced to fail): off-grid snapshots stay inexact, those
        taken while it was pending too, and go to the disk tier as such."""
        self.prefix_use.set_splits(self.engine.prefix_cache.chunk, False, "failed", 0.0)

    def _batch_part(self):
        """Whether exact greedy rows may share the batch's forwards: batched logits equal
        one-row ones (and, where the batch speculates, a ragged verify serial ones). Until
        it answers, exact rows decode alone."""
        from ..engine.decoders.batch import batch_matches_serial
        from ..engine.decoders.exactness import ragged_verify_matches_serial
        from .warming import Outcome

        t0 = time.perf_counter()
        lm, rows, batch = self.engine.lm, self.cfg.scheduler.batch_rows, self.engine.batch
        # Both verdicts are cached across starts (probe_verdicts.py), like the verify's.
        exact_ok, verdict = self.engine.verdicts.get("batch", str(rows), lambda: batch_matches_serial(lm, rows))
        if self.engine.batch_speculates:
            if exact_ok and self.engine.verify_exact:
                exact_ok, verdict = self.engine.verdicts.get("ragged_verify", "3", lambda: ragged_verify_matches_serial(lm))
            else:
                exact_ok = False
        probe_ms = round((time.perf_counter() - t0) * 1000, 1)

        def apply() -> None:
            batch.exact_ok = exact_ok
            log.info("batch.ready", rows=batch.max_rows, max_active=self.cfg.scheduler.max_active,
                     exact_rows_batch=exact_ok, verdict=verdict,
                     speculates=self.engine.batch_speculates, batch_decode_path=lm.batch_decode_path,
                     probe_ms=probe_ms)

        reason = ("batched rows compute what each row alone computes, bit for bit: exact rows batch" if exact_ok
                  else "batched rows round unlike one row here (or the verify does): exact rows decode alone")
        return Outcome(exact_ok, reason, apply, {"verdict": verdict})

    # The two cost probes time their forwards at the height the row limit starts at
    # (scheduler.start_height: max_active, or AUTO_START_HEIGHT with "auto"), and their exactness
    # checks run at the batch's height (batch_rows: every height the batch may reach). Whether
    # sharing a forward pays is the device's answer (launch-bound or compute-bound), and at the
    # ceiling of 8 the two timings cost a fresh CPU start ~1 s more than at 4, paid by a
    # council's first rounds (bench/results/row_limit_cpu_2026-12-05).
    def _prefill_together(self):
        """Whether prompts' pieces share forwards (engine/prefill/batched_prefill.py): "auto" times a
        forward of scheduler.start_height rows against one row's; exact greedy rows join where
        the probe finds the batch's rows (batch_rows) bit-identical to each alone. Each prompt
        prefills alone until then."""
        from ..engine.prefill.batched_prefill import together_cost_ratio, together_matches_solo, together_pays

        lm, sched = self.engine.lm, self.cfg.scheduler
        rows, timed = sched.batch_rows, sched.start_height
        return self._measured_choice(
            "prefill_together", sched.prefill_together, f"{rows}-{int(lm.chunked_prefill)}",
            cost_variant=f"{timed}-{int(lm.chunked_prefill)}",
            cost=lambda: together_cost_ratio(lm, timed), pays=lambda r: together_pays(r, timed),
            why_not=lambda r: (f"a forward of {timed} rows costs {r:.2f} one-row forwards here, not under "
                               f"{(timed + 1) / 2}: prompts' first tokens would come later on average"),
            exact=lambda: together_matches_solo(lm, rows), set_to=lambda v: setattr(self.engine, "prefill_together_exact", v),
            log_ready=lambda **fields: log.info("prefill_together.ready", **fields), rows=rows, cost_rows=timed)

    def _mixed_steps(self):
        """Whether the batch's decode forwards carry a prompt's paced piece
        (engine/prefill/mixed_forward.py): "auto" times one mixed forward of scheduler.start_height
        rows against the two it replaces; exact greedy rows and prompts take part where the probe
        finds every group's numbers bit-identical to its own forward's at the batch's rows. None
        carry a piece until then."""
        from ..engine.prefill.mixed_forward import mixed_cost_ratio, mixed_matches_alone, mixed_pays

        lm, sched = self.engine.lm, self.cfg.scheduler
        rows, timed, chunk = sched.batch_rows, sched.start_height, sched.prefill_chunk
        return self._measured_choice(
            "mixed_steps", sched.mixed_steps, f"{rows}-{chunk}", cost_variant=f"{timed}-{chunk}",
            cost=lambda: mixed_cost_ratio(lm, timed), pays=mixed_pays,
            why_not=lambda r: (f"a decode forward of {timed} rows carrying a prompt's piece costs {r:.2f} of the two "
                               "forwards it replaces here: not a fifth less"),
            exact=lambda: mixed_matches_alone(lm, rows, pieces=(1, 6, chunk)),
            set_to=lambda v: setattr(self.engine, "mixed_exact", v),
            log_ready=lambda **fields: log.info("mixed_steps.ready", **fields), rows=rows, cost_rows=timed)

    def _warmup_part(self):
        from .warming import Outcome

        level = self.warmup_mode()
        self.warm_up(level)
        return Outcome(level != "off", f"warm-up {level}: each served shape ran once" if level != "off"
                       else "warmup = \"off\"", None, {"mode": level})

    def _warms(self, key: str) -> bool:
        """Whether an idle warm-up part runs: its setting ``key`` "on", or "auto" where the
        warm-up resolves to "full" (a GPU)."""
        setting = getattr(self.cfg, key)
        return setting == "on" or (setting == "auto" and self.warmup_mode() == "full")

    def _resident_head(self):
        """The MTP head where it is resident (warm-ups prime its history too), else None."""
        return self.engine.slot.head if self.engine.slot.resident else None

    def _prefill_depths_part(self):
        """One long prompt prefilled a chunk a piece (warmup.prefill_depths)."""
        from . import warmup
        from .warming import Outcome

        chunk = self.cfg.scheduler.prefill_chunk
        head = self._resident_head()
        tokens = warmup.prefill_depths(self.engine.lm, warmup.DEPTH_CHUNKS, chunk=chunk, head=head)
        return Outcome(True, f"a {tokens}-token prompt prefilled, a {chunk}-token chunk a piece", None,
                       {"tokens": tokens, "chunk": chunk, "head": head is not None})

    def _prefill_lengths_part(self):
        """Every prompt piece's token count forwarded once (warmup.prefill_each_length)."""
        from . import warmup
        from .warming import Outcome

        chunk = self.cfg.scheduler.prefill_chunk
        lengths = warmup.remaining_lengths(self.warmup_mode(), chunk)
        head = self._resident_head()
        warmup.prefill_each_length(self.engine.lm, lengths, chunk=chunk, head=head)
        return Outcome(True, f"each prompt piece's token count 1..{chunk} forwarded once", None,
                       {"lengths": len(lengths), "chunk": chunk, "head": head is not None})

    def _measured_choice(self, probe: str, mode: str, variant: str, *, cost_variant: str, cost: Callable[[], float],
                         pays: Callable[[float], bool], why_not: Callable[[float], str], exact: Callable[[], bool],
                         set_to: Callable[[bool | None], None], log_ready: Callable[..., None], **fields):
        """A start-up choice of an optional way to run the step ("auto" or "on"): with "auto",
        off (None) where ``cost`` (a cost ratio, timed once and kept with the probes'
        verdicts under ``cost_variant``: the backend's answer, not the moment's load) does not
        ``pay``; else whether exact greedy requests may take part (``exact``'s verdict, kept
        likewise under ``variant``). An Outcome whose ``apply`` hands that to ``set_to`` and
        logs the caller's ``.ready`` event (``log_ready``)."""
        from .warming import Outcome

        t0 = time.perf_counter()
        ratio = None
        if mode == "auto":
            ratio = self.engine.verdicts.measure(f"{probe}_cost", cost_variant, cost)
            if not pays(ratio):
                out = {"mode": mode, "enabled": False, **fields, "cost_ratio": round(ratio, 3),
                       "reason": why_not(ratio), "probe_ms": round((time.perf_counter() - t0) * 1000, 1)}
                return Outcome(False, out["reason"], lambda: log_ready(**out),
                               {"cost_ratio": out["cost_ratio"]})
        exact_ok, verdict = self.engine.verdicts.get(probe, variant, exact)
        out = {"mode": mode, "enabled": True, **fields, "exact_rows": exact_ok, "verdict": verdict,
               "cost_ratio": None if ratio is None else round(ratio, 3),
               "probe_ms": round((time.perf_counter() - t0) * 1000, 1)}

        def apply() -> None:
            set_to(exact_ok)
            log_ready(**out)

        return Outcome(True, "on" + (f" (cost ratio {out['cost_ratio']})" if ratio is not None else "")
                       + (", exact rows too" if exact_ok else ", not for exact greedy rows (not bit-identical here)"),
                       apply, {"cost_ratio": out["cost_ratio"], "verdict": verdict})

    def _await_prebuild(self) -> None:
        """Before the first forward: the modules the workers compile (prebuild_start.py)
        are then read from the folder instead of compiled one at a time by this process."""
        if self.prebuild is None:
            return
        t0 = time.perf_counter()
        report = self.prebuild.wait(PREBUILD_WAIT_S)
        log.info("kernels.prebuilt", waited_s=round(time.perf_counter() - t0, 3), **report)

    def _configure_backend(self) -> None:
        # Before the first forward: MLX reads these once per process (engine/jit/backend_env.py).
        try:
            ptx: Path | None = backend_env.ptx_cache_folder(cache_dir())
        except OSError:  # an unusable cache folder: MLX keeps its own default
            ptx = None
        env = backend_env.configure(self.cfg.cudnn_attention, ptx)
        custom_kernel_cache.CACHE.configure(self.cfg.custom_kernel_cache)
        log.info("engine.backend_env", **{name: f"{value} ({source})" for name, (value, source) in env.items()})

    def warmup_mode(self) -> str:
        """``warmup`` resolved on this machine: "full", "light" or "off"."""
        import mlx.core as mx

        from .warmup import resolve

        return resolve(self.cfg.warmup, mx.default_device() == mx.gpu)

    def warm_up(self, level: str | None = None) -> None:
        """Run the shapes this daemon serves once before it is ready (daemon/engine_thread/warmup.py), after
        the start-up probes; ``warmup`` in the config says how much (``level``: rank 0's
        resolved mode, which the other ranks of a group adopt)."""
        from governor import load_config as load_governor_config

        from . import warmup

        level = level or self.warmup_mode()
        if level == "off":
            log.info("warmup.done", mode=level, seconds=0.0, stages={})
            return
        # Every rank of a group must run the same forwards: a rank's [governor] table is its
        # own (not in the group's fingerprint), so a group warms the default depths; and no
        # near-tie guard (its serial re-decisions depend on this rank's probe verdict).
        max_depth = load_governor_config({} if self.group is not None else self.cfg.governor).max_depth
        t0 = time.perf_counter()
        stages = warmup.run(
            level, self.engine.lm, chunk=self.cfg.scheduler.prefill_chunk,
            head=self._resident_head(),
            depths=list(range(1, max_depth + 1)),
            batch=self.engine.batch, max_rows=self.cfg.scheduler.batch_rows,
            emit=lambda event, **fields: log.info(event, **fields),
            spec_options={"rollback": self.cfg.speculation.rollback, "pipeline": self.build_ahead(),
                          "guard_margin": None})
        seconds = round(time.perf_counter() - t0, 3)
        with self.status.snapshot_lock:
            self.status.snapshot.warmup = {"mode": level, "seconds": seconds, "stages": stages}
        log.info("warmup.done", mode=level, seconds=seconds, stages=stages)

    def _prompt_limit(self) -> int | None:
        """Set ``max_prompt_tokens`` from the model's context: the config may lower it, and
        raises it past the context only with max_prompt_tokens_beyond_context. Returns the
        context (None when the model's config does not say)."""
        context = getattr(self.engine.lm.text_args, "max_position_embeddings", None)
        context = context if isinstance(context, int) and context > 0 else None
        configured = self.cfg.max_prompt_tokens
        if configured is None:
            self.engine.max_prompt_tokens = context or 32768
        elif context is not None and configured > context and not self.cfg.max_prompt_tokens_beyond_context:
            self.engine.max_prompt_tokens = context
            log.warning("config.clamped", key="max_prompt_tokens", configured=configured, used=context,
                        reason=f"the model's context is {context} tokens; set "
                               "max_prompt_tokens_beyond_context = true to allow longer prompts")
        else:
            self.engine.max_prompt_tokens = configured
        return context

    def _load_progress(self, done: int, total: int, seconds: float) -> None:
        """One log event per ~5% of the weights read; the status snapshot and the service
        manager (EXTEND_TIMEOUT_USEC, through the hooks) hear of each."""
        percent = int(100 * done / total) if total else 100
        with self.status.snapshot_lock:
            last = self.status.snapshot.load_progress.get("percent", -1)
            self.status.snapshot.load_progress = {"percent": percent, "bytes_loaded": done, "bytes_total": total,
                                           "seconds": round(seconds, 2)}
        if percent == last:
            return
        log.info("model.load_progress", percent=percent, bytes_loaded=done, bytes_total=total,
                 seconds=round(seconds, 2))
        if self.hooks is not None and hasattr(self.hooks, "on_load_progress"):
            self.hooks.on_load_progress(percent)

    def _choose_kernels(self) -> None:
        """MLX's kernels or the invariant ones (kernel_choice.py), before the exactness
        probes, which then answer for the kernels chosen."""
        from ..engine.kernels import invariant
        from ..engine.decoders.speculative import resolve_rollback
        from .kernel_choice import choose_kernels, log_choice

        invariant.PERTURB_BATCHED = self.cfg.debug_perturb_invariant_batch
        spec = self.cfg.speculation
        ragged = self.cfg.scheduler.batching and spec.in_batch and spec.mode != "off" and self.engine.slot.available
        choice = choose_kernels(self.engine.lm, self.cfg.kernels, rollback=resolve_rollback(spec.rollback),
                                rows=self.cfg.scheduler.batch_rows, ragged=ragged,
                                compile_decode=self.cfg.compile_decode, group=self.group,
                                checked=self.compile_check)
        self.engine.verdicts = choice.verdicts
        log_choice(choice, invariant.backend())
        with self.status.snapshot_lock:
            self.status.snapshot.kernels = choice.kernels
            self.status.snapshot.kernels_reason = choice.reason

    def build_ahead(self) -> bool | None:
        """speculative_decode's ``pipeline``. Never in a group: whether a cycle is built ahead
        depends on this rank's wall-clock cycle time, so ranks could build (and run) their
        forwards' collectives in different graphs and orders; lockstep needs every rank to
        make the same choice, and only a fixed one is."""
        if self.group is not None:
            return False
        spec = self.cfg.speculation
        return None if spec.build_ahead == "auto" else spec.build_ahead
