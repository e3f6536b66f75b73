"""The kernel prebuild's worker for the daemon's own CUDA kernels: ``custom ...`` recipes
(prebuild_recipes.custom_recipes says which a model meets). Calling a kernel writes its module
(engine/kernels/custom_kernel_cache.py) into the worker's folder; prebuild.py moves it into the daemon's.
A module of its own because it imports the kernels' modules: the CLI that lists the
recipes does not. Those import only mlx (invariant.py's mlx-lm import took the first version
of these workers to 20 s each among 15 on an H100; bench/results/h100_2026-12-06h).

    python -m daemon.engine.jit.prebuild_custom "custom invariant_sdpa bfloat16 64" bfloat16
"""

from __future__ import annotations

import sys

import mlx.core as mx

from ..kernels import gdn_fused, invariant_kernels


def run(recipe: str) -> None:
    kind, *args = recipe.split()
    if kind != "custom":
        raise ValueError(f"not a custom-kernel recipe: {recipe!r}")
    mx.eval(_custom(args))


def _custom(args: list[str]) -> list[mx.array]:
    """Call one of the daemon's kernels on arrays of one row: the call writes its module
    (engine/kernels/custom_kernel_cache.py), the evaluation loads it."""
    which, F = args[0], getattr(mx, args[1] if args[0] != "gdn_conv" else args[2])
    if which == "invariant_matmul":
        return [invariant_kernels.invariant_matmul(mx.ones((1, 8), dtype=F), mx.ones((16, 8), dtype=F))]
    if which == "gemv_rows":  # CUDA's only (it mirrors MLX's CUDA gemv): elsewhere none to keep
        if invariant_kernels.backend() != "cuda":
            return []
        return [invariant_kernels.gemv_rows(mx.ones((2, 128), dtype=F), mx.ones((16, 128), dtype=F))]
    if which == "invariant_sdpa":
        D = int(args[2])
        q, kv = mx.ones((1, 1, 1, D), dtype=F), mx.ones((1, 1, 2, D), dtype=F)
        return [invariant_kernels.invariant_sdpa(q, kv, kv, 1.0, "causal")]
    if gdn_fused.backend_refusal():  # not CUDA: the daemon runs mlx-lm's ops, no kernel to keep
        return []
    variant, (A, D, W), (Dk, Dv, Hk, Hv, KC) = args[1], [getattr(mx, a) for a in args[3:6]], [int(a) for a in args[6:]]
    C, T = 2 * Hk * Dk + Hv * Dv, 2
    mask = mx.ones((1, T), dtype=mx.bool_) if variant == "mask" else None
    return list(gdn_fused.gated_delta_conv_fused(
        mx.ones((1, T, C), dtype=F), mx.zeros((1, KC - 1, C), dtype=F), mx.ones((C, KC, 1), dtype=W),
        mx.ones((1, T, Hv), dtype=F), mx.ones((1, T, Hv), dtype=F), mx.zeros((Hv,), dtype=A), mx.zeros((Hv,), dtype=D),
        None, mask, heads=(Hk, Dk, Hv, Dv), all_states=variant == "all"))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(f"usage: python -m {__spec__.name} RECIPE FLOAT_DTYPE")
    run(sys.argv[1])
