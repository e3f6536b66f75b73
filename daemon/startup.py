"""Bringing the engine up: the model, the head, the start-up probes and the warm-up.

Everything ``EngineWorker.run`` does before the step loop starts: load the weights
(reporting progress), set the prompt limit from the model's context, load the MTP head,
probe whether a verify (and a batch) reproduces serial decode bit for bit on this backend
(verdicts cached across starts, probe_verdicts.py), build the continuous batch and the
governance, and run the warm-up (warmup.py) before the daemon says it is ready.

``EngineStartup`` is a part of ``EngineWorker`` (worker.py) kept in its own file; the
prefix cache it opens is prefix_cache_use.py's.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path

from .logs import get_logger

log = get_logger("councild.engine")


class EngineStartup:
    """The start-up steps (a mixin of EngineWorker)."""

    def _load(self) -> None:
        # No cyclic collections while start-up builds its objects (mlx-lm and transformers'
        # imports, the model, the traces): ~7% of the imports' time, about what the one
        # collection after costs. That collection frees start-up's cyclic garbage (the
        # warm-up's caches may sit in it: frozen, it would never be freed); then what lives
        # on is frozen out of the collector's view: a full collection over it took ~100 ms
        # on the bundled model on CPU, a stall in every stream each time one ran mid-decode.
        gc.disable()
        try:
            self._load_unfrozen()
        finally:
            gc.collect()
            gc.freeze()
            gc.enable()

    def _load_unfrozen(self) -> None:
        from .engine.loading import load_model
        from .logs import route_library_logs
        from .probe_verdicts import CompiledStepCheck, verdicts_for

        route_library_logs()
        self._configure_backend()
        t0 = time.perf_counter()
        compile_check = CompiledStepCheck(self.group)
        self.lm = load_model(self.model_path, compile_decode=self.cfg.compile_decode, progress=self._load_progress,
                             group=self.group, compile_check=compile_check)
        context = self._prompt_limit()
        log.info("model.loaded", path=str(self.lm.path), model_type=self.lm.model_type,
                 decode_path=self.lm.decode_path, compile_check=compile_check.verdict,
                 batch_decode_path=self.lm.batch_decode_path, batch_compile_check=compile_check.batch_verdict,
                 seconds=round(time.perf_counter() - t0, 3),
                 context_tokens=context, max_prompt_tokens=self.max_prompt_tokens)
        from .head_slot import HeadSlot

        self.slot = HeadSlot(self.lm, self.cfg.speculation.depth, on_change=self._head_changed)
        if self.cfg.speculation.mode != "off" or self.cfg.speculation.load_head:
            self.slot.load_at_startup(keep=self.cfg.speculation.load_head)
            if self.slot.error is not None:
                with self.snapshot_lock:
                    self.snapshot.head_error = self.slot.error
        self.verify_exact = True
        self.verdicts = verdicts_for(self.lm, self.group)
        self._choose_kernels()
        if self.slot.available:
            self._probe_exactness()
        self.batch = None
        self.prefix_cache = None
        if self.cfg.prefix_cache.enabled:
            self._open_prefix_cache(self.cfg.scheduler.prefill_chunk)
        # Whether the continuous batch speculates (engine/batch_spec.py) or decodes at depth 0.
        self.batch_speculates = False
        if self.cfg.scheduler.batching:
            from .engine.batch import BatchDecoder, batch_matches_serial
            from .engine.exactness import ragged_verify_matches_serial

            t0 = time.perf_counter()
            spec = self.cfg.speculation
            rows = self.cfg.scheduler.max_active
            # Both verdicts are cached across starts (probe_verdicts.py), like the verify's.
            exact_ok, verdict = self.verdicts.get("batch", str(rows), lambda: batch_matches_serial(self.lm, rows))
            if spec.in_batch and spec.mode != "off" and self.slot.available and self.group is None:
                from .engine.batch_spec import SpecBatchDecoder

                if exact_ok and self.verify_exact:
                    exact_ok, verdict = self.verdicts.get("ragged_verify", "3", lambda: ragged_verify_matches_serial(self.lm))
                else:
                    exact_ok = False
                slot = self.slot
                self.batch = SpecBatchDecoder(self.lm, head=lambda: slot.head, depth_for=slot.depth_for,
                                              max_rows=rows, exact_ok=exact_ok)
                self.batch_speculates = True
            else:
                self.batch = BatchDecoder(self.lm, max_rows=rows, exact_ok=exact_ok)
            log.info("batch.ready", rows=self.batch.max_rows, exact_rows_batch=self.batch.exact_ok, verdict=verdict,
                     speculates=self.batch_speculates, batch_decode_path=self.lm.batch_decode_path,
                     probe_ms=round((time.perf_counter() - t0) * 1000, 1))
        if self.cfg.governor_enabled:
            from .governance import Governance

            self.governance = Governance(self.slot, self.cfg.governor, self.lm.path, prefix_cache=self.prefix_cache,
                                         holding_head=self.requests_holding_head, trace=self.cfg.governor_trace)
            self.tuned_profile = self.governance.tuned_profile
        if self.group is None:  # a group warms up after its hello, once the ranks agree (lockstep.py)
            self._warm_up()
        # The first status answer already has every row (step, seats, memory): publish before
        # ready rather than at the step loop's first turn, which a status read can beat.
        self._publish()
        with self.snapshot_lock:
            self.snapshot.model = self.lm.name
            self.snapshot.model_type = self.lm.model_type
            self.snapshot.decode_path = self.lm.decode_path
            self.snapshot.batch_decode_path = self.lm.batch_decode_path
            self.snapshot.ready = True

    def _configure_backend(self) -> None:
        # Before the first forward: MLX reads these once per process (engine/backend_env.py).
        from .engine import backend_env
        from .paths import cache_dir

        try:
            ptx: Path | None = cache_dir() / "mlx-ptx"
        except OSError:  # an unusable cache folder: MLX keeps its own default
            ptx = None
        env = backend_env.configure(self.cfg.cudnn_attention, ptx)
        log.info("engine.backend_env", **{name: f"{value} ({source})" for name, (value, source) in env.items()})

    def warmup_mode(self) -> str:
        """``warmup`` resolved on this machine: "full", "light" or "off"."""
        import mlx.core as mx

        from .warmup import resolve

        return resolve(self.cfg.warmup, mx.default_device() == mx.gpu)

    def _warm_up(self, level: str | None = None) -> None:
        """Run the shapes this daemon serves once before it is ready (daemon/warmup.py), after
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
            level, self.lm, chunk=self.cfg.scheduler.prefill_chunk,
            head=self.slot.head if self.slot.resident else None,
            depths=list(range(1, max_depth + 1)),
            batch=self.batch, max_rows=self.cfg.scheduler.max_active,
            emit=lambda event, **fields: log.info(event, **fields),
            spec_options={"rollback": self.cfg.speculation.rollback, "pipeline": self._build_ahead(),
                          "guard_margin": None})
        seconds = round(time.perf_counter() - t0, 3)
        with self.snapshot_lock:
            self.snapshot.warmup = {"mode": level, "seconds": seconds, "stages": stages}
        log.info("warmup.done", mode=level, seconds=seconds, stages=stages)

    def _prompt_limit(self) -> int | None:
        """Set ``max_prompt_tokens`` from the model's context: the config may lower it, and
        raises it past the context only with max_prompt_tokens_beyond_context. Returns the
        context (None when the model's config does not say)."""
        context = getattr(self.lm.text_args, "max_position_embeddings", None)
        context = context if isinstance(context, int) and context > 0 else None
        configured = self.cfg.max_prompt_tokens
        if configured is None:
            self.max_prompt_tokens = context or 32768
        elif context is not None and configured > context and not self.cfg.max_prompt_tokens_beyond_context:
            self.max_prompt_tokens = context
            log.warning("config.clamped", key="max_prompt_tokens", configured=configured, used=context,
                        reason=f"the model's context is {context} tokens; set "
                               "max_prompt_tokens_beyond_context = true to allow longer prompts")
        else:
            self.max_prompt_tokens = configured
        return context

    def _load_progress(self, done: int, total: int, seconds: float) -> None:
        """One log event per ~5% of the weights read; the status snapshot and the service
        manager (EXTEND_TIMEOUT_USEC, through the hooks) hear of each."""
        percent = int(100 * done / total) if total else 100
        with self.snapshot_lock:
            last = self.snapshot.load_progress.get("percent", -1)
            self.snapshot.load_progress = {"percent": percent, "bytes_loaded": done, "bytes_total": total,
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
        from .engine import invariant
        from .engine.speculative import resolve_rollback
        from .kernel_choice import choose_kernels, log_choice

        invariant.PERTURB_BATCHED = self.cfg.debug_perturb_invariant_batch
        spec = self.cfg.speculation
        ragged = self.cfg.scheduler.batching and spec.in_batch and spec.mode != "off" and self.slot.available
        choice = choose_kernels(self.lm, self.cfg.kernels, rollback=resolve_rollback(spec.rollback),
                                rows=self.cfg.scheduler.max_active, ragged=ragged,
                                compile_decode=self.cfg.compile_decode, group=self.group)
        self.verdicts = choice.verdicts
        log_choice(choice, invariant.backend())
        with self.snapshot_lock:
            self.snapshot.kernels = choice.kernels
            self.snapshot.kernels_reason = choice.reason

    def _probe_exactness(self) -> None:
        """Whether a verify reproduces serial decode bit for bit on this backend, and so
        what exact temperature-0 requests get (engine/exactness.py)."""
        from .engine.exactness import verify_matches_serial
        from .engine.speculative import resolve_rollback

        spec = self.cfg.speculation
        rollback = resolve_rollback(spec.rollback)
        t0 = time.perf_counter()
        bit_identical, verdict = self.verdicts.get("verify", rollback, lambda: verify_matches_serial(self.lm, rollback))
        self.verify_exact = bit_identical and not self.cfg.debug_inexact_verify
        exact_decode = "speculate" if self.verify_exact else spec.exact_on_inexact_backend
        with self.snapshot_lock:
            self.snapshot.exact_decode = exact_decode
        log.info("speculation.exactness", verify_bit_identical=self.verify_exact, rollback=rollback,
                 forced_inexact=self.cfg.debug_inexact_verify, verdict=verdict,
                 exact_requests=exact_decode, near_tie_guard="off" if self.verify_exact else "on",
                 probe_ms=round((time.perf_counter() - t0) * 1000, 1),
                 reason=("a verify here computes what serial steps compute, bit for bit" if self.verify_exact else
                         "a verify here rounds differently from serial steps, so speculation cannot promise "
                         "serial's tokens at temperature 0: exact requests "
                         + ("decode serially" if exact_decode == "serial" else
                            "speculate with the near-tie guard, which bounds flips but cannot exclude them")))
