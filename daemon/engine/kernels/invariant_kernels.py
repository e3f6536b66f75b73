"""The fixed-order kernels of engine/kernels/invariant.py (its docstring says what they
promise and why): ``invariant_matmul`` and ``invariant_sdpa`` with their CUDA and Metal texts,
``reference_sdpa``, their arithmetic in plain ops, and on CUDA ``gemv_rows``, the dense rows
with MLX's own gemv's bits (the section at the end says why). A module of their own because they
import only mlx: the kernel prebuild's worker (prebuild_custom.py) compiles them without
invariant.py's mlx-lm import (seconds a process).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from . import custom_kernel_cache

# Keys are split into chunks of CHUNK *visible* keys (by their rank among the keys the query
# may see, not by their slot), so a query's chunks are the same whether its row is alone,
# padded, holed or one of many: one warp per (query, chunk) runs the online softmax over its
# chunk's keys in cache order, and a second kernel merges the chunks' partials in chunk
# order, skipping empty ones (a padded batch has more, all empty). Every step of that is the
# same arithmetic for the same query, whatever shares its forward.
CHUNK = 128

_CUDA_PARTIAL = """
    constexpr int DPL = D / 32;
    const int lane = threadIdx.x;
    const int Hq = q_shape[1], Tq = q_shape[2];
    const int Hk = k_shape[1], L = k_shape[2];
    const int NC = (L + CH - 1) / CH;
    const int qc = blockIdx.y;                  // query * NC + chunk
    const int row = qc / NC, c = qc % NC;        // row = (b * Hq + h) * Tq + t
    const int t = row % Tq, bh = row / Tq, h = bh % Hq, b = bh / Hq;
    const int hk = h / (Hq / Hk);
    const T* qp = q + (size_t)row * D + lane * DPL;
    const T* kp = k + (size_t)(b * Hk + hk) * L * D + lane * DPL;
    const T* vp = v + (size_t)(b * Hk + hk) * L * D + lane * DPL;
    const bool* ok = valid + ((size_t)b * Tq + t) * L;
    const int* rk = rank + ((size_t)b * Tq + t) * L;  // visible keys up to and including j
    const int lo = c * CH;
    int a0 = 0, a1 = L;                          // the first slot whose rank passes lo
    while (a0 < a1) { const int mid = (a0 + a1) >> 1; if (rk[mid] > lo) a1 = mid; else a0 = mid + 1; }
    const float sc = scale[0];
    float qr[DPL], acc[DPL];
    for (int i = 0; i < DPL; ++i) { qr[i] = static_cast<float>(qp[i]) * sc; acc[i] = 0.0f; }
    float m = __int_as_float(0xff800000), l = 0.0f;  // -inf
    for (int j = a0; j < L; ++j) {
        if (!ok[j]) continue;
        if (rk[j] > lo + CH) break;
        float s = 0.0f;
        for (int i = 0; i < DPL; ++i) s += qr[i] * static_cast<float>(kp[(size_t)j * D + i]);
        for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffff, s, off);
        const float mn = fmaxf(m, s);
        const float cr = expf(m - mn);
        const float p = expf(s - mn);
        l = l * cr + p;
        for (int i = 0; i < DPL; ++i) acc[i] = acc[i] * cr + p * static_cast<float>(vp[(size_t)j * D + i]);
        m = mn;
    }
    if (lane == 0) { part_m[qc] = m; part_l[qc] = l; }
    float* ap = part_acc + (size_t)qc * D + lane * DPL;
    for (int i = 0; i < DPL; ++i) ap[i] = acc[i];
"""

_CUDA_MERGE = """
    constexpr int DPL = D / 32;
    const int lane = threadIdx.x;
    const int row = blockIdx.y;
    const int NC = pl_shape[1];
    float m = __int_as_float(0xff800000), l = 0.0f, acc[DPL];
    for (int i = 0; i < DPL; ++i) acc[i] = 0.0f;
    for (int c = 0; c < NC; ++c) {
        const float lc = pl[(size_t)row * NC + c];
        if (lc == 0.0f) continue;               // an empty chunk: no arithmetic at all
        const float mc = pm[(size_t)row * NC + c];
        const float mn = fmaxf(m, mc);
        const float a = expf(m - mn), bb = expf(mc - mn);
        l = l * a + lc * bb;
        const float* ap = pa + ((size_t)row * NC + c) * D + lane * DPL;
        for (int i = 0; i < DPL; ++i) acc[i] = acc[i] * a + ap[i] * bb;
        m = mn;
    }
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    T* op = out + (size_t)row * D + lane * DPL;
    for (int i = 0; i < DPL; ++i) op[i] = static_cast<T>(acc[i] * inv);
"""

# The same kernels for Metal (Apple GPUs run 32-wide SIMD groups). Written and reviewed
# against the CUDA ones; they have not run on Metal hardware from this project's machines,
# so the start-up probe guards them like every other path.
_METAL_PARTIAL = """
    constexpr int DPL = D / 32;
    const uint lane = thread_index_in_simdgroup;
    const int Hq = q_shape[1], Tq = q_shape[2];
    const int Hk = k_shape[1], L = k_shape[2];
    const int NC = (L + CH - 1) / CH;
    const int qc = int(thread_position_in_grid.y);
    const int row = qc / NC, c = qc % NC;
    const int t = row % Tq, bh = row / Tq, h = bh % Hq, b = bh / Hq;
    const int hk = h / (Hq / Hk);
    const device T* qp = q + size_t(row) * D + lane * DPL;
    const device T* kp = k + size_t(b * Hk + hk) * L * D + lane * DPL;
    const device T* vp = v + size_t(b * Hk + hk) * L * D + lane * DPL;
    const device bool* ok = valid + (size_t(b) * Tq + t) * L;
    const device int* rk = rank + (size_t(b) * Tq + t) * L;
    const int lo = c * CH;
    int a0 = 0, a1 = L;
    while (a0 < a1) { const int mid = (a0 + a1) >> 1; if (rk[mid] > lo) a1 = mid; else a0 = mid + 1; }
    const float sc = scale[0];
    float qr[DPL], acc[DPL];
    for (int i = 0; i < DPL; ++i) { qr[i] = float(qp[i]) * sc; acc[i] = 0.0f; }
    float m = -INFINITY, l = 0.0f;
    for (int j = a0; j < L; ++j) {
        if (!ok[j]) continue;
        if (rk[j] > lo + CH) break;
        float s = 0.0f;
        for (int i = 0; i < DPL; ++i) s += qr[i] * float(kp[size_t(j) * D + i]);
        for (ushort off = 16; off > 0; off >>= 1) s += simd_shuffle_xor(s, off);
        const float mn = fmax(m, s);
        const float cr = metal::exp(m - mn);
        const float p = metal::exp(s - mn);
        l = l * cr + p;
        for (int i = 0; i < DPL; ++i) acc[i] = acc[i] * cr + p * float(vp[size_t(j) * D + i]);
        m = mn;
    }
    if (lane == 0) { part_m[qc] = m; part_l[qc] = l; }
    device float* ap = part_acc + size_t(qc) * D + lane * DPL;
    for (int i = 0; i < DPL; ++i) ap[i] = acc[i];
"""

_METAL_MERGE = """
    constexpr int DPL = D / 32;
    const uint lane = thread_index_in_simdgroup;
    const int row = int(thread_position_in_grid.y);
    const int NC = pl_shape[1];
    float m = -INFINITY, l = 0.0f, acc[DPL];
    for (int i = 0; i < DPL; ++i) acc[i] = 0.0f;
    for (int c = 0; c < NC; ++c) {
        const float lc = pl[size_t(row) * NC + c];
        if (lc == 0.0f) continue;
        const float mc = pm[size_t(row) * NC + c];
        const float mn = fmax(m, mc);
        const float a = metal::exp(m - mn), bb = metal::exp(mc - mn);
        l = l * a + lc * bb;
        const device float* ap = pa + (size_t(row) * NC + c) * D + lane * DPL;
        for (int i = 0; i < DPL; ++i) acc[i] = acc[i] * a + ap[i] * bb;
        m = mn;
    }
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    device T* op = out + size_t(row) * D + lane * DPL;
    for (int i = 0; i < DPL; ++i) op[i] = T(acc[i] * inv);
"""

# y[m, n] = sum_k x[m, k] * w[n, k] (nn.Linear's layout), one warp per output column n.
# Lane l owns k = 8l + 256c + i (a 16-byte load per lane per step); it accumulates its
# share for every row in the same order, then a fixed butterfly sums the 32 shares. The
# rows are walked in tiles of MT, each tile re-reading the weight row (from cache): the
# order in which any (m, n) is summed depends on K alone, never on how many rows came.
_CUDA_MATMUL = """
    constexpr int VEC = 8;
    const int lane = threadIdx.x & 31;
    const int n = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int M = x_shape[0], K = x_shape[1], N = w_shape[0];
    if (n >= N) return;
    const T* wr = w + (size_t)n * K;
    for (int m0 = 0; m0 < M; m0 += MT) {
        float acc[MT];
        for (int j = 0; j < MT; ++j) acc[j] = 0.0f;
        for (int k0 = lane * VEC; k0 < K; k0 += 32 * VEC) {
            float wv[VEC];
            for (int i = 0; i < VEC; ++i) wv[i] = static_cast<float>(wr[k0 + i]);
            for (int j = 0; j < MT; ++j) {
                if (m0 + j < M) {
                    const T* xr = x + (size_t)(m0 + j) * K + k0;
                    float s = acc[j];
                    for (int i = 0; i < VEC; ++i) s = fmaf(wv[i], static_cast<float>(xr[i]), s);
                    acc[j] = s;
                }
            }
        }
        for (int j = 0; j < MT; ++j) {
            float s = acc[j];
            for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffff, s, off);
            if (lane == 0 && m0 + j < M) y[(size_t)(m0 + j) * N + n] = static_cast<T>(s);
        }
    }
"""

_METAL_MATMUL = """
    constexpr int VEC = 8;
    const uint lane = thread_index_in_simdgroup;
    const int n = int(thread_position_in_grid.x) >> 5;
    const int M = x_shape[0], K = x_shape[1], N = w_shape[0];
    if (n >= N) return;
    const device T* wr = w + size_t(n) * K;
    for (int m0 = 0; m0 < M; m0 += MT) {
        float acc[MT];
        for (int j = 0; j < MT; ++j) acc[j] = 0.0f;
        for (int k0 = int(lane) * VEC; k0 < K; k0 += 32 * VEC) {
            float wv[VEC];
            for (int i = 0; i < VEC; ++i) wv[i] = float(wr[k0 + i]);
            for (int j = 0; j < MT; ++j) {
                if (m0 + j < M) {
                    const device T* xr = x + size_t(m0 + j) * K + k0;
                    float s = acc[j];
                    for (int i = 0; i < VEC; ++i) s = metal::fma(wv[i], float(xr[i]), s);
                    acc[j] = s;
                }
            }
        }
        for (int j = 0; j < MT; ++j) {
            float s = acc[j];
            for (ushort off = 16; off > 0; off >>= 1) s += simd_shuffle_xor(s, off);
            if (lane == 0 && m0 + j < M) y[size_t(m0 + j) * N + n] = T(s);
        }
    }
"""

MATMUL_TILE = 8

_kernel: Any = None
_matmul_kernel: Any = None
_backend: list = []


def backend() -> str | None:
    """The custom-kernel backend this process can run: "cuda", "metal" or None (CPU, where
    the invariant classes compute with ``reference_sdpa`` and a plain matmul: MLX's CPU
    kernels are invariant already, so that is only for tests and A/B runs)."""
    if not _backend:
        if mx.default_device() != mx.gpu:
            _backend.append(None)
        elif mx.metal.is_available():
            _backend.append("metal")
        else:
            _backend.append("cuda" if mx.cuda.is_available() else None)
    return _backend[0]


def _get_kernels():
    global _kernel
    if _kernel is None:
        part = dict(name="councild_invariant_sdpa_part", input_names=["q", "k", "v", "valid", "rank", "scale"],
                    output_names=["part_m", "part_l", "part_acc"])
        merge = dict(name="councild_invariant_sdpa_merge", input_names=["pm", "pl", "pa"], output_names=["out"])
        if backend() == "metal":
            _kernel = (mx.fast.metal_kernel(source=_METAL_PARTIAL, **part), mx.fast.metal_kernel(source=_METAL_MERGE, **merge))
        else:
            _kernel = (custom_kernel_cache.cuda_kernel(source=_CUDA_PARTIAL, **part), custom_kernel_cache.cuda_kernel(source=_CUDA_MERGE, **merge))
    return _kernel


def _get_matmul_kernel():
    global _matmul_kernel
    if _matmul_kernel is None:
        names = dict(input_names=["x", "w"], output_names=["y"])
        if backend() == "metal":
            _matmul_kernel = mx.fast.metal_kernel(name="councild_invariant_matmul", source=_METAL_MATMUL, **names)
        else:
            _matmul_kernel = custom_kernel_cache.cuda_kernel(name="councild_invariant_matmul", source=_CUDA_MATMUL, **names)
    return _matmul_kernel


def invariant_matmul(x: mx.array, w: mx.array) -> mx.array:
    """x [..., K] @ w[N, K].T with every output summed in an order fixed by K alone: on CUDA,
    for a weight ``verify_gemv_rows`` passed, MLX's gemv's order (one row on MLX's
    gemv itself, more on ``gemv_rows``), else this module's fixed-order kernel."""
    K = x.shape[-1]
    where = backend()
    if where is None:
        return x @ w.T
    if where == "cuda" and gemv_matched(w, x.dtype):
        # One row on MLX's own gemv (its launch costs the host less than a custom one), more on
        # the kernel that computes each row as that gemv does: the same bits either way.
        return x @ w.T if x.size == K else gemv_rows(x, w)
    if K % 8:
        raise ValueError(f"invariant matmul needs an input dimension divisible by 8, got {K}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    N = w.shape[0]
    (y,) = _get_matmul_kernel()(
        inputs=[x2, w],
        template=[("T", x.dtype), ("MT", MATMUL_TILE)],
        grid=(32 * N, 1, 1),
        threadgroup=(128, 1, 1),
        output_shapes=[(x2.shape[0], N)],
        output_dtypes=[x.dtype],
    )
    return y.reshape(*lead, N)


def visible_keys(mask: Any, B: int, T: int, L: int) -> mx.array:
    """mlx-lm's attention mask (None, "causal", or a boolean array broadcastable to
    [B, 1, T, L]) as a boolean [B, T, L]: which keys each query of each row may see.
    "causal" aligns the queries with the last T keys, as MLX's fused attention does."""
    if mask is None:
        return mx.ones((B, T, L), dtype=mx.bool_)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unsupported attention mask {mask!r}")
        q = mx.arange(L - T, L)[:, None]
        return mx.broadcast_to((mx.arange(L)[None, :] <= q)[None], (B, T, L))
    if mask.dtype != mx.bool_:
        raise ValueError(f"invariant attention takes boolean masks, got {mask.dtype}")
    if mask.ndim == 4:
        if mask.shape[1] != 1:
            raise ValueError("invariant attention takes masks shared by every head")
        mask = mask[:, 0]
    return mx.broadcast_to(mask, (B, T, L))


def invariant_sdpa(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any) -> mx.array:
    """Attention of queries [B, Hq, T, D] over keys/values [B, Hk, L, D] (Hq a multiple of
    Hk, D a multiple of 32), every query reduced over its visible keys in fixed chunks and a
    fixed order (see CHUNK)."""
    if backend() is None:
        return reference_sdpa(queries, keys, values, scale, mask)
    B, Hq, T, D = queries.shape
    L = keys.shape[2]
    if D % 32:
        raise ValueError(f"invariant attention needs a head dimension divisible by 32, got {D}")
    valid = visible_keys(mask, B, T, L)
    rank = mx.cumsum(valid.astype(mx.int32), axis=-1)  # visible keys up to each slot
    scale_arr = mx.array([scale], dtype=mx.float32)
    NQ, NC = B * Hq * T, -(-L // CHUNK)
    partial, merge = _get_kernels()
    pm, pl, pa = partial(
        inputs=[queries, keys, values, valid, rank, scale_arr],
        template=[("T", queries.dtype), ("D", D), ("CH", CHUNK)],
        grid=(32, NQ * NC, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(NQ, NC), (NQ, NC), (NQ, NC, D)],
        output_dtypes=[mx.float32, mx.float32, mx.float32],
    )
    (out,) = merge(
        inputs=[pm, pl, pa],
        template=[("T", queries.dtype), ("D", D)],
        grid=(32, NQ, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[queries.shape],
        output_dtypes=[queries.dtype],
    )
    return out


def reference_sdpa(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any) -> mx.array:
    """``invariant_sdpa``'s arithmetic in plain MLX ops (float32 softmax over the visible
    keys), for tests and for backends without the kernel. Not itself invariant on GPUs."""
    B, Hq, T, D = queries.shape
    Hk, L = keys.shape[1], keys.shape[2]
    valid = visible_keys(mask, B, T, L)[:, None]  # [B, 1, T, L]
    k = mx.repeat(keys, Hq // Hk, axis=1).astype(mx.float32)
    v = mx.repeat(values, Hq // Hk, axis=1).astype(mx.float32)
    s = (queries.astype(mx.float32) * scale) @ k.swapaxes(-1, -2)
    s = mx.where(valid, s, -mx.inf)
    p = mx.softmax(s, axis=-1)
    return (p @ v).astype(queries.dtype)


# ---- Dense rows with MLX's gemv's bits (CUDA) ----
#
# A dense matmul of M rows on CUDA whose every row has the bits MLX's own one-row gemv gives it.
#
# Why: exact rows must not change bits with the rows beside them, so the invariant set
# (engine/kernels/invariant.py) put every decode-sized dense matmul, one row included, on a
# fixed-order kernel of its own, whose one-row launch costs the host more than MLX's gemv
# (H100, bundled model's projections: 5.8-11.7 us against 4.4-4.9 on two machines; MLX's
# matmul from two rows on goes to cuBLASLt at 14-18 us: bench/results/h100_2026-12-07f).
# This kernel does for M rows exactly what MLX's CUDA gemv (``mlx/backend/cuda/gemms/gemv.cu``,
# ``gemv_impl``) does for one: one warp per output column;
# lane l sums, in float, ``w[n, c + j] * x[c + j]`` for c = NPT * l, NPT * l + 32 * NPT, ... and
# j = 0..NPT-1 in that order (``sum += a * b``, contracted to an FMA by the compiler as MLX's
# is), then ``cooperative_groups::reduce`` over the warp with ``plus<float>``, rounded once to
# the output type. NPT is MLX's choice: 4 where K % 128 == 0 and both the weight and the
# activations are 4-element aligned, 2 where K % 64 == 0 and 2-element aligned, else 1. Each
# weight vector is loaded once for a tile of MT rows, each row keeping its own sum.
#
# So one row alone can stay on MLX's gemv (its cheaper launch) and two or more rows take this
# kernel, with the same bits either way: the invariant set keeps its promise at gemv's cost.
# That rests on MLX's gemv being what this section mirrors (MLX 0.32: gemv.cu unchanged since
# 2026-08-06), so nothing trusts it unchecked: ``verify_gemv_rows`` compares, on the device,
# each row of this kernel against MLX's matmul of that row alone for a layer's own weight, bit
# for bit, and only shapes that pass (``gemv_matched``) are routed here; any other takes the
# fixed-order kernel as before, and the start-up exactness probes check the whole forward
# either way.
# CUDA only: Metal's gemv is another kernel (the fixed-order one serves there).

GEMV_ROWS_TILE = 8  # rows whose sums a warp carries through one pass over the weight row
GEMV_WARPS = 8  # MLX's gemv: rows_per_block = 8 warps of 32

_CUDA_GEMV_ROWS_HEADER = """
#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>
namespace gemv_rows_cg = cooperative_groups;

template <typename T, int NPT>
struct alignas(sizeof(T) * NPT) gemv_rows_vec { T v[NPT]; };  // MLX's AlignedVector

// MLX's gemv_impl for one weight row n, MT activation rows at a time: the same loads, the
// same per-lane order of fused multiply-adds, the same warp reduction, per row.
template <typename T, int NPT, int MT>
__device__ __forceinline__ void gemv_rows_impl(const T* x, const T* w, T* y, int M, int K, int N, int n,
                                               const gemv_rows_cg::thread_block_tile<32>& warp) {
    typedef gemv_rows_vec<T, NPT> V;
    const T* wr = w + (size_t)n * K;
    for (int m0 = 0; m0 < M; m0 += MT) {
        float sum[MT];
#pragma unroll
        for (int r = 0; r < MT; ++r) sum[r] = 0.0f;
        for (int col = NPT * warp.thread_rank(); col < K; col += 32 * NPT) {
            const V wv = *reinterpret_cast<const V*>(wr + col);
#pragma unroll
            for (int r = 0; r < MT; ++r) {
                if (m0 + r < M) {
                    const V xv = *reinterpret_cast<const V*>(x + (size_t)(m0 + r) * K + col);
#pragma unroll
                    for (int j = 0; j < NPT; ++j) {
                        sum[r] += static_cast<float>(wv.v[j]) * static_cast<float>(xv.v[j]);
                    }
                }
            }
        }
#pragma unroll
        for (int r = 0; r < MT; ++r) {
            const float s = gemv_rows_cg::reduce(warp, sum[r], gemv_rows_cg::plus<float>());
            if (warp.thread_rank() == 0 && m0 + r < M) y[(size_t)(m0 + r) * N + n] = static_cast<T>(s);
        }
    }
}
"""

_CUDA_GEMV_ROWS = """
    auto block = gemv_rows_cg::this_thread_block();
    auto warp = gemv_rows_cg::tiled_partition<32>(block);
    const int M = x_shape[0], K = x_shape[1], N = w_shape[0];
    const int n = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
    if (n >= N) return;
    const size_t wa = reinterpret_cast<size_t>(w), xa = reinterpret_cast<size_t>(x);
    if (K % 128 == 0 && wa % (4 * sizeof(T)) == 0 && xa % (4 * sizeof(T)) == 0) {
        gemv_rows_impl<T, 4, MT>(x, w, y, M, K, N, n, warp);
    } else if (K % 64 == 0 && wa % (2 * sizeof(T)) == 0 && xa % (2 * sizeof(T)) == 0) {
        gemv_rows_impl<T, 2, MT>(x, w, y, M, K, N, n, warp);
    } else {
        gemv_rows_impl<T, 1, MT>(x, w, y, M, K, N, n, warp);
    }
"""

_gemv_rows_kernel: Any = None

# (N, K, dtype name) of weights ``verify_gemv_rows`` found this kernel matching MLX's gemv for, row by row.
GEMV_MATCHED: set[tuple[int, int, str]] = set()
# The same for shapes that did not match, with what differed (for the log and status).
GEMV_MISMATCHED: dict[tuple[int, int, str], str] = {}


def _get_gemv_rows_kernel():
    global _gemv_rows_kernel
    if _gemv_rows_kernel is None:
        _gemv_rows_kernel = custom_kernel_cache.cuda_kernel(
            name="councild_gemv_rows", input_names=["x", "w"], output_names=["y"], source=_CUDA_GEMV_ROWS,
            header=_CUDA_GEMV_ROWS_HEADER)
    return _gemv_rows_kernel


def gemv_rows(x: mx.array, w: mx.array) -> mx.array:
    """x [..., K] @ w[N, K].T on this kernel (CUDA): each row as MLX's gemv computes it alone."""
    K = x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    N = w.shape[0]
    blocks = (N + GEMV_WARPS - 1) // GEMV_WARPS
    (y,) = _get_gemv_rows_kernel()(
        inputs=[x2, w],
        template=[("T", x.dtype), ("MT", GEMV_ROWS_TILE)],
        grid=(32 * GEMV_WARPS * blocks, 1, 1),
        threadgroup=(32 * GEMV_WARPS, 1, 1),
        output_shapes=[(x2.shape[0], N)],
        output_dtypes=[x.dtype],
    )
    return y.reshape(*lead, N)


def gemv_key(w: mx.array) -> tuple[int, int, str]:
    return (w.shape[0], w.shape[1], str(w.dtype).rsplit(".", 1)[-1])


def gemv_matched(w: mx.array, dtype) -> bool:
    """Whether rows of ``dtype`` against ``w`` may take this kernel (``verify_gemv_rows`` passed for it)."""
    return dtype == w.dtype and gemv_key(w) in GEMV_MATCHED


# Row counts the check runs: two, a full tile, a tile and one more (a second pass), a verify's.
GEMV_CHECK_ROWS = (2, GEMV_ROWS_TILE, GEMV_ROWS_TILE + 1, 36)


def verify_gemv_rows(weights: list[mx.array], seed: int = 0) -> dict[tuple[int, int, str], str | None]:
    """For each distinct (N, K, dtype) among ``weights`` not yet decided: rows of random
    activations through this kernel against each row alone through MLX's matmul (its gemv),
    bit for bit, at every count of GEMV_CHECK_ROWS; records the answer in GEMV_MATCHED or
    GEMV_MISMATCHED. Returns {shape: None where it matched, else what differed}. Must not run inside a
    compiled trace (it evaluates); raises what the kernel raises (a compile error)."""
    out: dict[tuple[int, int, str], str | None] = {}
    key_ = mx.random.key(seed)
    for w in weights:
        bits = mx.uint32 if w.dtype == mx.float32 else mx.uint16  # the outputs' bits, compared as integers
        k = gemv_key(w)
        if k in GEMV_MATCHED or k in GEMV_MISMATCHED or k in out:
            continue
        why = None
        for m in GEMV_CHECK_ROWS:
            key_, sub = mx.random.split(key_)
            x = mx.random.normal((m, w.shape[1]), key=sub).astype(w.dtype)
            rows = gemv_rows(x, w)
            alone = mx.concatenate([x[i : i + 1] @ w.T for i in range(m)], axis=0)
            differ = mx.sum(rows.view(bits) != alone.view(bits)).item()
            if differ:
                why = f"{differ} of {m * w.shape[0]} outputs differ from MLX's gemv at {m} rows"
                break
        out[k] = why
        if why is None:
            GEMV_MATCHED.add(k)
        else:
            GEMV_MISMATCHED[k] = why
    return out
