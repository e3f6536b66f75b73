"""The GatedDeltaNet recurrence as one CUDA kernel: gates, decay, delta rule and readout.

Why: on Metal mlx-lm runs the recurrence as one custom kernel; off Metal it runs it in plain
ops (``gated_delta_ops``: per token, slices, the decay and update products, two sums, the
stack), plus ``sigmoid(b)`` and the compiled ``compute_g``. On the H200 a 27B-shaped decode
step is bound by the host's cost per kernel (~4.5 us each, bench/results/h200_2026-12-03d),
and those ops are ~20 of the ~54 nodes of each of its 48 GatedDeltaNet layers; their fused
gate kernels are also 16 of the 26 modules MLX compiles on a fresh machine before the first
answer (issue 46). This kernel is one node per layer, and compiles once.

What it computes, for q, k [B, T, Hk, Dk] (normalised, as ``normalize_qk`` leaves them),
v [B, T, Hv, Dv], the raw gate inputs a, b [B, T, Hv], A_log and dt_bias [Hv], the float32
state [B, Hv, Dv, Dk] and an optional mask [B, T] (False: padding, y = 0, state kept), per
token t, in float32:
    beta = sigmoid(b);  g = exp(-exp(A_log) * softplus(a + dt_bias))
    S = g * S;  kv = S k;  S = S + k (beta (v - kv))^T;  y = S q
mlx-lm's ``gated_delta_update`` semantics (its Metal kernel's for masked tokens); q and k
heads are shared by Hv / Hk value heads, as its ``repeat`` does.

Order, fixed by construction: one warp per (row, value head, value row dv); each lane holds
Dk / 32 contiguous state elements and sums them in order; the warp adds its lanes' partials
by the butterfly xor 1, 2, 4, 8, 16. Nothing depends on B or on the other rows, and a call
over T tokens does per token exactly what T calls of one token do (the state stays float32
between tokens either way). So a row's bits are the same alone or batched, in a decode step,
a verify or a prefill: exact rows batch and speculate on it. With ``all_states`` the kernel
also writes the state after every token (a capture verify's rollback needs them).

``gated_delta_conv_fused`` is the same kernel with the block's conv in front of it: it takes
the projection's qkv [B, T, C] and the conv state [B, KC - 1, C] instead of q, k, v, and
convolves, takes the SiLU and normalises q and k itself (in float32, sums by the same fixed
butterfly), and writes the new conv state: ~8 fewer kernels a layer. Its reference is
``gated_delta_conv_reference``.

The numbers differ from mlx-lm's ops path in the last bits (the gates in float32, another
summation order), so a model either runs this kernel in every GatedDeltaNet forward or in
none: ``install`` swaps every layer (gdn_layer.py), and the start-up probes test the model so
installed. CUDA only; elsewhere ``backend_refusal`` says why not.
Of the engine this module imports only the custom kernels' disk cache.
"""

from __future__ import annotations

import mlx.core as mx

from . import custom_kernel_cache

# The kernel's body is put together from parts (``kernel_source``): where each token's q, k, v
# come from (read, or convolved here) and what else is written. The recurrence itself is one
# text for every variant, so a row's bits cannot depend on the variant that carried it.
_SOURCE = """
    constexpr int NPL = Dk / 32;
    const int lane = threadIdx.x;
    const int dv = blockIdx.y * blockDim.y + threadIdx.y;
    const int n = blockIdx.z;                       // row * Hv + value head
    const int bi = n / Hv, hv = n % Hv, hk = hv / (Hv / Hk);
    const int T = TOKENS;
    if (dv >= Dv) return;
    // Inputs are read through their strides (the kernel is made with ensure_row_contiguous
    // off): v, a and b are slices of a merged projection's or the conv's output, the state a
    // slice of a capture's per-token states; a copy of each would be one more kernel.
    const int64_t ke = lane * NPL;
    SOURCE_OF_QKV
    const InT* ap = ga + bi * ga_strides[0] + hv * ga_strides[2];
    const InT* bp = gb + bi * gb_strides[0] + hv * gb_strides[2];
    InT* yp = y + ((size_t)bi * T * Hv + hv) * Dv + dv;
    const float* sp_in = state_in + bi * state_in_strides[0] + hv * state_in_strides[1]
        + dv * state_in_strides[2] + ke * state_in_strides[3];
    const size_t srow = ((size_t)n * Dv + dv) * Dk + ke;
    float st[NPL];
    #pragma unroll
    for (int i = 0; i < NPL; ++i) st[i] = sp_in[i * state_in_strides[3]];
    const float A = expf(static_cast<float>(A_log[hv * A_log_strides[0]]));
    const float dt = static_cast<float>(dt_bias[hv * dt_bias_strides[0]]);
    for (int t = 0; t < T; ++t) {
        if (MASK_ON) {
            const float x = static_cast<float>(ap[t * ga_strides[1]]) + dt;
            const float sp = x > 20.0f ? x : log1pf(expf(x));
            const float g = expf(-A * sp);
            const float beta = 1.0f / (1.0f + expf(-static_cast<float>(bp[t * gb_strides[1]])));
            float qf[NPL], kf[NPL], vt;
            QKV_OF_TOKEN_T
            float kv = 0.0f;
            #pragma unroll
            for (int i = 0; i < NPL; ++i) { st[i] = st[i] * g; kv += st[i] * kf[i]; }
            kv += __shfl_xor_sync(0xffffffff, kv, 1);
            kv += __shfl_xor_sync(0xffffffff, kv, 2);
            kv += __shfl_xor_sync(0xffffffff, kv, 4);
            kv += __shfl_xor_sync(0xffffffff, kv, 8);
            kv += __shfl_xor_sync(0xffffffff, kv, 16);
            const float delta = (vt - kv) * beta;
            float o = 0.0f;
            #pragma unroll
            for (int i = 0; i < NPL; ++i) {
                st[i] = st[i] + kf[i] * delta;
                o += st[i] * qf[i];
            }
            o += __shfl_xor_sync(0xffffffff, o, 1);
            o += __shfl_xor_sync(0xffffffff, o, 2);
            o += __shfl_xor_sync(0xffffffff, o, 4);
            o += __shfl_xor_sync(0xffffffff, o, 8);
            o += __shfl_xor_sync(0xffffffff, o, 16);
            if (lane == 0) yp[(size_t)t * Hv * Dv] = static_cast<InT>(o);
        } else if (lane == 0) {
            yp[(size_t)t * Hv * Dv] = static_cast<InT>(0.0f);
        }
        WRITE_STATE_OF_TOKEN_T
    }
    #pragma unroll
    for (int i = 0; i < NPL; ++i) state_out[srow + i] = st[i];
    WRITE_CONV_STATE
"""

# q, k, v read from their own arrays (normalised by the caller).
_READ_QKV = """
    const InT* qp = q + bi * q_strides[0] + hk * q_strides[2] + ke * q_strides[3];
    const InT* kp = k + bi * k_strides[0] + hk * k_strides[2] + ke * k_strides[3];
    const InT* vp = v + bi * v_strides[0] + hv * v_strides[2] + dv * v_strides[3];"""
_READ_QKV_T = """
            #pragma unroll
            for (int i = 0; i < NPL; ++i) {
                kf[i] = static_cast<float>(kp[t * k_strides[1] + i * k_strides[3]]);
                qf[i] = static_cast<float>(qp[t * q_strides[1] + i * q_strides[3]]);
            }
            vt = static_cast<float>(vp[t * v_strides[1]]);"""

# q, k, v convolved here from the projection's qkv [B, T, C] and the conv state [B, KC-1, C]
# (the depthwise conv over the KC-row window, SiLU, then q and k RMS-normalised with the
# readout scale, as mlx-lm's block and normalize_qk do, but all in float32). Padding rows of
# qkv (mask False) read as zeros, as mlx-lm zeroes them before its conv. In each block (one
# row, one value head, ROWS_PER_BLOCK value rows) warp 0 convolves the key head's q channels
# and warp 1 its k channels, NPL a lane, the sum of squares by the butterfly (so the order is
# fixed by the shapes alone), into shared memory for the block's warps; each warp convolves
# its own v channel. Double-buffered by token parity: one barrier a token.
_CONV_QKV = """
    __shared__ float qk_s[2][2][Dk];
    const InT* xq = qkv + bi * qkv_strides[0];
    const InT* xc = conv_in + bi * conv_in_strides[0];
    // Row r of the window [conv state; qkv] at channel c, as float.
    auto xin = [&](int r, int64_t c) -> float {
        if (r < KC - 1) return static_cast<float>(xc[r * conv_in_strides[1] + c * conv_in_strides[2]]);
        const int u = r - (KC - 1);
        if (!(ROW_ON(u))) return 0.0f;
        return static_cast<float>(xq[u * qkv_strides[1] + c * qkv_strides[2]]);
    };
    // SiLU of the conv at token t for the N channels c0.. (taps in order 0..KC-1 for each:
    // the loop over taps is kept, so a warp has its N channels' loads of a tap in flight at once).
    auto conv_silu = [&](int t, int64_t c0, float* out, const int N) {
        float acc[NPL];
        #pragma unroll
        for (int i = 0; i < NPL; ++i) acc[i] = 0.0f;
        #pragma unroll 1
        for (int j = 0; j < KC; ++j) {
            #pragma unroll
            for (int i = 0; i < NPL; ++i) {
                if (i < N) acc[i] += static_cast<float>(conv_w[(c0 + i) * conv_w_strides[0] + j * conv_w_strides[1]]) * xin(t + j, c0 + i);
            }
        }
        #pragma unroll
        for (int i = 0; i < NPL; ++i) if (i < N) out[i] = acc[i] / (1.0f + expf(-acc[i]));
    };
    const int64_t cq = (int64_t)hk * Dk + ke, ck = (int64_t)KEY + hk * Dk + ke;
    const int64_t cv = 2 * (int64_t)KEY + (int64_t)hv * Dv + dv;"""
_CONV_QKV_T = """
            if (threadIdx.y < 2) {
                const bool is_q = threadIdx.y == 0;
                float cx[NPL], ss = 0.0f;
                conv_silu(t, is_q ? cq : ck, cx, NPL);
                #pragma unroll
                for (int i = 0; i < NPL; ++i) ss += cx[i] * cx[i];
                ss += __shfl_xor_sync(0xffffffff, ss, 1);
                ss += __shfl_xor_sync(0xffffffff, ss, 2);
                ss += __shfl_xor_sync(0xffffffff, ss, 4);
                ss += __shfl_xor_sync(0xffffffff, ss, 8);
                ss += __shfl_xor_sync(0xffffffff, ss, 16);
                // normalize_qk: rms_norm with eps 1e-6 / Dk, then Dk**-1 into q and Dk**-0.5 into k.
                const float r = rsqrtf(ss / Dk + 1e-6f / Dk) * (is_q ? 1.0f / Dk : rsqrtf((float)Dk));
                #pragma unroll
                for (int i = 0; i < NPL; ++i) qk_s[t & 1][threadIdx.y][ke + i] = cx[i] * r;
            }
            conv_silu(t, cv, &vt, 1);
            __syncthreads();  // the mask is the same for the whole block: every warp gets here
            #pragma unroll
            for (int i = 0; i < NPL; ++i) { qf[i] = qk_s[t & 1][0][ke + i]; kf[i] = qk_s[t & 1][1][ke + i]; }"""
# The conv state after the last token: the window's last KC - 1 rows, written once per
# channel (q and k channels by the first warp of each key head, v's by its own warp).
_WRITE_CONV = """
    InT* co = conv_out + (size_t)bi * (KC - 1) * (2 * KEY + Hv * Dv);
    #pragma unroll
    for (int r = 0; r < KC - 1; ++r) {
        InT* cr = co + (size_t)r * (2 * KEY + Hv * Dv);
        if (dv == 0 && hv % (Hv / Hk) == 0) {
            #pragma unroll
            for (int i = 0; i < NPL; ++i) {
                cr[cq + i] = static_cast<InT>(xin(T + r, cq + i));
                cr[ck + i] = static_cast<InT>(xin(T + r, ck + i));
            }
        }
        if (lane == 0) cr[cv] = static_cast<InT>(xin(T + r, cv));
    }"""

# With all_states: the state after token t, into states [B, T, Hv, Dv, Dk].
_WRITE_STATE = """{
            float* sp_out = states + ((((size_t)bi * T + t) * Hv + hv) * Dv + dv) * Dk + ke;
            #pragma unroll
            for (int i = 0; i < NPL; ++i) sp_out[i] = st[i];
        }"""

ROWS_PER_BLOCK = 4  # value rows (warps) per block, >= 2 (the folded conv's q and k warps); nothing is summed across warps
_kernels: dict[tuple[bool, bool], object] = {}


def backend_refusal() -> str | None:
    """Why this kernel cannot run here (None: it can)."""
    if mx.default_device() != mx.gpu or not mx.cuda.is_available():
        return "not CUDA (Metal runs mlx-lm's own kernel; the CPU its ops)"
    return None


def shape_refusal(Dk: int, Dv: int, Hk: int, Hv: int) -> str | None:
    """Why a layer of these head shapes cannot take the kernel (None: it can)."""
    if Dk % 32 or Dk > 256:
        return f"key head dim {Dk} is not a multiple of 32 up to 256"
    if Dv % ROWS_PER_BLOCK:
        return f"value head dim {Dv} is not a multiple of {ROWS_PER_BLOCK}"
    if Hv % Hk:
        return f"{Hv} value heads do not share {Hk} key heads evenly"
    return None


def kernel_source(masked: bool, all_states: bool, conv: bool = False) -> str:
    """The body of one variant. The inputs and outputs a variant lacks must not be named in it."""
    row_on = "mask[bi * mask_strides[0] + (ROW) * mask_strides[1]]" if masked else "true"
    return (_SOURCE.replace("TOKENS", "qkv_shape[1]" if conv else "v_shape[1]")
            .replace("SOURCE_OF_QKV", _CONV_QKV if conv else _READ_QKV)
            .replace("QKV_OF_TOKEN_T", _CONV_QKV_T if conv else _READ_QKV_T)
            .replace("WRITE_CONV_STATE", _WRITE_CONV if conv else "")
            .replace("ROW_ON(u)", row_on.replace("ROW", "u"))
            .replace("MASK_ON", row_on.replace("ROW", "t"))
            .replace("WRITE_STATE_OF_TOKEN_T", _WRITE_STATE if all_states else ""))


def kernel_names(masked: bool, all_states: bool, conv: bool = False) -> tuple[list[str], list[str]]:
    """A variant's input and output names, in the order the kernel takes and returns them
    (the tools that compile or emulate its text outside MLX read them here too)."""
    qkv = ["qkv", "conv_in", "conv_w"] if conv else ["q", "k", "v"]
    inputs = qkv + ["ga", "gb", "A_log", "dt_bias", "state_in"] + (["mask"] if masked else [])
    outputs = ["y", "state_out"] + (["states"] if all_states else []) + (["conv_out"] if conv else [])
    return inputs, outputs


def _kernel(masked: bool, all_states: bool, conv: bool = False):
    key = (masked, all_states, conv)
    if key not in _kernels:
        inputs, outputs = kernel_names(masked, all_states, conv)
        name = "councild_gdn" + ("_conv" if conv else "") + ("_mask" if masked else "") + ("_all" if all_states else "")
        _kernels[key] = custom_kernel_cache.cuda_kernel(name=name, input_names=inputs, output_names=outputs,
                                            source=kernel_source(masked, all_states, conv),
                                            ensure_row_contiguous=False)
    return _kernels[key]


def _float32_state(state: mx.array | None, shape: tuple) -> mx.array:
    if state is None:
        return mx.zeros(shape, dtype=mx.float32)
    return state if state.dtype == mx.float32 else state.astype(mx.float32)


def gated_delta_fused(q: mx.array, k: mx.array, v: mx.array, a: mx.array, b: mx.array, A_log: mx.array,
                      dt_bias: mx.array, state: mx.array | None = None, mask: mx.array | None = None,
                      *, all_states: bool = False) -> tuple:
    """(y [B, T, Hv, Dv] in q's dtype, state [B, Hv, Dv, Dk] float32), and with ``all_states``
    the state after each token [B, T, Hv, Dv, Dk] as a third value. See the module docstring."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    state = _float32_state(state, (B, Hv, Dv, Dk))
    inputs = [q, k, v, a, b, A_log, dt_bias, state] + ([mask] if mask is not None else [])
    shapes = [(B, T, Hv, Dv), (B, Hv, Dv, Dk)] + ([(B, T, Hv, Dv, Dk)] if all_states else [])
    out = _kernel(mask is not None, all_states)(
        inputs=inputs,
        template=[("InT", q.dtype), ("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv)],
        grid=(32, Dv, B * Hv), threadgroup=(32, ROWS_PER_BLOCK, 1),
        output_shapes=shapes, output_dtypes=[q.dtype] + [mx.float32] * (len(shapes) - 1))
    return tuple(out)


def gated_delta_conv_fused(qkv: mx.array, conv_state: mx.array, conv_weight: mx.array, a: mx.array, b: mx.array,
                           A_log: mx.array, dt_bias: mx.array, state: mx.array | None = None,
                           mask: mx.array | None = None, *, heads: tuple[int, int, int, int],
                           all_states: bool = False) -> tuple:
    """The conv, SiLU and q/k normalisation folded in front of the recurrence, in one kernel.
    ``qkv`` [B, T, C] is the block's projection (C = 2 Hk Dk + Hv Dv, as mlx-lm lays it
    out), ``conv_state`` [B, KC - 1, C] its cache's conv state, ``conv_weight`` [C, KC, 1]
    the layer's depthwise conv, ``heads`` (Hk, Dk, Hv, Dv). Returns (y, state, the conv state
    after the last token [B, KC - 1, C] in qkv's dtype), with ``all_states`` the per-token
    states before the conv state. Padding rows (mask False) count as zeros in the conv."""
    Hk, Dk, Hv, Dv = heads
    B, T, C = qkv.shape
    KC = conv_weight.shape[1]
    state = _float32_state(state, (B, Hv, Dv, Dk))
    inputs = [qkv, conv_state, conv_weight, a, b, A_log, dt_bias, state] + ([mask] if mask is not None else [])
    shapes = [(B, T, Hv, Dv), (B, Hv, Dv, Dk)] + ([(B, T, Hv, Dv, Dk)] if all_states else []) + [(B, KC - 1, C)]
    dtypes = [qkv.dtype] + [mx.float32] * (len(shapes) - 2) + [qkv.dtype]
    out = _kernel(mask is not None, all_states, conv=True)(
        inputs=inputs,
        template=[("InT", qkv.dtype), ("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv), ("KC", KC), ("KEY", Hk * Dk)],
        grid=(32, Dv, B * Hv), threadgroup=(32, ROWS_PER_BLOCK, 1), output_shapes=shapes, output_dtypes=dtypes)
    return tuple(out)


def sample_inputs(B: int, T: int, Hk: int, Hv: int, Dk: int, Dv: int, dtype, key: mx.array) -> dict:
    """Random inputs of these shapes as a GatedDeltaNet layer hands them over: q and k
    L2-normalised (q with the Dk**-0.5 readout scale folded in, as ``normalize_qk`` leaves
    them), v and the raw gate inputs a, b in ``dtype``, and a float32 state. For the start-up
    self-check (gdn_layer.py), the device check and the tests."""
    ks = mx.random.split(key, 6)
    q = mx.random.normal((B, T, Hk, Dk), key=ks[0])
    k = mx.random.normal((B, T, Hk, Dk), key=ks[1])
    return {"q": (q * mx.rsqrt((q * q).sum(-1, keepdims=True)) * Dk**-0.5).astype(dtype),
            "k": (k * mx.rsqrt((k * k).sum(-1, keepdims=True))).astype(dtype),
            "v": mx.random.normal((B, T, Hv, Dv), key=ks[2]).astype(dtype),
            "a": mx.random.normal((B, T, Hv), key=ks[3]).astype(dtype),
            "b": mx.random.normal((B, T, Hv), key=ks[4]).astype(dtype),
            "state": mx.random.normal((B, Hv, Dv, Dk), key=ks[5]) * 0.1}


def gated_delta_reference(q: mx.array, k: mx.array, v: mx.array, a: mx.array, b: mx.array, A_log: mx.array,
                          dt_bias: mx.array, state: mx.array | None = None, mask: mx.array | None = None,
                          *, all_states: bool = False) -> tuple:
    """The kernel's arithmetic in plain float32 ops, token by token (same outputs, same
    masking): the numeric reference its start-up check compares against, and the recurrence a
    CPU test installs in its place to exercise the routing."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    f32 = mx.float32
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=f32)
    state = state.astype(f32)
    rep = Hv // Hk
    qf = mx.repeat(q.astype(f32), rep, axis=2) if rep > 1 else q.astype(f32)
    kf = mx.repeat(k.astype(f32), rep, axis=2) if rep > 1 else k.astype(f32)
    x = a.astype(f32) + dt_bias.astype(f32)
    g = mx.exp(-mx.exp(A_log.astype(f32)) * mx.where(x > 20, x, mx.log1p(mx.exp(x))))
    beta = mx.sigmoid(b.astype(f32))
    ys, states = [], []
    for t in range(T):
        new = state * g[:, t, :, None, None]
        kv = (new * kf[:, t, :, None, :]).sum(-1)
        delta = (v[:, t].astype(f32) - kv) * beta[:, t, :, None]
        new = new + kf[:, t, :, None, :] * delta[..., None]
        y = (new * qf[:, t, :, None, :]).sum(-1)
        if mask is not None:
            on = mask[:, t, None, None]
            y = mx.where(on, y, 0.0)
            new = mx.where(on[..., None], new, state)
        state = new
        ys.append(y.astype(q.dtype))
        states.append(state)
    out = (mx.stack(ys, axis=1), state)
    return out + (mx.stack(states, axis=1),) if all_states else out


def conv_qkv_reference(qkv: mx.array, conv_state: mx.array, conv_weight: mx.array, mask: mx.array | None,
                       heads: tuple[int, int, int, int]) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """The folded conv's arithmetic in plain float32 ops: (q, k, v in float32, the conv state
    after the last token in qkv's dtype), as ``gated_delta_conv_fused`` computes them."""
    Hk, Dk, Hv, Dv = heads
    B, T, C = qkv.shape
    KC = conv_weight.shape[1]
    f32 = mx.float32
    if mask is not None:
        qkv = mx.where(mask[..., None], qkv, 0)
    window = mx.concatenate([conv_state.astype(qkv.dtype), qkv], axis=1)
    x = window.astype(f32)
    w = conv_weight[:, :, 0].astype(f32)
    acc = mx.zeros((B, T, C), dtype=f32)
    for j in range(KC):  # the kernel's order: tap 0 first
        acc = acc + w[:, j] * x[:, j:j + T]
    act = acc / (1 + mx.exp(-acc))
    key = Hk * Dk
    q = act[..., :key].reshape(B, T, Hk, Dk)
    k = act[..., key:2 * key].reshape(B, T, Hk, Dk)
    v = act[..., 2 * key:].reshape(B, T, Hv, Dv)
    eps = mx.array(1e-6, f32) / Dk
    q = q * (mx.rsqrt((q * q).sum(-1, keepdims=True) / Dk + eps) * (1.0 / Dk))
    k = k * (mx.rsqrt((k * k).sum(-1, keepdims=True) / Dk + eps) * mx.rsqrt(mx.array(Dk, f32)))
    return q, k, v, window[:, T:]


def gated_delta_conv_reference(qkv: mx.array, conv_state: mx.array, conv_weight: mx.array, a: mx.array,
                               b: mx.array, A_log: mx.array, dt_bias: mx.array, state: mx.array | None = None,
                               mask: mx.array | None = None, *, heads: tuple[int, int, int, int],
                               all_states: bool = False) -> tuple:
    """``gated_delta_conv_fused`` in plain float32 ops (same outputs): the folded kernel's
    numeric reference, and what a CPU test installs in its place to exercise the routing."""
    q, k, v, conv_after = conv_qkv_reference(qkv, conv_state, conv_weight, mask, heads)
    out = gated_delta_reference(q, k, v, a, b, A_log, dt_bias, state, mask, all_states=all_states)
    return (out[0].astype(qkv.dtype), *out[1:], conv_after)
