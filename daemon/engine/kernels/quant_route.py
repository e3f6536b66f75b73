"""Quantized layers on the faster of two kernels, where exactness does not decide the kernel.

When the invariant kernel set is not installed (MLX's kernels serve, and exact rows decode
alone), a quantized layer is still free to take whichever kernel is faster for the rows in
front of it. On the H200 MLX's ``quantized_matmul`` is linear in rows up to 7 (a 5120 -> 17408
4-bit layer: 76 us at 1 row, 218 us at 4), while engine/kernels/quant_mma.py's tensor-core kernel is
flat from 1 to 8 rows (60 and 58 us) and loses from 16 rows on, where MLX switches to its own
tensor-core kernel. ``MEASURED_FASTER`` is that measurement (bench/results/qmm_h200_2026-12-03:
the row counts at which the kernel beat MLX's, per layer shape and bits; re-measured for
the daemon's merged shapes on 2026-12-06); ``use_mma`` reads it,
and ``install`` swaps a model's quantized layers to classes that ask it on every call.

The choice depends on the row count, so a row's bits may differ with the rows beside it: this
is for speed only. Exact rows get the invariant set (engine/kernels/invariant.py), which puts every
row count on the one kernel, or decode alone.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn

from . import invariant, invariant_quant, quant_mma

# (N, K, bits) -> the row counts (of 1, 2, 4, 8, 16, 32) at which the tensor-core kernel was
# faster than mx.quantized_matmul on the H200 (MLX 0.32.4, group 64, bf16). Shapes re-measured
# on 2026-12-06 with the kernel of 36102d0 (the later instruction cut kept it ahead of MLX's at
# every count listed: bench/results/h100_2026-12-06e) (ncu device time at 1, 4 and 16 rows; 2 and 8 read from
# their neighbours: MLX's small-row kernel is linear in rows up to 7 and serves 8 as it serves
# 16, the kernel's time grows with rows; bench/results/h200_2026-12-06d calls 4 and 7): 4-bit at
# every measured count, 8-bit from 2 rows (MLX's one-row 8-bit kernel is the faster, and its
# tensor-core kernel the faster on the merged gate/up at 16). The rest as measured on
# 2026-12-03 (bench/results/qmm_h200_2026-12-03), before the kernel's shared-memory feed.
MEASURED_FASTER: dict[tuple[int, int, int], tuple[int, ...]] = {
    (34816, 5120, 4): (1, 2, 4, 8, 16), (5120, 17408, 4): (1, 2, 4, 8, 16), (16480, 5120, 4): (1, 2, 4, 8, 16),
    (5120, 6144, 4): (1, 2, 4, 8, 16), (14336, 5120, 4): (1, 2, 4, 8, 16), (248320, 5120, 4): (1, 2, 4, 8, 16),
    (34816, 5120, 8): (2, 4), (5120, 17408, 8): (2, 4, 8, 16), (16480, 5120, 8): (2, 4, 8, 16),
    (5120, 6144, 8): (2, 4, 8, 16), (14336, 5120, 8): (2, 4, 8, 16),
    # 2026-12-03
    (17408, 5120, 4): (1, 2, 4, 8), (12288, 5120, 4): (1, 2, 4), (1024, 5120, 4): (4,), (10240, 5120, 4): (1, 2, 4),
    (6144, 5120, 4): (2, 4), (48, 5120, 4): (8,),
    (17408, 5120, 8): (2, 4), (12288, 5120, 8): (2, 4), (1024, 5120, 8): (), (10240, 5120, 8): (4,),
    (6144, 5120, 8): (2, 4), (48, 5120, 8): (), (248320, 5120, 8): (2, 4),
}
MEASURED_ROWS = (1, 2, 4, 8, 16, 32)


def _bucket(rows: int) -> int:
    """The measured row count that stands for ``rows``: MLX's small-row kernel serves 1..7 rows
    and its tensor-core kernel 8 and more, so 5..7 read as 4 (same MLX kernel, still linear) and
    anything else as the next measured count up."""
    if 5 <= rows <= 7:
        return 4
    return next((m for m in MEASURED_ROWS if rows <= m), 0)


@lru_cache(maxsize=4096)
def use_mma(N: int, K: int, bits: int, rows: int) -> bool:
    """Whether the tensor-core kernel is the faster for ``rows`` rows of this layer: the
    measured table, or for a shape it does not list, the listed shape of the same bits whose
    weight is nearest in size (rows past the largest measured count: MLX's)."""
    b = _bucket(rows)
    if not b:
        return False
    faster = MEASURED_FASTER.get((N, K, bits))
    if faster is None:
        same = [key for key in MEASURED_FASTER if key[2] == bits]
        if not same:
            return False
        faster = MEASURED_FASTER[min(same, key=lambda key: abs(key[0] * key[1] - N * K))]
    return b in faster


def _rows(x: mx.array) -> int:
    r = 1
    for d in x.shape[:-1]:
        r *= d
    return r


def _routed(module, x: mx.array) -> bool:
    N = module["weight"].shape[0]
    return (invariant.backend() == "cuda" and x.dtype in quant_mma.MMA_INPUTS and use_mma(N, x.shape[-1], module.bits, _rows(x))
            and quant_mma.mma_refusal(x.dtype, N, x.shape[-1], module.group_size, module.bits) is None)


def _mma(module, x: mx.array, residual: mx.array | None = None) -> mx.array:
    return invariant_quant.quantized_matmul(x, module["weight"], module["scales"], module["biases"],
                                            module.group_size, module.bits, "cuda", residual=residual)


class RoutedQuantizedLinear(nn.QuantizedLinear):
    """nn.QuantizedLinear on the tensor-core kernel for the row counts where it is the faster."""

    def __call__(self, x: mx.array) -> mx.array:
        if not _routed(self, x):
            return super().__call__(x)
        y = _mma(self, x)
        return y + self["bias"] if "bias" in self else y

    def plus(self, x: mx.array, residual: mx.array) -> mx.array:
        """``residual + self(x)`` (forward.with_residual), the add in the kernel's writes where it
        can take it: the same bits."""
        if not _routed(self, x) or "bias" in self:
            return residual + self(x)
        return _mma(self, x, residual)


class RoutedQuantizedEmbedding(nn.QuantizedEmbedding):
    """A quantized tied output head (``as_linear``) routed as RoutedQuantizedLinear."""

    def as_linear(self, x: mx.array) -> mx.array:
        return _mma(self, x) if _routed(self, x) else super().as_linear(x)


_SWAPS = {nn.QuantizedLinear: RoutedQuantizedLinear, nn.QuantizedEmbedding: RoutedQuantizedEmbedding}
_BACK = {v: k for k, v in _SWAPS.items()}


def install(text_module) -> int:
    """Swap ``text_module``'s quantized layers that the tensor-core kernel takes (its layout
    checks; the activations' dtype is asked per call) to the routed classes, in place; returns
    how many. Only on CUDA is the kernel there to route to: the caller asks."""
    n = 0
    for _, m in text_module.named_modules():
        cls = _SWAPS.get(type(m))
        if cls is None or "biases" not in m or invariant_quant.refusal(m) is not None:
            continue
        if quant_mma.mma_refusal(mx.bfloat16, m["weight"].shape[0], m["weight"].shape[1] * 32 // m.bits,
                                 m.group_size, m.bits) is not None:
            continue
        m.__class__ = cls
        n += 1
    return n


def uninstall(text_module) -> None:
    invariant.restore_classes(text_module, _BACK)


def installed(text_module) -> bool:
    return invariant.holds_classes(text_module, _BACK)
