"""A small-M quantized matmul on CUDA's tensor cores, near the weight-read bound, in a fixed order.

A decode step of a large quantized model is bound by reading its weights: carrying 1 or 32
positions through the same weights should cost about the same. MLX's ``quantized_matmul`` on
the H200 does not (a 5120 -> 17408 4-bit layer: 66 us at M = 1, 211 us at M = 4, a quarter of
the weight-read bound at M = 1), nor did engine/kernels/invariant_quant.py's scalar fixed-order kernel
(its float32 FMAs grow with M: 617 us at M = 32). This kernel streams each weight byte once for
all rows and does the products on the tensor cores (``mma.sync m16n8k16``, bf16 or fp16
operands, float32 accumulators), so rows cost almost nothing until the tensor cores fill.

Layout, for MLX's affine groups as ``nn.QuantizedLinear`` stores them (``weight`` uint32
[N, K * bits / 32], ``scales`` and ``biases`` [N, K / group_size]):
- a warp owns 16 output columns (the MMA's 16 "rows" are weight rows); a block of S warps
  shares those 16 columns and splits K: warp w takes the chunks w, w + S, w + 2S, ... of CK
  inputs (CK = 128 at 4 bits, 64 at 8), each lane 16 bytes of each of two weight rows per
  chunk (one 16-byte load each), so a block reads S * 64 contiguous bytes of a weight row;
- the activations are the MMA's B operand: x rows in tiles of 8 (the MMA's n), MT tiles per
  pass over the weights (M <= 8 * MT: one pass); a warp may own NA column tiles (16 * NA
  columns), so each activation fragment it loads feeds NA tiles' products;
- 4-bit weights are dequantized in pairs with bf16x2 / f16x2 arithmetic (the exponent trick:
  a nibble OR'd into 128.0's bits is 128 + q exactly; minus 128, then one fused q * s + b),
  8-bit in float32 (a byte OR'd into 2^23's bits), then rounded once to the operand type;
- the partial sums of the S warps are added in warp order through shared memory;
- the weights reach a warp one of two ways (``P``, speed only: both feed the same ``qmm_chunk``):
  loaded into registers U chunks at a time, or (P > 0) copied by ``cp.async`` into a ring of P
  chunks in shared memory that stays P chunks ahead of the products, so a warp always has loads
  in flight while it computes (its lanes copy exactly what they later read: no barrier); at one
  row tile that feed also loads the next chunk's activations while a chunk computes (``XPRE``),
  and where one scale and bias pair a row serves a whole chunk a warp copies its 16 rows' pairs
  once, a piece a lane, for all its lanes to read (``SBW``; a warp barrier around each slot);

The order in which an output element is summed is fixed by K (and bits and S) alone: each MMA
sums a fixed set of 16 inputs (the k order inside a chunk is a fixed permutation that matches
the pairs the dequantization produces, the same for weights and activations), the chunks of a
warp in increasing order, the warps in order. A row's place in its tile of 8 and the other
rows beside it change nothing (a tensor-core MMA computes each output element from its own
row and column), and neither do MT, the unroll U or how many passes M needs: they only change
the speed. So a row gets the same bits at M = 1 as in a batch of 32 or a 9-position verify:
exact rows batch and speculate. S is looked up per (N, K, bits) (``split_for``), never per M.

What it takes (``mma_refusal``): bf16 or fp16 activations, 4- or 8-bit affine weights with
biases, N a multiple of 16, K a multiple of CK, a group size that is a multiple of the 32 (4-bit)
or 16 (8-bit) inputs a lane holds. Anything else goes to engine/kernels/invariant_quant.py's scalar
kernel, decided per layer (never per M). Pointers that are not 16-byte aligned take a slower
load of four words (checked once per launch). CUDA only: Metal keeps the scalar kernel (MLX's
own Metal qmv already reads a 2-position verify at ~1.14x a step).
Of the engine this module imports only the custom kernels' disk cache.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import mlx.core as mx

from . import custom_kernel_cache

MMA_BITS = (4, 8)
MMA_INPUTS = (mx.bfloat16, mx.float16)
MAX_TILES = 8  # row tiles of 8 per pass over the weights: M <= 64 in one pass

_HEADER = """
struct qmm_u4 { unsigned x, y, z, w; };

__device__ __forceinline__ qmm_u4 qmm_load16(const void* p, bool aligned) {
    qmm_u4 r;
    if (aligned) {
        const uint4 v = *reinterpret_cast<const uint4*>(p);
        r.x = v.x; r.y = v.y; r.z = v.z; r.w = v.w;
    } else {
        const unsigned short* h = reinterpret_cast<const unsigned short*>(p);
        r.x = h[0] | (unsigned(h[1]) << 16); r.y = h[2] | (unsigned(h[3]) << 16);
        r.z = h[4] | (unsigned(h[5]) << 16); r.w = h[6] | (unsigned(h[7]) << 16);
    }
    return r;
}

// Two floats to one register of two 16-bit operands: lo in bits 0-15, hi in 16-31.
template <bool BF> __device__ __forceinline__ unsigned qmm_pack(float lo, float hi) {
    unsigned d;
    if (BF) asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    else asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

template <bool BF> __device__ __forceinline__ unsigned qmm_fma2(unsigned a, unsigned b, unsigned c) {
    unsigned d;
    if (BF) asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    else asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

template <bool BF> __device__ __forceinline__ void qmm_mma(float* c, unsigned a0, unsigned a1, unsigned a2,
                                                          unsigned a3, unsigned b0, unsigned b1) {
    if (BF) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    } else {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
}

// 4-bit: nibble pair (j, j + 4) of a word as two operands, q * s + b rounded once.
// OR'd into the exponent of 128.0 (bf16 0x4300) or 1024.0 (f16 0x6400), a nibble is
// 128 + q (1024 + q) exactly; one fma takes the offset off exactly, one applies s and b.
// The mask and the OR are one lop3 with both constants in registers (ptxas takes one immediate
// a lop3, so written in C it splits them into two): the same bits, a third fewer integer
// instructions in a chunk, whose integer pipe bounds the kernel at one row (a 4-bit chunk was
// ~315 instructions a lane on sm_90, ~150 of them integer, half-rate).
template <bool BF> __device__ __forceinline__ unsigned qmm_nibbles(unsigned q, int j, unsigned s2, unsigned b2,
                                                                  unsigned mask, unsigned magic) {
    const unsigned one = BF ? 0x3F803F80u : 0x3C003C00u;
    const unsigned neg = BF ? 0xC300C300u : 0xE400E400u;  // -128 / -1024
    unsigned v;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(v) : "r"(q >> (4 * j)), "r"(mask), "r"(magic));  // (a & b) | c
    return qmm_fma2<BF>(qmm_fma2<BF>(v, one, neg), s2, b2);
}

// 8-bit: byte j of a word in float32 (put under 2^23's top byte, minus 2^23: exact), q * s + b.
// One byte permute builds 2^23 + q's bits from q and ``magic`` (0x4B000000 in a register):
// a shift and two logic instructions before, the same bits.
__device__ __forceinline__ float qmm_byte(unsigned q, int j, float s, float b, unsigned magic) {
    const float v = __uint_as_float(__byte_perm(q, magic, 0x7650u | j)) - 8388608.0f;
    return fmaf(v, s, b);
}

// Copies of 16 bytes (weights: L1 bypassed, each byte is read once) and 4 bytes (a pair of
// scales or biases: L1 kept, a group's pair serves the next chunks) from global to shared
// memory that run while the warp computes; a group of them is committed per chunk and
// waited for P - 1 chunks later (sm_80 and newer).
__device__ __forceinline__ unsigned qmm_smem(const void* p) {  // a shared-memory address (PTX only: no builtin)
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
// dst: a shared-memory address (qmm_smem's), worked out once a warp rather than once a copy
__device__ __forceinline__ void qmm_cp16(unsigned dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void qmm_cp4(unsigned dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" :: "r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void qmm_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void qmm_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }

// One chunk's products for a warp: its lane holds KT inputs of weight rows g and g + 8 of each
// of its NA column tiles (wa, wb) with their group's scale and bias, and multiplies them by the
// same KT inputs of every x row of the MT row tiles, into acc. The one place the arithmetic is
// written: both ways of feeding the weights (registers, shared memory) call it, so they sum the
// same products in the same order.
// 4-bit: the scales and biases come as pairs of the same 16-bit value (s, s), which the
// shared-memory feed builds from its copied bits with one byte permute and the register feed
// by a round trip through float32 (exact: the same bits).
// PX (the shared-memory feed at PREFETCH_TILES row tiles): the activations come in ``xw``, loaded
// while the chunk before computed, and each word's slot is refilled with the next chunk's (``kn``,
// -1: none) as soon as it is read. Without it a warp waited on its activations' loads every chunk
// (on an H100 ~36% of its cycles between instructions were L1TEX waits; the prefetch gave 2-7% at
// one row, so most of those waits were not the activations'). The same values reach the same
// products: speed only.
template <bool BF, int NA, int MT, bool PX = false, typename XT>
__device__ __forceinline__ void qmm_chunk4(float (&acc)[NA][MT][4], const qmm_u4 (&wa)[NA], const qmm_u4 (&wb)[NA],
                                           const unsigned (&sa2)[NA], const unsigned (&ba2)[NA],
                                           const unsigned (&sb2)[NA], const unsigned (&bb2)[NA], const XT* x, int M,
                                           int K, int m0, int kl, int g, bool aligned, qmm_u4 (*xw)[4] = nullptr,
                                           int kn = -1) {
    unsigned mask = 0x000F000Fu, magic = BF ? 0x43004300u : 0x64006400u;
    // opaque to the compiler, so both stay in registers for the lop3 (not folded into immediates)
    asm("mov.b32 %0, %0;" : "+r"(mask));
    asm("mov.b32 %0, %0;" : "+r"(magic));
    #pragma unroll
    for (int i = 0; i < 4; ++i) {     // word i: inputs kl + 8i .. kl + 8i + 7
        // the activations, loaded once for the NA column tiles: x rows of tile j
        unsigned B[MT][4];
        #pragma unroll
        for (int j = 0; j < MT; ++j) {
            const int m = m0 + 8 * j + g;
            qmm_u4 xv = {0u, 0u, 0u, 0u};
            if constexpr (PX) {
                xv = xw[j][i];
                if (m < M && kn >= 0) xw[j][i] = qmm_load16(x + (size_t)m * K + kn + 8 * i, true);
            } else if (m < M) {
                xv = qmm_load16(x + (size_t)m * K + kl + 8 * i, aligned);
            }
            // paired as the weights are: (x0, x4), (x1, x5) / (x2, x6), (x3, x7)
            B[j][0] = __byte_perm(xv.x, xv.z, 0x5410); B[j][1] = __byte_perm(xv.x, xv.z, 0x7632);
            B[j][2] = __byte_perm(xv.y, xv.w, 0x5410); B[j][3] = __byte_perm(xv.y, xv.w, 0x7632);
        }
        #pragma unroll
        for (int a = 0; a < NA; ++a) {
            const unsigned qa = i == 0 ? wa[a].x : i == 1 ? wa[a].y : i == 2 ? wa[a].z : wa[a].w;
            const unsigned qb = i == 0 ? wb[a].x : i == 1 ? wb[a].y : i == 2 ? wb[a].z : wb[a].w;
            unsigned A[2][4];
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                A[h][0] = qmm_nibbles<BF>(qa, 2 * h, sa2[a], ba2[a], mask, magic);      // (k 2h, 2h+4), row g
                A[h][1] = qmm_nibbles<BF>(qb, 2 * h, sb2[a], bb2[a], mask, magic);      // row g + 8
                A[h][2] = qmm_nibbles<BF>(qa, 2 * h + 1, sa2[a], ba2[a], mask, magic);  // (k 2h+1, 2h+5)
                A[h][3] = qmm_nibbles<BF>(qb, 2 * h + 1, sb2[a], bb2[a], mask, magic);
            }
            #pragma unroll
            for (int j = 0; j < MT; ++j) {
                qmm_mma<BF>(acc[a][j], A[0][0], A[0][1], A[0][2], A[0][3], B[j][0], B[j][1]);
                qmm_mma<BF>(acc[a][j], A[1][0], A[1][1], A[1][2], A[1][3], B[j][2], B[j][3]);
            }
        }
    }
}

template <bool BF, int BITS, int NA, int MT, typename XT>
__device__ __forceinline__ void qmm_chunk(float (&acc)[NA][MT][4], const qmm_u4 (&wa)[NA], const qmm_u4 (&wb)[NA],
                                          const float (&sa)[NA], const float (&ba)[NA], const float (&sb)[NA],
                                          const float (&bb)[NA], const XT* x, int M, int K, int m0, int kl, int g,
                                          bool aligned) {
    if constexpr (BITS == 4) {
        unsigned sa2[NA], ba2[NA], sb2[NA], bb2[NA];
        #pragma unroll
        for (int a = 0; a < NA; ++a) {
            sa2[a] = qmm_pack<BF>(sa[a], sa[a]); ba2[a] = qmm_pack<BF>(ba[a], ba[a]);
            sb2[a] = qmm_pack<BF>(sb[a], sb[a]); bb2[a] = qmm_pack<BF>(bb[a], bb[a]);
        }
        qmm_chunk4<BF, NA, MT>(acc, wa, wb, sa2, ba2, sb2, bb2, x, M, K, m0, kl, g, aligned);
    } else {
        unsigned magic = 0x4B000000u;
        asm("mov.b32 %0, %0;" : "+r"(magic));  // in a register: the byte permute's second source
        #pragma unroll
        for (int i = 0; i < 4; ++i) {     // word i: inputs kl + 4i .. kl + 4i + 3, in order
            unsigned B[MT][2];
            #pragma unroll
            for (int j = 0; j < MT; ++j) {
                const int m = m0 + 8 * j + g;
                B[j][0] = 0u; B[j][1] = 0u;
                if (m < M) {
                    if (aligned) {
                        const uint2 v = *reinterpret_cast<const uint2*>(x + (size_t)m * K + kl + 4 * i);
                        B[j][0] = v.x; B[j][1] = v.y;
                    } else {
                        const unsigned short* hp = reinterpret_cast<const unsigned short*>(x + (size_t)m * K + kl + 4 * i);
                        B[j][0] = hp[0] | (unsigned(hp[1]) << 16); B[j][1] = hp[2] | (unsigned(hp[3]) << 16);
                    }
                }
            }
            #pragma unroll
            for (int a = 0; a < NA; ++a) {
                const unsigned qa = i == 0 ? wa[a].x : i == 1 ? wa[a].y : i == 2 ? wa[a].z : wa[a].w;
                const unsigned qb = i == 0 ? wb[a].x : i == 1 ? wb[a].y : i == 2 ? wb[a].z : wb[a].w;
                const float s0 = sa[a], b0 = ba[a], s1 = sb[a], b1 = bb[a];
                const unsigned a0 = qmm_pack<BF>(qmm_byte(qa, 0, s0, b0, magic), qmm_byte(qa, 1, s0, b0, magic));
                const unsigned a2 = qmm_pack<BF>(qmm_byte(qa, 2, s0, b0, magic), qmm_byte(qa, 3, s0, b0, magic));
                const unsigned a1 = qmm_pack<BF>(qmm_byte(qb, 0, s1, b1, magic), qmm_byte(qb, 1, s1, b1, magic));
                const unsigned a3 = qmm_pack<BF>(qmm_byte(qb, 2, s1, b1, magic), qmm_byte(qb, 3, s1, b1, magic));
                #pragma unroll
                for (int j = 0; j < MT; ++j) qmm_mma<BF>(acc[a][j], a0, a1, a2, a3, B[j][0], B[j][1]);
            }
        }
    }
}
"""

_SOURCE = """
    constexpr bool BF = XBF != 0;
    constexpr int CK = BITS == 4 ? 128 : 64;      // inputs per chunk (4 lanes x 16 bytes)
    constexpr int KT = CK / 4;                    // inputs a lane holds per row per chunk
    // x is [..., K], row-contiguous: its rows are every leading index, so a caller needs no
    // reshape around the call (two view nodes per call are host time a decode step pays).
    const int K = x_shape[x_ndim - 1], N = w_shape[0];
    int M = 1;
    for (int d = 0; d < x_ndim - 1; ++d) M *= x_shape[d];
    // SBT: the scales and biases come tiled (``tile_pairs``), [N / 16, G / 2, 32]: a column tile's
    // 16 rows' pairs of two groups contiguous, so a warp's copy of a chunk's pairs reads 128
    // contiguous bytes (4 sectors) instead of one 4-byte piece from each of 32 sectors.
    const int G = SBT ? 2 * scales_shape[1] : scales_shape[1];
    // where row r's scale (or bias) of group grp is, in either layout
    auto sb_at = [&](int r, int grp) -> size_t {
        return SBT ? ((size_t)(r >> 4) * (G >> 1) + (grp >> 1)) * 32 + (r & 15) * 2 + (grp & 1) : (size_t)r * G + grp;
    };
    constexpr int PAIR_STRIDE = SBT ? 16 : 1;     // elements from one pair of groups of a row to the next
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * 16 * NA;          // NA column tiles of 16 per warp
    const int NC = K / CK;
    const size_t row_bytes = (size_t)K * BITS / 8;
    const unsigned char* wbytes = reinterpret_cast<const unsigned char*>(w);
    const bool aligned = ((reinterpret_cast<size_t>(w) | reinterpret_cast<size_t>(x)) & 15) == 0 && (K % 8) == 0;
    // The shared-memory feed copies a lane's scale and bias as the 4-byte pair that holds them.
    const bool paired = ((reinterpret_cast<size_t>(scales) | reinterpret_cast<size_t>(biases)) & 3) == 0 && (G % 2) == 0;
    __shared__ float red[S > 1 ? S * 32 * 4 : 1];
    // P > 0: a warp's weights stream through shared memory P chunks ahead of its products. Each
    // lane copies exactly the weights it later reads (its 16 bytes of rows g and g + 8, per column
    // tile), so those need no barrier, only its own waits.
    // Slot (stage, a) of lane l: ring[((warp * P + stage) * NA + a) * 96 + piece * 32 + l], 16 bytes a piece.
    // The scale and bias pairs (piece 2): where one pair a row serves the whole chunk (SBW: every
    // group size but 32 at 4 bits), the warp copies the 16 rows' pairs once, a 4-byte piece a lane,
    // into 8 entries of 16 bytes (row g's scale and bias pairs, then row g + 8's) that the 4 lanes
    // of a g read alike: one copy a lane instead of four, 128 contiguous bytes of shared memory
    // instead of 512 scattered (on an H100 ncu found 64% of the feed's shared wavefronts and 30%
    // of its global sectors in excess with the four). Lanes then read what others copied: a warp
    // barrier after the wait and before the slot is copied into again. Otherwise each lane
    // copies its own four pairs into its own 16 bytes.
    constexpr bool SBW = (2 * GS) % CK == 0;
    __shared__ uint4 ring[P > 0 ? S * P * NA * 96 : 1];   // uint4: 16-byte aligned, one load a piece

    for (int m0 = 0; m0 < M; m0 += 8 * MT) {
        float acc[NA][MT][4];
        #pragma unroll
        for (int a = 0; a < NA; ++a) {
            #pragma unroll
            for (int j = 0; j < MT; ++j) { acc[a][j][0] = 0.f; acc[a][j][1] = 0.f; acc[a][j][2] = 0.f; acc[a][j][3] = 0.f; }
        }
        if (P > 0 && aligned && paired) {
            constexpr int PS = P > 0 ? P : 1;
            uint4* mine = ring + (size_t)warp * PS * NA * 96;
            // What a copy's addresses do not owe to its chunk, worked out once: in the loop a
            // chunk's copies cost their own instructions, not 64-bit address arithmetic (~70
            // instructions a chunk when written per copy, on sm_90).
            const unsigned smem0 = qmm_smem(mine) + lane * 16;
            const unsigned char* wrow[NA];
            const T* srow[NA];
            const T* brow[NA];                        // unused with SBW: srow then points at a scale or a bias
            #pragma unroll
            for (int a = 0; a < NA; ++a) {
                const int na = n0 + 16 * a + g;
                wrow[a] = wbytes + (size_t)na * row_bytes + t * 16;
                if constexpr (SBW) {
                    // lane (g, t) copies entry g's word t: scale, bias of row g, then of row g + 8
                    // (the bias as the scale's address plus the arrays' distance: 6 registers
                    // fewer than choosing between the two pointers, nvcc for sm_90)
                    const size_t to_bias = (t & 1) ? reinterpret_cast<size_t>(biases) - reinterpret_cast<size_t>(scales) : 0;
                    srow[a] = reinterpret_cast<const T*>(
                        reinterpret_cast<const char*>(scales + sb_at(n0 + 16 * a + g + ((t & 2) ? 8 : 0), 0)) + to_bias);
                } else {
                    srow[a] = scales + sb_at(na, 0);
                    brow[a] = biases + sb_at(na, 0);
                }
            }
            const unsigned sbw0 = qmm_smem(mine) + 64 * 16 + lane * 4;  // SBW: entry g's word t (lane = 4g + t)
            const size_t wrow8 = 8 * row_bytes, grow8 = SBT ? 16 : (size_t)8 * G;  // row g to row g + 8
            // stage p's copies of chunk c (none past the last chunk: the group is then empty)
            auto issue = [&](int p, int c) {
                if (c < NC) {
                    const size_t off = (size_t)c * (CK * BITS / 8);
                    const size_t pair = (size_t)(((c * CK + t * KT) / GS) & ~1) * PAIR_STRIDE;
                    #pragma unroll
                    for (int a = 0; a < NA; ++a) {
                        const unsigned slot = smem0 + (p * NA + a) * 96 * 16;
                        qmm_cp16(slot, wrow[a] + off);
                        qmm_cp16(slot + 32 * 16, wrow[a] + wrow8 + off);
                        if constexpr (SBW) {
                            qmm_cp4(sbw0 + (p * NA + a) * 96 * 16, srow[a] + pair);
                        } else {
                            const unsigned sc = slot + 64 * 16;
                            qmm_cp4(sc + 0, srow[a] + pair); qmm_cp4(sc + 4, brow[a] + pair);
                            qmm_cp4(sc + 8, srow[a] + grow8 + pair); qmm_cp4(sc + 12, brow[a] + grow8 + pair);
                        }
                    }
                }
                qmm_commit();
            };
            #pragma unroll 1
            for (int p = 0; p < PS; ++p) issue(p, warp + p * S);
            // the first chunk's activations (PX): later chunks' load while the one before computes
            constexpr bool PX = BITS == 4 && XPRE != 0;
            qmm_u4 xw[PX ? MT : 1][4];
            if constexpr (PX) {
                #pragma unroll
                for (int j = 0; j < MT; ++j) {
                    const int m = m0 + 8 * j + g;
                    #pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        xw[j][i] = {0u, 0u, 0u, 0u};
                        if (m < M && warp < NC) xw[j][i] = qmm_load16(x + (size_t)m * K + warp * CK + t * KT + 8 * i, true);
                    }
                }
            }
            // One chunk's code, not P copies (unrolled, the copies cost ~30 registers at P = 4:
            // a block per SM): the slot is an offset into shared memory, free to vary.
            int p = 0;
            #pragma unroll 1
            for (int c = warp; c < NC; c += S) {
                qmm_wait<PS - 1>();           // this chunk's group (the oldest in flight) has landed
                if constexpr (SBW) __syncwarp();  // ... every lane's: the pairs are read across lanes
                const int hi = ((c * CK + t * KT) / GS) & 1;
                qmm_u4 wa[NA], wb[NA];
                #pragma unroll
                for (int a = 0; a < NA; ++a) {
                    const uint4* slot = mine + (p * NA + a) * 96;
                    const uint4 va = slot[lane], vb = slot[32 + lane];
                    wa[a] = {va.x, va.y, va.z, va.w};
                    wb[a] = {vb.x, vb.y, vb.z, vb.w};
                }
                if constexpr (BITS == 4) {
                    // each pair's 16-bit half ``hi`` in both halves: (s, s), as qmm_pack makes it
                    const unsigned sel = hi ? 0x3232u : 0x1010u;
                    unsigned sa2[NA], ba2[NA], sb2[NA], bb2[NA];
                    #pragma unroll
                    for (int a = 0; a < NA; ++a) {
                        const uint4 sc = mine[(p * NA + a) * 96 + 64 + (SBW ? g : lane)];
                        sa2[a] = __byte_perm(sc.x, 0, sel); ba2[a] = __byte_perm(sc.y, 0, sel);
                        sb2[a] = __byte_perm(sc.z, 0, sel); bb2[a] = __byte_perm(sc.w, 0, sel);
                    }
                    qmm_chunk4<BF, NA, MT, PX>(acc, wa, wb, sa2, ba2, sb2, bb2, x, M, K, m0, c * CK + t * KT, g, aligned,
                                               xw, c + S < NC ? (c + S) * CK + t * KT : -1);
                } else {
                    float sa[NA], ba[NA], sb[NA], bb[NA];
                    #pragma unroll
                    for (int a = 0; a < NA; ++a) {
                        const T* sc = reinterpret_cast<const T*>(mine + (p * NA + a) * 96 + 64 + (SBW ? g : lane));
                        sa[a] = static_cast<float>(sc[0 + hi]); ba[a] = static_cast<float>(sc[2 + hi]);
                        sb[a] = static_cast<float>(sc[4 + hi]); bb[a] = static_cast<float>(sc[6 + hi]);
                    }
                    qmm_chunk<BF, BITS, NA, MT>(acc, wa, wb, sa, ba, sb, bb, x, M, K, m0, c * CK + t * KT, g, aligned);
                }
                if constexpr (SBW) __syncwarp();  // every lane has read the slot's pairs
                issue(p, c + PS * S);         // the slot just read takes the chunk P ahead
                p = p + 1 == PS ? 0 : p + 1;
            }
            qmm_wait<0>();                    // nothing in flight into the ring before its next pass
            if constexpr (SBW) __syncwarp();
        } else {
            for (int cu = warp; cu < NC; cu += S * U) {
                qmm_u4 wa[U][NA], wb[U][NA];
                float sa[U][NA], ba[U][NA], sb[U][NA], bb[U][NA];
                #pragma unroll
                for (int u = 0; u < U; ++u) {
                    const int c = cu + u * S;
                    if (c < NC) {
                        const size_t off = (size_t)c * (CK * BITS / 8) + t * 16;
                        const int grp = (c * CK + t * KT) / GS;
                        #pragma unroll
                        for (int a = 0; a < NA; ++a) {
                            const int na = n0 + 16 * a + g;
                            wa[u][a] = qmm_load16(wbytes + (size_t)na * row_bytes + off, aligned);
                            wb[u][a] = qmm_load16(wbytes + (size_t)(na + 8) * row_bytes + off, aligned);
                            sa[u][a] = static_cast<float>(scales[sb_at(na, grp)]);
                            ba[u][a] = static_cast<float>(biases[sb_at(na, grp)]);
                            sb[u][a] = static_cast<float>(scales[sb_at(na + 8, grp)]);
                            bb[u][a] = static_cast<float>(biases[sb_at(na + 8, grp)]);
                        }
                    }
                }
                #pragma unroll
                for (int u = 0; u < U; ++u) {
                    const int c = cu + u * S;
                    if (c >= NC) break;
                    qmm_chunk<BF, BITS, NA, MT>(acc, wa[u], wb[u], sa[u], ba[u], sb[u], bb[u], x, M, K, m0,
                                                c * CK + t * KT, g, aligned);
                }
            }
        }
        // The S warps' partial sums, added in warp order; one tile of 8 rows of one column tile at a time.
        #pragma unroll
        for (int a = 0; a < NA; ++a) {
            #pragma unroll
            for (int j = 0; j < MT; ++j) {
                if (S > 1) {
                    __syncthreads();
                    #pragma unroll
                    for (int e = 0; e < 4; ++e) red[(warp * 32 + lane) * 4 + e] = acc[a][j][e];
                    __syncthreads();
                }
                if (warp == 0) {
                    float s[4] = {acc[a][j][0], acc[a][j][1], acc[a][j][2], acc[a][j][3]};
                    for (int v = 1; v < S; ++v) {
                        #pragma unroll
                        for (int e = 0; e < 4; ++e) s[e] += red[(v * 32 + lane) * 4 + e];
                    }
                    // C[g][2t], C[g][2t+1], C[g+8][2t], C[g+8][2t+1]: weight row (column of y) g / g+8, x row 2t / 2t+1
                    const int mA = m0 + 8 * j + 2 * t;
                    const int na = n0 + 16 * a + g;
                    if (mA < M) {
                        y[(size_t)mA * N + na] = QMM_OUT((size_t)mA * N + na, s[0]);
                        y[(size_t)mA * N + na + 8] = QMM_OUT((size_t)mA * N + na + 8, s[2]);
                    }
                    if (mA + 1 < M) {
                        y[(size_t)(mA + 1) * N + na] = QMM_OUT((size_t)(mA + 1) * N + na, s[1]);
                        y[(size_t)(mA + 1) * N + na + 8] = QMM_OUT((size_t)(mA + 1) * N + na + 8, s[3]);
                    }
                }
            }
        }
    }
"""

# How an output is written: rounded to T, or (the residual variant, input ``res`` [..., N] of T)
# rounded to T and added to the residual with T's own ``+``, the operator MLX's Add kernel applies
# to two arrays of T: the bits of ``res + y`` computed apart, without the Add's kernel (a decode
# step of the 27B model has 128 such adds, each a launch and host time; bench/results/h100_2026-12-06m).
_OUT_PLAIN = "\n#define QMM_OUT(i, v) static_cast<T>(v)\n"
_OUT_RESIDUAL = "\n#define QMM_OUT(i, v) (static_cast<T>(v) + res[i])\n"


def kernel_body(residual: bool = False) -> str:
    """The body MLX is handed: how the kernel writes its outputs, then ``_SOURCE``."""
    return (_OUT_RESIDUAL if residual else _OUT_PLAIN) + _SOURCE


# The kernel's name carries a hash of its source: MLX caches compiled kernels on disk by name
# (MLX_PTX_CACHE_DIR), so an edited kernel must never be served a stale binary.
_NAME = "councild_qmm_mma_" + hashlib.sha1((_HEADER + kernel_body()).encode()).hexdigest()[:10]
_NAME_RESIDUAL = "councild_qmm_mma_res_" + hashlib.sha1((_HEADER + kernel_body(True)).encode()).hexdigest()[:10]

# Warps per block (the split of K: part of the summation order, so per (N, K, bits), never per M),
# by measurement (bench/qmm_split_pick.py over a device sweep); shapes not listed take
# ``default_split``. The 27B's merged gate/up: at 3 warps (``WIDE_SPLIT``) the kernel with the
# hoisted copies and one-lop3 nibbles ran 57.7 / 64.7 / 72.3 us at M = 1 / 4 / 16, at 4 warps
# 46.4 / 53.0 / 79.4 (64% of the bound at one row; H100, bench/results/h100_2026-12-06e).
SPLITS: dict[tuple[int, int, int], int] = {(34816, 5120, 4): 4}
# Chunks in flight per warp (U) by row-tile count: speed only.
UNROLL_BY_TILES = {1: 2, 2: 2, 3: 1, 4: 1}
# Column tiles of 16 per warp (NA) by row-tile count: speed only (a column's sum is the same
# whichever warp owns it). More rows want more columns per warp: each activation fragment a
# warp loads then feeds NA tiles' products instead of one, so the activations' traffic from
# L1/L2, which grows with M, shrinks by NA; one row wants many warps in flight instead.
COLUMN_TILES_BY_TILES = {1: 1, 2: 2, 3: 2, 4: 4}
# Chunks whose weights stream through shared memory ahead of the products (P; 0: loaded into
# registers U chunks at a time, the first way): speed only (the same products in the same order,
# ``qmm_chunk`` computes both). On an H100 the register feed left a warp stalled on its loads
# ~40% of the time at one row (bench/results/h100_2026-12-06): P chunks in flight per warp keep
# loads outstanding while it computes. P = 2 at every row-tile count, measured on an H100
# (bench/results/h100_2026-12-06c): the 27B-shaped 4-bit step 0.94x (one row) and 0.95x (four
# rows) the register feed's time, the same logits bit for bit; P = 4 was slower than P = 2.
# 8-bit layers too since the H200's check (bench/results/h200_2026-12-06d: every launch the same
# bits at M = 1..40, the 8-bit bundled model's batched exact gate PASS): 17408 -> 5120 at one row
# 53.3 us against 62.4, four rows 57.3 against 61.7; 6144 -> 5120 the one loss, 26.0 against 24.0.
STAGES_BY_TILES: dict[int, int] = {mt: 2 for mt in range(1, MAX_TILES + 1)}
# A block's static shared memory is at most 48 KB: the ring takes S * P * NA * 1.5 KB of it.
RING_SLOTS_MAX = 30
# Row tiles up to which the shared-memory feed loads a chunk's activations while the chunk before
# computes (template XPRE; 4-bit only; speed only: the same values reach the same products). It
# holds 12-20 more registers a lane (nvcc, sm_90): at 2 row tiles the 27B's narrow layers' blocks
# then no longer fit one wave (an H100: the down projection 55.5 us against 41.8 at 9 rows), so
# one row tile only (bench/results/h100_2026-12-06k).
PREFETCH_TILES = 1
# Layers that never prefetch, measured slower with it: (N, K, bits). The 27B's merged in_proj:
# 1,030 blocks of 4 warps need 7.8 an SM, the prefetch's registers leave room for 7 (30.1 us
# against 24.7 at one row on an H100).
PREFETCH_OFF: set[tuple[int, int, int]] = {(16480, 5120, 4)}

_kernels: dict[bool, Any] = {}


def _get_kernel(residual: bool = False):
    got = _kernels.get(residual)
    if got is None:
        inputs = ["x", "w", "scales", "biases"] + (["res"] if residual else [])
        got = _kernels[residual] = custom_kernel_cache.cuda_kernel(
            name=_NAME_RESIDUAL if residual else _NAME, input_names=inputs, output_names=["y"],
            source=kernel_body(residual), header=_HEADER)
    return got


def chunk_inputs(bits: int) -> int:
    return 128 if bits == 4 else 64


def mma_refusal(x_dtype, N: int, K: int, group_size: int, bits: int, has_biases: bool = True) -> str | None:
    """Why the tensor-core kernel cannot take this layer, or None. A layout check only (the
    scalar kernel's ``layout_refusal`` has passed before this is asked)."""
    if x_dtype not in MMA_INPUTS:
        return f"{x_dtype} activations: the tensor-core kernel takes bfloat16 or float16"
    if bits not in MMA_BITS:
        return f"{bits}-bit weights: the tensor-core kernel takes 4 or 8 bits"
    if not has_biases:
        return "no biases"
    if N % 16:
        return f"{N} output columns: the tensor-core kernel takes multiples of 16"
    ck = chunk_inputs(bits)
    if K % ck:
        return f"input dimension {K}: the tensor-core kernel takes multiples of {ck} at {bits} bits"
    if group_size % (ck // 4):
        return f"group size {group_size}: the tensor-core kernel needs a multiple of {ck // 4} at {bits} bits"
    return None


# Warps per block for a layer so wide that its column tiles alone fill the chip (the lm_head, the
# merged gate/up projection): one warp a block left each warp ~40 chunks in a row and ran the
# head at 53% of the bound on an H100, three warps at 70% (M = 1, 4, 16: 1.31x, 1.23x, 1.15x;
# M = 32: 0.92x; bench/results/h100_2026-12-06c). Part of the summation order, like any split.
WIDE_SPLIT = 3


def default_split(N: int, K: int, bits: int) -> int:
    """Warps per block for a shape the table does not list: enough blocks x warps to fill an
    H200-sized chip (132 SMs, ~16 resident warps each) while each warp keeps >= 4 chunks; a
    layer whose tiles alone fill it takes ``WIDE_SPLIT`` warps where each keeps >= 4 chunks."""
    tiles = N // 16
    chunks = K // chunk_inputs(bits)
    s = 1
    while s < 16 and tiles * s < 132 * 16 and chunks // (2 * s) >= 4:
        s *= 2
    if s == 1 and WIDE_SPLIT > 1 and chunks // WIDE_SPLIT >= 4:
        s = WIDE_SPLIT
    return s


def split_for(N: int, K: int, bits: int) -> int:
    return SPLITS.get((N, K, bits)) or default_split(N, K, bits)


def tiles_for(M: int) -> int:
    return max(1, min(MAX_TILES, -(-M // 8)))


def stages_for(MT: int, S: int, NA: int, wanted: int | None = None) -> int:
    """Chunks in flight through shared memory per warp: the table's (or ``wanted``) cut to what
    the 48 KB of a block's static shared memory holds beside the other warps' rings; 0 when even
    one stage does not fit (the register feed)."""
    p = STAGES_BY_TILES.get(MT, 0) if wanted is None else wanted
    while p > 0 and S * p * NA > RING_SLOTS_MAX:
        p -= 1
    # One stage is no pipeline (a warp waits for each copy as it lands): slower than registers
    # (H100: the down projection at M = 16, 69.7 us against 60.7).
    return p if p >= 2 else 0


# Blocks a layer keeps at least, by row-tile count, where the table would give its warps several
# column tiles (speed only: a column's sum is the same whichever warp owns it). At 2 row tiles
# (9-16 rows: a verify of 4 rows' drafts) NA = 2 left the 27B's 5120-output layers 160 blocks on
# 132 SMs; at one tile a warp they keep 320: on an H100 the down projection 41.6 us against 56.7 at
# 9 rows, 54.0 against 60.3 at 16, the GatedDeltaNet out projection 20.3 / 24.8 against 21.9 /
# 23.5, and a 27B step of 4 rows x 3 positions 0.955x, x 4 0.947x (bench/results/h100_2026-12-06j).
# At 4 row tiles fewer blocks won (the down projection at 32 rows: 81.7 us at NA = 4, 113.2 at 1).
MIN_BLOCKS_BY_TILES: dict[int, int] = {2: 264}


def column_tiles_for(N: int, MT: int, S: int, wanted: int | None = None) -> int:
    """Column tiles per warp: the table's choice for MT row tiles, halved until it divides N / 16
    (and, unless ``wanted``, until the layer keeps ``MIN_BLOCKS_BY_TILES`` blocks).
    A block of more than 256 threads takes one: a thread of NA >= 2 holds up to ~240 registers
    (nvcc for sm_90, tools/cuda_compile_check.py), and a block's threads share 65,536 (the H200
    refused S = 16 x NA = 2 with "too many resources requested for launch"); NA = 1 holds <= 96."""
    na = wanted or COLUMN_TILES_BY_TILES.get(MT, 1)
    if 32 * S > 256:
        na = 1
    least = 0 if wanted else MIN_BLOCKS_BY_TILES.get(MT, 0)
    while na > 1 and ((N // 16) % na or N // (16 * na) < least):
        na //= 2
    return na


# (M, N, K, dtype, bits, group, launch overrides) -> the kernel call's launch arguments: the
# Python around a call is host time every decode step pays, so it is worked out once a shape.
_launches: dict[tuple, dict] = {}


def forget_launches() -> None:
    """After SPLITS or the launch tables change (the device check's sweep applies its own)."""
    _launches.clear()


def prefetch_for(bits: int, MT: int, P: int, wanted: int | None = None, N: int = 0, K: int = 0) -> int:
    """1 when the shared-memory feed loads the next chunk's activations ahead (``PREFETCH_TILES``;
    ``wanted`` overrides it for the sweep), else 0; the register feed and 8-bit never do."""
    on = MT <= PREFETCH_TILES and (N, K, bits) not in PREFETCH_OFF if wanted is None else bool(wanted)
    return int(on and P > 0 and bits == 4)


def _launch(lead: tuple, N: int, K: int, dtype, bits: int, group_size: int, split, unroll, tiles, columns,
            stages, prefetch=None, tiled: bool = False) -> dict:
    key = (lead, N, K, dtype, bits, group_size, split, unroll, tiles, columns, stages, prefetch, tiled)
    got = _launches.get(key)
    if got is None:
        M = math.prod(lead)
        S = split or split_for(N, K, bits)
        MT = tiles or tiles_for(M)
        NA = column_tiles_for(N, MT, S, columns)
        P = stages_for(MT, S, NA, stages)
        # With P > 0 the register feed runs only for unaligned pointers: U = 1 keeps its
        # registers (a kernel holds the most either way needs) at the shared-memory feed's.
        U = unroll or (1 if P else UNROLL_BY_TILES.get(MT, 1))
        X = prefetch_for(bits, MT, P, prefetch, N, K)
        got = {"template": [("T", dtype), ("XBF", int(dtype == mx.bfloat16)), ("BITS", bits), ("GS", group_size),
                            ("S", S), ("MT", MT), ("U", U), ("NA", NA), ("P", P), ("XPRE", X), ("SBT", int(tiled))],
               "grid": (32 * S * (N // (16 * NA)), 1, 1), "threadgroup": (32 * S, 1, 1),
               "output_shapes": [(*lead, N)], "output_dtypes": [dtype]}
        _launches[key] = got
    return got


def quantized_matmul_mma(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int,
                         *, split: int | None = None, unroll: int | None = None, tiles: int | None = None,
                         columns: int | None = None, stages: int | None = None,
                         prefetch: int | None = None, residual: mx.array | None = None,
                         tiled: bool | None = None) -> mx.array:
    """x [..., K] (bf16/fp16; its M rows are every leading index) times the quantized w [N, K]
    transposed on the tensor cores, y [..., N]; each output summed in an order fixed by K, bits
    and the split (see the module docstring). With ``residual`` (``residual_refusal`` None),
    ``residual + y`` with the bits of the two computed apart, in one kernel. The keyword arguments
    override the launch (for the device check's sweep); ``split`` changes the order, the others
    (``unroll``, ``tiles``, ``columns``, ``stages``, ``prefetch``) only the speed. ``tiled``: scales
    and biases are ``tile_pairs``'s layout (the same values: the same bits, read from other places);
    None: a layer ``tile_layers`` registered reads its tiled copies, any other MLX's layout."""
    if tiled is None:
        got = _tiled_pairs.get(id(scales))
        tiled = got is not None and got[0] is scales and got[1] is biases
        if tiled:
            scales, biases = got[2], got[3]
    elif tiled and (scales.ndim != 3 or scales.shape[-1] != 32 or biases.shape != scales.shape):
        # MLX's [N, G] read as tiled would read past the arrays' ends: refused on the host
        raise ValueError(f"tiled=True takes tile_pairs's [N / 16, G / 2, 32] scales and biases, "
                         f"not {tuple(scales.shape)} / {tuple(biases.shape)}")
    launch = _launch(x.shape[:-1], w.shape[0], x.shape[-1], x.dtype, bits, group_size, split, unroll, tiles, columns,
                     stages, prefetch, tiled)
    if residual is None:
        (y,) = _get_kernel()(inputs=[x, w, scales, biases], **launch)
    else:
        (y,) = _get_kernel(True)(inputs=[x, w, scales, biases, residual], **launch)
    return y


def tile_pairs(a: mx.array) -> mx.array:
    """A layer's scales (or biases) [N, G] as the kernel reads them with ``tiled``: [N / 16, G / 2, 32],
    element (tile, pair, 2 * r + h) = a[16 * tile + r, 2 * pair + h]. A warp copies a chunk's
    scale and bias pairs for its 16 rows; from MLX's layout that is one 4-byte piece from each of
    32 rows' sectors (an H100's ncu: 45% of the one-row feed's global sectors in excess,
    bench/results/h100_2026-12-07), from this one 64 contiguous bytes of each array. The same
    values: the kernel gives the same bits from either layout. Needs N % 16 == 0 and G even."""
    N, G = a.shape
    if N % 16 or G % 2:
        raise ValueError(f"tile_pairs takes [N, G] with N a multiple of 16 and G even, not {tuple(a.shape)}")
    return mx.contiguous(a.reshape(N // 16, 16, G // 2, 2).transpose(0, 2, 1, 3).reshape(N // 16, G // 2, 32))


# Layers whose scales and biases the kernel reads tiled (``tile_layers``): id(scales) -> (scales,
# biases, their tiled copies). Looked up by identity on every call (a dict lookup of host time):
# the modules keep passing MLX's arrays, which the other kernels (MLX's, for prefill) read. A
# compiled step captures the same array objects, so its trace finds them too.
_tiled_pairs: dict[int, tuple[mx.array, mx.array, mx.array, mx.array]] = {}


def tile_layers(module) -> int:
    """Register a tiled copy of the scales and biases of every quantized layer under ``module`` that
    the kernel can read tiled (N % 16 == 0, an even group count); returns how many. The copies
    cost another copy of the scales and biases (1/8 of a 4-bit group-64 model's weight bytes)."""
    n = 0
    for _, m in module.named_modules():
        s, b = m.get("scales"), m.get("biases")
        if not isinstance(s, mx.array) or not isinstance(b, mx.array) or s.ndim != 2 or s.shape != b.shape:
            continue
        if s.shape[0] % 16 or s.shape[1] % 2 or id(s) in _tiled_pairs:
            continue
        _tiled_pairs[id(s)] = (s, b, tile_pairs(s), tile_pairs(b))
        n += 1
    mx.eval([v[2:] for v in _tiled_pairs.values()])
    return n


def forget_tiled() -> None:
    """Every layer back to MLX's layout (the tiled copies freed)."""
    _tiled_pairs.clear()


def residual_refusal(x: mx.array, N: int, residual: mx.array) -> str | None:
    """Why the kernel cannot add ``residual`` as it writes y = x W^T (None: it can): the residual
    must be y's own shape and dtype (no broadcasting, no promotion: the separate add's result
    would be another dtype or shape)."""
    if residual.dtype != x.dtype:
        return f"a {residual.dtype} residual to {x.dtype} outputs"
    if tuple(residual.shape) != (*x.shape[:-1], N):
        return f"a residual of shape {tuple(residual.shape)} to outputs of {(*x.shape[:-1], N)}"
    return None


def kernel_source(residual: bool = False) -> str:
    """The header and body, for error reports and compile checks."""
    return _HEADER + "\n// ---- body ----\n" + kernel_body(residual)


