"""Which kernels the model's forward runs through: MLX's own, or the invariant ones.

Exact mode needs a row's logits not to depend on the rows and positions beside it (a
verify of T positions must give serial's bits; a batched row its own). The start-up probes
(engine/decoders/exactness.py, engine/decoders/batch.py) test exactly that. On the CPU MLX's kernels pass
them; on the H200 they do not (measured: bench/results/invariance_h200_*), and exact rows
there had to decode alone and serially. engine/kernels/invariant.py's kernels (a fixed-order
matmul and attention) pass them on the H200 for the bundled model; they cost speed.

``choose_kernels`` decides once at start-up:
- "mlx": MLX's kernels, whatever the probes say (today's fallbacks then apply).
- "invariant": install the invariant kernels and keep them if the probes prove them
  invariant; refuse them (back to MLX's) if not.
- "auto": MLX's where the probes prove them invariant (no price to pay); else the invariant
  kernels where the backend can run them and the probes prove them; else MLX's.
Every probe answer is cached across starts (probe_verdicts.py, keyed by the kernels too).
The decision and its reasons go to the log (``engine.kernels``) and to status.

Where "auto" or "invariant" ends on MLX's kernels on CUDA, the quantized layers still take the
faster of MLX's kernel and the tensor-core one by row count (engine/kernels/quant_route.py, measured on
the H200): kernels "mlx+qmm". Exactness is unchanged by it (exact rows decode alone there, the
probes re-run under the routed kernels); a configured "mlx" keeps MLX's everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..engine.kernels import invariant, quant_route
from ..engine.decoders.batch import batch_matches_serial
from ..engine.model.compiled import enable_compiled_decode
from ..engine.decoders.exactness import ragged_verify_matches_serial, verify_matches_serial
from ..logs import get_logger
from .probe_verdicts import ProbeVerdicts, verdicts_for

log = get_logger("councild.engine")

# The deepest verify a decode forward may hold per row (speculation.depth's ceiling, 8) plus
# its bonus position: with scheduler.batch_rows rows (max_active, or its ceiling with
# "auto"), the largest forward the invariant path must cover.
MAX_VERIFY_POSITIONS = 9


@dataclass
class KernelChoice:
    kernels: str  # "mlx", "invariant" or "mlx+qmm" (MLX's, the quantized layers routed for speed)
    reason: str
    verdicts: ProbeVerdicts
    probes: dict = field(default_factory=dict)  # {"mlx": {...}, "invariant": {...}}: what each probe said
    # The re-traced compiled step's self-check after a kernel swap: "cached" (an earlier
    # start's verdict for these kernels), "probed", or None (no swap, or not compiling).
    compile_check: str | None = None


def _probe(lm, verdicts: ProbeVerdicts, rollback: str, rows: int, ragged: bool) -> dict:
    out = {"verify": verdicts.get("verify", rollback, lambda: verify_matches_serial(lm, rollback))[0],
           "batch": verdicts.get("batch", str(rows), lambda: batch_matches_serial(lm, rows))[0]}
    if ragged:
        out["ragged_verify"] = verdicts.get("ragged_verify", "3", lambda: ragged_verify_matches_serial(lm))[0]
    return out


def _forget_probes(lm) -> None:
    """The probes cache their answers on the model object; a kernel swap makes them stale."""
    for key in ("_verify_matches_serial", "_batch_matches_serial", "_ragged_verify_matches_serial",
                "_prefill_together_matches_solo"):
        lm.__dict__.pop(key, None)


def swap_kernels(lm, to_invariant: bool, rows: int, compile_decode: bool, route_quantized: bool = False,
                 checked: Callable[..., str | None] | None = None) -> None:
    """Put ``lm`` on the invariant kernels (for decode forwards of up to ``rows`` rows) or
    back on MLX's, unprobed: choose_kernels probes; benches that compare both sets call this.
    ``route_quantized``: back on MLX's, but on CUDA the quantized layers take the faster kernel
    by row count (engine/kernels/quant_route.py). ``checked``: answers for the re-traced
    compiled step's self-checks from an earlier start's verdicts (probe_verdicts.CompiledStepCheck;
    keyed by the kernels), so a start that found them does not run them again."""
    quant_route.uninstall(lm.text_module)
    if to_invariant:
        invariant.install(lm.text_module, max_rows=rows * MAX_VERIFY_POSITIONS)
        if invariant.REFUSED:  # quantized layers the fixed-order kernel cannot take: MLX's, the probes decide
            reasons: dict[str, int] = {}
            for why in invariant.REFUSED.values():
                reasons[why] = reasons.get(why, 0) + 1
            log.info("engine.kernels.refused_layers", count=len(invariant.REFUSED),
                     first=next(iter(invariant.REFUSED)), reasons=reasons)
    else:
        invariant.uninstall(lm.text_module)
    # A perturbed run (the test hook) is another kernel set: its failing verdicts must not be
    # read back by an unperturbed start.
    lm.kernels = ("invariant-perturbed" if invariant.PERTURB_BATCHED else "invariant") if to_invariant else "mlx"
    if not to_invariant and route_quantized and invariant.backend() == "cuda" and quant_route.install(lm.text_module):
        lm.kernels = "mlx+qmm"
    _forget_probes(lm)
    # The compiled one-token forward traced the old layers: trace it again (it checks itself
    # against the eager forward before it is used, as at load, or reads that check's verdict).
    if compile_decode and lm.supports_mtp:
        reason = enable_compiled_decode(lm, checked)
        lm.decode_path = "compiled" if reason is None else f"eager: {reason}"


def choose_kernels(lm, mode: str, *, rollback: str, rows: int, ragged: bool, compile_decode: bool,
                   group=None, checked: Callable[..., str | None] | None = None) -> KernelChoice:
    """Decide and apply the model's kernels (see the module docstring). ``rollback``: the
    verify strategy exact rows use; ``rows``: the batch's height; ``ragged``: whether the
    batch speculates (its ragged verify must be invariant too); ``checked``: swap_kernels'."""
    choice = _choose(lm, mode, rollback=rollback, rows=rows, ragged=ragged, compile_decode=compile_decode,
                     group=group, checked=checked)
    if checked is not None and compile_decode and "invariant" in choice.probes:  # a swap re-traced the step
        choice.compile_check = getattr(checked, "verdict", None)
    return choice


def _choose(lm, mode: str, *, rollback: str, rows: int, ragged: bool, compile_decode: bool, group,
            checked) -> KernelChoice:
    verdicts = verdicts_for(lm, group)
    if mode == "mlx":
        return KernelChoice("mlx", "configured (kernels = \"mlx\")", verdicts)
    probes: dict = {}
    if mode == "auto":
        if invariant.backend() is None:
            return KernelChoice("mlx", "no custom-kernel backend here (CPU), where MLX's kernels are the "
                                       "reference; the exactness probes decide what exact rows get", verdicts)
        if group is not None:
            return KernelChoice("mlx", "a tensor-parallel group keeps MLX's kernels (not probed across ranks)",
                                verdicts)
        probes["mlx"] = _probe(lm, verdicts, rollback, rows, ragged)
        if all(probes["mlx"].values()):
            return KernelChoice("mlx", "MLX's kernels are invariant here (every probe passed)", verdicts, probes)
    swap_kernels(lm, True, rows, compile_decode, checked=checked)
    inv_verdicts = verdicts_for(lm, group)
    try:
        probes["invariant"] = _probe(lm, inv_verdicts, rollback, rows, ragged)
    except Exception as exc:  # noqa: BLE001 - a kernel that does not compile or run here is refused, not fatal
        swap_kernels(lm, False, rows, compile_decode, checked=checked)
        return KernelChoice("mlx", f"the invariant kernels raised {type(exc).__name__}: {str(exc)[:500]}: refused, "
                                   "MLX's kept (and the quantized layers not routed)", verdicts, probes)
    if all(probes["invariant"].values()):
        why = ("MLX's kernels failed " + ", ".join(k for k, v in probes["mlx"].items() if not v) + "; "
               if "mlx" in probes else "configured; ")
        return KernelChoice("invariant", why + "the invariant kernels passed every probe", inv_verdicts, probes)
    swap_kernels(lm, False, rows, compile_decode, route_quantized=True, checked=checked)
    failed = ", ".join(k for k, v in probes["invariant"].items() if not v)
    return _routed_choice(lm, group, f"the invariant kernels failed {failed}: refused, MLX's kept", verdicts, probes)


def _routed_choice(lm, group, reason: str, verdicts: ProbeVerdicts, probes: dict) -> KernelChoice:
    """The choice of MLX's kernels, said as "mlx+qmm" where swap_kernels routed the quantized
    layers (their verdicts are then their own: a new key in the verdicts cache)."""
    if lm.kernels != "mlx+qmm":
        return KernelChoice("mlx", reason, verdicts, probes)
    return KernelChoice("mlx+qmm", reason + "; the quantized layers take the tensor-core kernel where it is faster "
                                           "by row count", verdicts_for(lm, group), probes)


def log_choice(choice: KernelChoice, backend: str | None) -> None:
    log.info("engine.kernels", kernels=choice.kernels, backend=backend or "cpu", reason=choice.reason,
             probes=choice.probes, compile_check=choice.compile_check,
             dense_rows=dict(invariant.DENSE_ROWS) if choice.kernels == "invariant" and invariant.DENSE_ROWS else None)
