"""Bringing the engine up: the model, the head, the start-up probes and the warm-up.

``EngineStartup.load`` does everything ``EngineWorker.run`` needs before the step loop
starts: load the weights (reporting progress), set the prompt limit from the model's
context, load the MTP head, probe whether a verify (and a batch) reproduces serial decode bit
for bit on this backend (verdicts cached across starts, probe_verdicts.py), open the prefix
cache (prefix_cache_use.py), build the continuous batch and the governance, and run the
warm-up (warmup.py) before the daemon says it is ready. It returns a ``LoadedEngine``: the
objects the engine thread's parts share.

A part of ``EngineWorker`` (worker.py) with its own state: what it is given in its
constructor, and the engine it builds.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from .loaded_engine import LoadedEngine
from ..logs import get_logger

if TYPE_CHECKING:
    from .status_snapshot import EngineStatus

log = get_logger("councild.engine")


class EngineStartup:
    """The start-up steps: ``load`` builds the engine; ``warm_up`` and ``warmup_mode`` are
    also a group's (lockstep.py), which warms up after its ranks agree."""

    def __init__(self, cfg, model_path: str, group, status: EngineStatus, hooks: Any = None,
                 requests_holding_head: Callable[[], int] | None = None):
        self.cfg = cfg
        self.model_path = model_path
        self.group = group
        self.status = status
        self.hooks = hooks
        self.requests_holding_head = requests_holding_head
        self.engine = LoadedEngine(max_prompt_tokens=cfg.max_prompt_tokens or 0)

    def load(self) -> LoadedEngine:
        from ..engine.loading import load_model
        from ..logs import route_library_logs
        from .prefix_cache_use import PrefixCacheUse
        from .probe_verdicts import CompiledStepCheck, verdicts_for

        route_library_logs()
        self._configure_backend()
        t0 = time.perf_counter()
        compile_check = CompiledStepCheck(self.group)
        self.engine.lm = load_model(self.model_path, compile_decode=self.cfg.compile_decode, progress=self._load_progress,
                             group=self.group, compile_check=compile_check)
        context = self._prompt_limit()
        log.info("model.loaded", path=str(self.engine.lm.path), model_type=self.engine.lm.model_type,
                 decode_path=self.engine.lm.decode_path, compile_check=compile_check.verdict,
                 batch_decode_path=self.engine.lm.batch_decode_path, batch_compile_check=compile_check.batch_verdict,
                 seconds=round(time.perf_counter() - t0, 3),
                 context_tokens=context, max_prompt_tokens=self.engine.max_prompt_tokens)
        from .head_slot import HeadSlot

        self.engine.slot = HeadSlot(self.engine.lm, self.cfg.speculation.depth, on_change=self.status.head_changed)
        if self.cfg.speculation.mode != "off" or self.cfg.speculation.load_head:
            self.engine.slot.load_at_startup(keep=self.cfg.speculation.load_head)
            if self.engine.slot.error is not None:
                with self.status.snapshot_lock:
                    self.status.snapshot.head_error = self.engine.slot.error
        self.engine.verify_exact = True
        self.engine.verdicts = verdicts_for(self.engine.lm, self.group)
        self._choose_kernels()
        if self.engine.slot.available:
            self._probe_exactness()
        self.engine.batch = None
        self.engine.prefix_cache = None
        if self.cfg.prefix_cache.enabled:
            PrefixCacheUse(self.cfg, self.engine, self.group).open_prefix_cache(self.cfg.scheduler.prefill_chunk)
        # Whether the continuous batch speculates (engine/batch_spec.py) or decodes at depth 0.
        self.engine.batch_speculates = False
        if self.cfg.scheduler.batching:
            from ..engine.batch import BatchDecoder, batch_matches_serial
            from ..engine.exactness import ragged_verify_matches_serial

            t0 = time.perf_counter()
            spec = self.cfg.speculation
            rows = self.cfg.scheduler.batch_rows
            # Both verdicts are cached across starts (probe_verdicts.py), like the verify's.
            exact_ok, verdict = self.engine.verdicts.get("batch", str(rows), lambda: batch_matches_serial(self.engine.lm, rows))
            if spec.in_batch and spec.mode != "off" and self.engine.slot.available and self.group is None:
                from ..engine.batch_spec import SpecBatchDecoder

                if exact_ok and self.engine.verify_exact:
                    exact_ok, verdict = self.engine.verdicts.get("ragged_verify", "3", lambda: ragged_verify_matches_serial(self.engine.lm))
                else:
                    exact_ok = False
                slot = self.engine.slot
                self.engine.batch = SpecBatchDecoder(self.engine.lm, head=lambda: slot.head, depth_for=slot.depth_for,
                                              max_rows=rows, exact_ok=exact_ok)
                self.engine.batch_speculates = True
            else:
                self.engine.batch = BatchDecoder(self.engine.lm, max_rows=rows, exact_ok=exact_ok)
            log.info("batch.ready", rows=self.engine.batch.max_rows, max_active=self.cfg.scheduler.max_active, exact_rows_batch=self.engine.batch.exact_ok, verdict=verdict,
                     speculates=self.engine.batch_speculates, batch_decode_path=self.engine.lm.batch_decode_path,
                     probe_ms=round((time.perf_counter() - t0) * 1000, 1))
        self._prefill_together()
        self._mixed_steps()
        if self.cfg.governor_enabled:
            from ..engine.cache_size import row_cache_bytes
            from .governance import Governance

            self.engine.row_cache_bytes = row_cache_bytes(self.engine.lm, self.engine.max_prompt_tokens)
            self.engine.governance = Governance(self.engine.slot, self.cfg.governor, self.engine.lm.path, prefix_cache=self.engine.prefix_cache,
                                         holding_head=self.requests_holding_head, trace=self.cfg.governor_trace)
            self.engine.tuned_profile = self.engine.governance.tuned_profile
        if self.group is None:  # a group warms up after its hello, once the ranks agree (lockstep.py)
            self.warm_up()
        return self.engine

    def _prefill_together(self) -> None:
        """Whether prompts' pieces share forwards (engine/batched_prefill.py): "auto" times a
        forward of scheduler.batch_rows rows (max_active, or its ceiling with "auto") against
        one row's; exact greedy rows join where the probe finds the rows bit-identical to each
        alone."""
        from ..engine.batched_prefill import together_cost_ratio, together_matches_solo, together_pays

        lm, rows = self.engine.lm, self.cfg.scheduler.batch_rows
        self.engine.prefill_together_exact = None
        if self.cfg.scheduler.prefill_together == "off" or self.group is not None:
            return
        self.engine.prefill_together_exact, fields = self._measured_choice(
            "prefill_together", self.cfg.scheduler.prefill_together, f"{rows}-{int(lm.chunked_prefill)}",
            cost=lambda: together_cost_ratio(lm, rows), pays=lambda r: together_pays(r, rows),
            why_not=lambda r: (f"a forward of {rows} rows costs {r:.2f} one-row forwards here, not under "
                               f"{(rows + 1) / 2}: prompts' first tokens would come later on average"),
            exact=lambda: together_matches_solo(lm, rows), rows=rows)
        log.info("prefill_together.ready", **fields)

    def _mixed_steps(self) -> None:
        """Whether the batch's decode forwards carry a prompt's paced piece
        (engine/mixed_forward.py): "auto" times one mixed forward against the two it replaces;
        exact greedy rows and prompts take part where the probe finds every group's numbers
        bit-identical to its own forward's."""
        from ..engine.mixed_forward import mixed_cost_ratio, mixed_matches_alone, mixed_pays

        self.engine.mixed_exact = None
        if self.engine.batch is None or self.cfg.scheduler.mixed_steps == "off" or self.group is not None:
            return
        lm, rows, chunk = self.engine.lm, self.cfg.scheduler.batch_rows, self.cfg.scheduler.prefill_chunk
        self.engine.mixed_exact, fields = self._measured_choice(
            "mixed_steps", self.cfg.scheduler.mixed_steps, f"{rows}-{chunk}",
            cost=lambda: mixed_cost_ratio(lm, rows), pays=mixed_pays,
            why_not=lambda r: (f"a decode forward of {rows} rows carrying a prompt's piece costs {r:.2f} of the two "
                               "forwards it replaces here: not a fifth less"),
            exact=lambda: mixed_matches_alone(lm, rows, pieces=(1, 6, chunk)), rows=rows)
        log.info("mixed_steps.ready", **fields)

    def _measured_choice(self, probe: str, mode: str, variant: str, *, cost: Callable[[], float],
                         pays: Callable[[float], bool], why_not: Callable[[float], str], exact: Callable[[], bool],
                         **fields) -> tuple[bool | None, dict]:
        """A start-up choice of an optional way to run the step ("auto" or "on"): with "auto",
        off (None) where ``cost`` (a cost ratio, timed once and kept with the probes'
        verdicts: the backend's answer, not the moment's load) does not ``pay``; else whether
        exact greedy requests may take part (``exact``'s verdict, kept likewise). Returns it
        with the fields of the caller's ``.ready`` log event."""
        t0 = time.perf_counter()
        ratio = None
        if mode == "auto":
            ratio = self.engine.verdicts.measure(f"{probe}_cost", variant, cost)
            if not pays(ratio):
                return None, {"mode": mode, "enabled": False, **fields, "cost_ratio": round(ratio, 3),
                              "reason": why_not(ratio), "probe_ms": round((time.perf_counter() - t0) * 1000, 1)}
        exact_ok, verdict = self.engine.verdicts.get(probe, variant, exact)
        return exact_ok, {"mode": mode, "enabled": True, **fields, "exact_rows": exact_ok, "verdict": verdict,
                          "cost_ratio": None if ratio is None else round(ratio, 3),
                          "probe_ms": round((time.perf_counter() - t0) * 1000, 1)}

    def _configure_backend(self) -> None:
        # Before the first forward: MLX reads these once per process (engine/backend_env.py).
        from ..engine import backend_env
        from ..paths import cache_dir

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
            head=self.engine.slot.head if self.engine.slot.resident else None,
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
        from ..engine import invariant
        from ..engine.speculative import resolve_rollback
        from .kernel_choice import choose_kernels, log_choice

        invariant.PERTURB_BATCHED = self.cfg.debug_perturb_invariant_batch
        spec = self.cfg.speculation
        ragged = self.cfg.scheduler.batching and spec.in_batch and spec.mode != "off" and self.engine.slot.available
        choice = choose_kernels(self.engine.lm, self.cfg.kernels, rollback=resolve_rollback(spec.rollback),
                                rows=self.cfg.scheduler.batch_rows, ragged=ragged,
                                compile_decode=self.cfg.compile_decode, group=self.group)
        self.engine.verdicts = choice.verdicts
        log_choice(choice, invariant.backend())
        with self.status.snapshot_lock:
            self.status.snapshot.kernels = choice.kernels
            self.status.snapshot.kernels_reason = choice.reason

    def _probe_exactness(self) -> None:
        """Whether a verify reproduces serial decode bit for bit on this backend, and so
        what exact temperature-0 requests get (engine/exactness.py)."""
        from ..engine.exactness import verify_matches_serial
        from ..engine.speculative import resolve_rollback

        spec = self.cfg.speculation
        rollback = resolve_rollback(spec.rollback)
        t0 = time.perf_counter()
        bit_identical, verdict = self.engine.verdicts.get("verify", rollback, lambda: verify_matches_serial(self.engine.lm, rollback))
        self.engine.verify_exact = bit_identical and not self.cfg.debug_inexact_verify
        exact_decode = "speculate" if self.engine.verify_exact else spec.exact_on_inexact_backend
        with self.status.snapshot_lock:
            self.status.snapshot.exact_decode = exact_decode
        log.info("speculation.exactness", verify_bit_identical=self.engine.verify_exact, rollback=rollback,
                 forced_inexact=self.cfg.debug_inexact_verify, verdict=verdict,
                 exact_requests=exact_decode, near_tie_guard="off" if self.engine.verify_exact else "on",
                 probe_ms=round((time.perf_counter() - t0) * 1000, 1),
                 reason=("a verify here computes what serial steps compute, bit for bit" if self.engine.verify_exact else
                         "a verify here rounds differently from serial steps, so speculation cannot promise "
                         "serial's tokens at temperature 0: exact requests "
                         + ("decode serially" if exact_decode == "serial" else
                            "speculate with the near-tie guard, which bounds flips but cannot exclude them")))

    def build_ahead(self) -> bool | None:
        """speculative_decode's ``pipeline``. Never in a group: whether a cycle is built ahead
        depends on this rank's wall-clock cycle time, so ranks could build (and run) their
        forwards' collectives in different graphs and orders; lockstep needs every rank to
        make the same choice, and only a fixed one is."""
        if self.group is not None:
            return False
        spec = self.cfg.speculation
        return None if spec.build_ahead == "auto" else spec.build_ahead
