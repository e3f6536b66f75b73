"""A quantized matmul whose result for a row does not depend on who else is in the forward.

engine/kernels/invariant.py makes plain linears and attention batch-invariant; a quantized model's
linears (``nn.QuantizedLinear``, and a quantized tied head, ``nn.QuantizedEmbedding.as_linear``)
went through MLX's ``quantized_matmul``, whose kernels differ by batch height on GPUs, so the
start-up probes failed there and exact rows of a 4-bit model never batched.

``quantized_matmul`` computes y[m, n] = sum_k x[m, k] * w[n, k] for MLX's affine
quantization as ``nn.QuantizedLinear`` stores it: ``weight`` uint32 [N, K * bits / 32]
(element i of a word is bits [i * bits, (i + 1) * bits)), ``scales`` and ``biases``
[N, K / group_size], w[n, k] = q * scale + bias of k's group. One warp (one SIMD group on
Metal) per NCW output columns. Lane l owns the words l, l + 32, l + 64, ... of a weight row;
for each word it dequantizes its elements in float32 (``fma(q, scale, bias)``), then, for
every row of the current tile of MT rows, adds ``w * x`` to that row's float32 accumulator,
elements in order, words in order; a fixed butterfly of shuffles sums the 32 lanes. So the
order in which any (m, n) is summed is fixed by K (and bits) alone: it does not depend on M,
on which tile the row falls in, on NCW or on the block shape. Each weight word is read once
per tile of MT rows (M <= MT: once for the whole forward). All loads are of an array's own
element type (no vector loads), so any row-contiguous view MLX hands the kernel is aligned.

On the CPU (no custom-kernel backend) it computes with ``reference_quantized_matmul``:
the same arithmetic in plain MLX ops (dequantize to float32, then a float32 product summed
along K by MLX's reduction, one output element at a time, independent of M), which tests
and the device check compare against.

The CUDA kernel and its Metal twin are written side by side. They have not run on either
GPU from this project's machines until bench/quant_kernel_check.py runs there; the
start-up probes (exactness.py, batch.py) guard them as every other path: a layer whose
kernel gives other bits by batch height fails the probes and the daemon keeps MLX's.

``refusal`` names what the kernel cannot take (another mode than affine, bits other than
2/4/8, no biases, a layout whose shapes do not agree). The classes that route a model through
the kernel (``InvariantQuantizedLinear``, ``InvariantQuantizedEmbedding``) live in
engine/kernels/invariant.py beside the other invariant classes, whose row limit (MAX_ROWS), test hook
and backend they share; its ``install`` leaves a refused layer MLX's and reports the reason.
This module imports nothing of the engine.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from . import custom_kernel_cache, quant_mma

BITS = (2, 4, 8)  # power-of-two widths: a word holds 32 / bits whole elements
FLOAT_INPUTS = (mx.bfloat16, mx.float16, mx.float32)

# The launch shape: columns per warp, warps per block, rows per tile. None of them changes the
# order in which an output element is summed (see the module docstring), only the speed;
# bench/quant_kernel_check.py times the alternatives on the device.
COLS_PER_WARP = 4
WARPS_PER_BLOCK = 4
ROW_TILE = 8

_CUDA_QMM = """
    constexpr int EPW = 32 / BITS;
    constexpr unsigned MASK = (1u << BITS) - 1u;
    const int lane = threadIdx.x & 31;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int M = x_shape[0], K = x_shape[1], N = w_shape[0], KW = w_shape[1];
    const int G = scales_shape[1];
    const int n0 = warp * NCW;
    if (n0 >= N) return;                       // the whole warp leaves together
    int col[NCW];
    #pragma unroll
    for (int c = 0; c < NCW; ++c) col[c] = (n0 + c < N) ? n0 + c : n0;  // clamp: loads stay in bounds
    for (int m0 = 0; m0 < M; m0 += MT) {
        float acc[MT][NCW];
        #pragma unroll
        for (int r = 0; r < MT; ++r) {
            #pragma unroll
            for (int c = 0; c < NCW; ++c) acc[r][c] = 0.0f;
        }
        for (int j = lane; j < KW; j += 32) {
            const int k0 = j * EPW;
            const int g = k0 / GS;
            float wf[NCW][EPW];
            #pragma unroll
            for (int c = 0; c < NCW; ++c) {
                const unsigned q = w[(size_t)col[c] * KW + j];
                const float s = static_cast<float>(scales[(size_t)col[c] * G + g]);
                const float b = static_cast<float>(biases[(size_t)col[c] * G + g]);
                #pragma unroll
                for (int i = 0; i < EPW; ++i) wf[c][i] = fmaf(static_cast<float>((q >> (BITS * i)) & MASK), s, b);
            }
            #pragma unroll
            for (int r = 0; r < MT; ++r) {
                if (m0 + r < M) {
                    const T* xr = x + (size_t)(m0 + r) * K + k0;
                    float xv[EPW];
                    #pragma unroll
                    for (int i = 0; i < EPW; ++i) xv[i] = static_cast<float>(xr[i]);
                    #pragma unroll
                    for (int c = 0; c < NCW; ++c) {
                        float a = acc[r][c];
                        #pragma unroll
                        for (int i = 0; i < EPW; ++i) a = fmaf(wf[c][i], xv[i], a);
                        acc[r][c] = a;
                    }
                }
            }
        }
        #pragma unroll
        for (int r = 0; r < MT; ++r) {
            #pragma unroll
            for (int c = 0; c < NCW; ++c) {
                float s = acc[r][c];
                #pragma unroll
                for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffff, s, off);
                if (lane == 0 && m0 + r < M && n0 + c < N) y[(size_t)(m0 + r) * N + n0 + c] = static_cast<T>(s);
            }
        }
    }
"""

# The same kernel for Metal (32-wide SIMD groups; ``metal::fma`` is a fused multiply-add as
# ``fmaf`` is). Written and reviewed against the CUDA one; not yet run on Apple hardware.
_METAL_QMM = """
    constexpr int EPW = 32 / BITS;
    constexpr uint MASK = (1u << BITS) - 1u;
    const uint lane = thread_index_in_simdgroup;
    const int warp = int(thread_position_in_grid.x) >> 5;
    const int M = x_shape[0], K = x_shape[1], N = w_shape[0], KW = w_shape[1];
    const int G = scales_shape[1];
    const int n0 = warp * NCW;
    if (n0 >= N) return;
    int col[NCW];
    for (int c = 0; c < NCW; ++c) col[c] = (n0 + c < N) ? n0 + c : n0;
    for (int m0 = 0; m0 < M; m0 += MT) {
        float acc[MT][NCW];
        for (int r = 0; r < MT; ++r) {
            for (int c = 0; c < NCW; ++c) acc[r][c] = 0.0f;
        }
        for (int j = int(lane); j < KW; j += 32) {
            const int k0 = j * EPW;
            const int g = k0 / GS;
            float wf[NCW][EPW];
            for (int c = 0; c < NCW; ++c) {
                const uint q = w[size_t(col[c]) * KW + j];
                const float s = float(scales[size_t(col[c]) * G + g]);
                const float b = float(biases[size_t(col[c]) * G + g]);
                for (int i = 0; i < EPW; ++i) wf[c][i] = metal::fma(float((q >> (BITS * i)) & MASK), s, b);
            }
            for (int r = 0; r < MT; ++r) {
                if (m0 + r < M) {
                    const device T* xr = x + size_t(m0 + r) * K + k0;
                    float xv[EPW];
                    for (int i = 0; i < EPW; ++i) xv[i] = float(xr[i]);
                    for (int c = 0; c < NCW; ++c) {
                        float a = acc[r][c];
                        for (int i = 0; i < EPW; ++i) a = metal::fma(wf[c][i], xv[i], a);
                        acc[r][c] = a;
                    }
                }
            }
        }
        for (int r = 0; r < MT; ++r) {
            for (int c = 0; c < NCW; ++c) {
                float s = acc[r][c];
                for (ushort off = 16; off > 0; off >>= 1) s += simd_shuffle_xor(s, off);
                if (lane == 0 && m0 + r < M && n0 + c < N) y[size_t(m0 + r) * N + n0 + c] = T(s);
            }
        }
    }
"""

_kernels: dict[str, Any] = {}


def _get_kernel(backend: str):
    if backend not in _kernels:
        names = dict(name="councild_invariant_qmm", input_names=["x", "w", "scales", "biases"], output_names=["y"])
        if backend == "metal":
            _kernels[backend] = mx.fast.metal_kernel(source=_METAL_QMM, **names)
        else:
            _kernels[backend] = custom_kernel_cache.cuda_kernel(source=_CUDA_QMM, **names)
    return _kernels[backend]


def layout_refusal(w: mx.array, scales: mx.array, biases: mx.array | None, group_size: int, bits: int,
                   mode: str = "affine") -> str | None:
    """Why the kernel cannot take this quantized weight, or None when it can."""
    if mode != "affine":
        return f"quantization mode {mode!r}: the kernel takes affine groups only"
    if bits not in BITS:
        return f"{bits}-bit weights: the kernel takes {'/'.join(map(str, BITS))}-bit (whole elements per 32-bit word)"
    if biases is None:
        return "no biases: the kernel takes affine groups (scale and bias)"
    if w.dtype != mx.uint32 or w.ndim != 2:
        return f"weight {w.dtype} of {w.ndim} dimensions: the kernel takes a 2-D uint32 packing"
    N, KW = w.shape
    K = KW * 32 // bits
    if group_size <= 0 or group_size % (32 // bits) or K % group_size:
        return f"input dimension {K} and group size {group_size}: groups must divide K and hold whole words"
    if scales.shape != (N, K // group_size) or biases.shape != scales.shape:
        return (f"scales {tuple(scales.shape)} / biases {tuple(biases.shape)} do not fit weight {tuple(w.shape)} "
                f"at group size {group_size}")
    if scales.dtype not in FLOAT_INPUTS or biases.dtype not in FLOAT_INPUTS:
        return f"scales of {scales.dtype}: the kernel takes floating-point scales and biases"
    return None


def refusal(module: nn.Module) -> str | None:
    """Why ``module`` (an nn.QuantizedLinear or nn.QuantizedEmbedding) cannot run through the
    kernel, or None."""
    return layout_refusal(module["weight"], module["scales"], module.get("biases"), module.group_size, module.bits,
                          getattr(module, "mode", "affine"))


def reference_quantized_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
                               bits: int, chunk_bytes: int = 1 << 26) -> mx.array:
    """``quantized_matmul``'s arithmetic in plain MLX ops: the weight dequantized to
    float32, every output element a float32 sum over K of w * x, reduced along K one element
    at a time (MLX's reduction, whose order depends on K alone, not on how many rows there
    are). Output in x's dtype. Columns are done in chunks of at most ``chunk_bytes`` of
    products."""
    K = x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K).astype(mx.float32)
    wf = mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32), group_size=group_size, bits=bits)
    M, N = x2.shape[0], wf.shape[0]
    step = max(1, chunk_bytes // (4 * K * max(M, 1)))
    parts = [(x2[:, None, :] * wf[None, n:n + step]).sum(axis=-1) for n in range(0, N, step)]
    y = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)
    return y.astype(x.dtype).reshape(*lead, N)


# Which kernel a layer takes, by everything that decides it (its layout, the activations'
# dtype, the backend): the checks cost more host time than the launch in an eager decode step.
_routes: dict[tuple, str] = {}


def _route(backend: str, x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int,
           scalar: bool) -> str:
    """"mma" (engine/kernels/quant_mma.py: a property of the layer and the activations' dtype, never of
    M, so a layer sums in one order at every height), "scalar" (this module's kernel) or why
    neither can take the call."""
    key = (backend, w.shape, w.dtype, scales.shape, scales.dtype, None if biases is None else (biases.shape, biases.dtype),
           x.shape[-1], x.dtype, group_size, bits, scalar)
    got = _routes.get(key)
    if got is None:
        K = x.shape[-1]
        N, KW = w.shape if w.ndim == 2 else (0, 0)
        got = layout_refusal(w, scales, biases, group_size, bits)
        if got is None and K * bits != KW * 32:
            got = f"input dimension {K} does not match weight {tuple(w.shape)}"
        if got is None and x.dtype not in FLOAT_INPUTS:
            got = f"takes floating-point inputs, got {x.dtype}"
        if got is None:
            use_mma = backend == "cuda" and not scalar and quant_mma.mma_refusal(x.dtype, N, K, group_size, bits) is None
            got = "mma" if use_mma else "scalar"
        _routes[key] = got
    return got


def quantized_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int,
                     backend: str | None, *, cols_per_warp: int | None = None, warps_per_block: int | None = None,
                     row_tile: int | None = None, scalar: bool = False, mma: dict | None = None,
                     residual: mx.array | None = None) -> mx.array:
    """x [..., K] times the quantized w [N, K] transposed, each output summed in an order
    fixed by K alone (see the module docstring), on ``backend`` ("cuda" or "metal"; None, the
    CPU: ``reference_quantized_matmul``). The keyword arguments override the launch shape
    (for the device check's sweep). engine/kernels/invariant.py's ``invariant_quantized_matmul``
    calls it with the process's backend. On CUDA a layer engine/kernels/quant_mma.py takes runs on the
    tensor cores (``mma``: its launch overrides), unless ``scalar`` asks for this module's kernel.
    With ``residual``: ``residual + y``, added as the tensor-core kernel writes y where it can
    (``quant_mma.residual_refusal``), else apart: the same bits either way."""
    if backend is None:
        return _plus(residual, reference_quantized_matmul(x, w, scales, biases, group_size, bits))
    K = x.shape[-1]
    N = w.shape[0]
    route = _route(backend, x, w, scales, biases, group_size, bits, scalar)
    if route != "mma" and route != "scalar":
        raise ValueError(f"invariant quantized matmul: {route}")
    if route == "mma":  # takes x [..., K] as it is: no reshape nodes around the call
        if residual is not None and quant_mma.residual_refusal(x, N, residual) is None:
            return quant_mma.quantized_matmul_mma(x, w, scales, biases, group_size, bits, residual=residual,
                                                  **(mma or {}))
        return _plus(residual, quant_mma.quantized_matmul_mma(x, w, scales, biases, group_size, bits, **(mma or {})))
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    ncw = cols_per_warp or COLS_PER_WARP
    wpb = warps_per_block or WARPS_PER_BLOCK
    mt = row_tile or ROW_TILE
    warps = -(-N // ncw)
    (y,) = _get_kernel(backend)(
        inputs=[x2, w, scales, biases],
        template=[("T", x.dtype), ("BITS", bits), ("GS", group_size), ("NCW", ncw), ("MT", mt)],
        grid=(32 * warps, 1, 1),
        threadgroup=(32 * wpb, 1, 1),
        output_shapes=[(x2.shape[0], N)],
        output_dtypes=[x.dtype],
    )
    return _plus(residual, y.reshape(*lead, N))


def _plus(residual: mx.array | None, y: mx.array) -> mx.array:
    return y if residual is None else residual + y
