"""Putting a model's GatedDeltaNet layers on the fused recurrence (gdn_fused.py), in place.

``install`` swaps the class of every GatedDeltaNet layer (qwen3_5 and qwen3_next) to a
subclass whose forward is mlx-lm's block with the recurrence going through the layer's
``fused_recurrence``; the weights are untouched and ``uninstall`` puts the classes back.
The daemon's own walks over the layers (forward.py's capture, mixed_forward.py) ask the same
attribute through ``forward.gdn_recurrence``, so once installed every GatedDeltaNet forward
of the model (decode step, verify, batch, mixed step, short prefill) runs the kernel, and
none runs mlx-lm's ops: a row's bits do not depend on which path carried it. The chunked
prefill of long prompts (chunked_prefill.py) keeps its own form: it only writes the states a
prompt leaves, whichever path then decodes from them.

``recurrence`` is the kernel on CUDA; a CPU test installs ``gated_delta_reference`` (the
kernel's arithmetic in plain ops) to exercise the same routing where no kernel runs.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import sum_gradients
from mlx_lm.models import qwen3_5, qwen3_next

from . import gdn_fused
from .forward import gdn_heads, gdn_mix, gdn_output, gdn_projections

_BASES = (qwen3_5.GatedDeltaNet, qwen3_next.Qwen3NextGatedDeltaNet)


class _FusedBlock:
    """mlx-lm's GatedDeltaNet.__call__ (qwen3_5 / qwen3_next), op for op, but for the conv
    and recurrence: ``forward.gdn_mix``, which takes ``fused_conv_recurrence`` where the conv
    is folded in, else ``fused_recurrence``. With ``residual``: ``residual`` + the block's output,
    the add in the out projection's writes where it takes one (``forward.gdn_output``)."""

    fused_recurrence: Callable
    fused_conv_recurrence: Callable | None
    takes_residual = True

    def __call__(self, inputs: mx.array, mask: mx.array | None = None, cache=None,
                 residual: mx.array | None = None) -> mx.array:
        B, S, _ = inputs.shape
        if self.sharding_group is not None:
            inputs = sum_gradients(self.sharding_group)(inputs)
        qkv, z, b, a = gdn_projections(self, inputs)
        out = gdn_mix(self, qkv, a, b, mask, cache)
        return gdn_output(self, self.norm(out, z).reshape(B, S, -1), residual)


_classes: dict[tuple, type] = {}


def _fused_class(base: type, recurrence: Callable, conv_recurrence: Callable | None) -> type:
    key = (base, recurrence, conv_recurrence)
    if key not in _classes:
        _classes[key] = type(f"Fused{base.__name__}", (_FusedBlock, base),
                             {"fused_recurrence": staticmethod(recurrence), "_base": base,
                              "fused_conv_recurrence": None if conv_recurrence is None else staticmethod(conv_recurrence)})
    return _classes[key]


def layers(text_module) -> list[nn.Module]:
    return [m for _, m in text_module.named_modules() if isinstance(m, _BASES)]


def refusal(text_module) -> str | None:
    """Why this model's layers cannot take the fused kernel here (None: they can)."""
    if (why := gdn_fused.backend_refusal()) is not None:
        return why
    found = layers(text_module)
    if not found:
        return "no GatedDeltaNet layers"
    for m in found:
        why = gdn_fused.shape_refusal(m.head_k_dim, m.head_v_dim, m.num_k_heads, m.num_v_heads)
        if why is not None:
            return why
    return None


def self_check(text_module, recurrence: Callable = gdn_fused.gated_delta_fused, seed: int = 0) -> str | None:
    """Run ``recurrence`` once at the model's own head shapes and dtype (the decode step's
    kernel, compiled here if it must be) against ``gated_delta_reference``: None when it
    agrees (within a few of the activation dtype's last bits; the float32 state to 1e-4), two
    tokens in one call are two calls of one token bit for bit, and inputs that are views give
    the bits of the same values contiguous; else why not. A kernel that
    does not compile or run here raises inside: that is a failed check too."""
    m = layers(text_module)[0]
    args = gdn_fused.sample_inputs(2, 2, m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim,
                                   m.norm.weight.dtype, mx.random.key(seed))
    state = args["state"]

    def run(fn, cut=slice(None), s=state):
        return fn(*(args[n][:, cut] for n in ("q", "k", "v", "a", "b")), m.A_log, m.dt_bias, s, None)

    try:
        y, s = run(recurrence)
        y_ref, s_ref = run(gdn_fused.gated_delta_reference)
        y0, s0 = run(recurrence, slice(0, 1))
        y1, s1 = run(recurrence, slice(1, 2), s0)
        # The daemon hands it views (a merged projection's slices, a capture's states): the
        # same values read through their strides must give the same bits.
        wide = mx.concatenate([args["a"], args["v"].reshape(*args["v"].shape[:2], -1), args["b"]], axis=-1)
        Hv = m.num_v_heads
        v_view = wide[..., Hv:-Hv].reshape(args["v"].shape)
        states = mx.stack([state, state], axis=1)
        y_view, s_view = recurrence(args["q"], args["k"], v_view, wide[..., :Hv], wide[..., -Hv:], m.A_log,
                                    m.dt_bias, states[:, 1], None)
        off = _off_reference(y, s, y_ref, s_ref)
        stepwise = _same(mx.concatenate([y0, y1], axis=1), y) and _same(s1, s)
        strided = _same(y_view, y) and _same(s_view, s)
    except Exception as exc:  # noqa: BLE001 - a kernel that cannot compile or run here is refused, not fatal
        return f"the fused recurrence raised {type(exc).__name__}: {str(exc)[:300]}"
    return _verdict("the fused recurrence", off, stepwise, strided)


def _same(a: mx.array, b: mx.array) -> bool:
    return bool(mx.array_equal(a, b).item())


def _off_reference(y: mx.array, s: mx.array, y_ref: mx.array, s_ref: mx.array) -> str | None:
    """How far a kernel's (y, state) are from the reference's, where beyond a few of the
    activation dtype's last bits (the float32 state: 1e-4); None within."""
    f = mx.float32
    err = (mx.abs(y.astype(f) - y_ref.astype(f)).max() / mx.maximum(mx.abs(y_ref.astype(f)).max(), 1e-6)).item()
    state_err = mx.abs(s - s_ref).max().item()
    if err <= 0.02 and state_err <= 1e-4:
        return None
    return f"y by {err:.3g} of its range, the state by {state_err:.3g}"


def _verdict(what: str, off: str | None, stepwise: bool, strided: bool) -> str | None:
    if off is not None:
        return f"{what} is off the reference: {off}"
    if not stepwise:
        return f"{what} gives other bits for two tokens in one call than one at a time"
    if not strided:
        return f"{what} reads views of its inputs wrong (other bits than the same values contiguous)"
    return None


def conv_refusal(text_module) -> str | None:
    """Why the conv cannot be folded into the kernel for this model's layers (None: it can):
    the conv must be mlx-lm's depthwise one over the q | k | v channels, without a bias."""
    for m in layers(text_module):
        Hk, Dk, Hv, Dv = gdn_heads(m)
        C = 2 * Hk * Dk + Hv * Dv
        if m.conv_dim != C or tuple(m.conv1d.weight.shape) != (C, m.conv_kernel_size, 1):
            return f"the conv is not depthwise over the {C} q, k, v channels"
        if "bias" in m.conv1d or m.conv_kernel_size < 2:
            return "the conv has a bias or no history"
    return None


def conv_self_check(text_module, conv_recurrence: Callable = gdn_fused.gated_delta_conv_fused,
                    seed: int = 0) -> str | None:
    """``self_check`` for the kernel with the conv folded in (``gated_delta_conv_fused``),
    with the model's own conv weights, against ``gated_delta_conv_reference``: within the
    reference as there, with and without padding rows, the conv state it leaves exactly the
    window's last rows, two tokens in one call = two calls, a view of qkv = the same values
    contiguous. None when it passes, else why not."""
    m = layers(text_module)[0]
    heads = gdn_heads(m)
    C, dtype = m.conv_dim, m.norm.weight.dtype
    ks = mx.random.split(mx.random.key(seed), 3)
    r = gdn_fused.sample_inputs(2, 2, heads[0], heads[2], heads[1], heads[3], dtype, ks[0])
    wide = mx.random.normal((2, 2, C + 8), key=ks[1]).astype(dtype)
    qkv = wide[..., 4:-4]  # a view, as the merged projection's slice is
    conv_state = mx.random.normal((2, m.conv_kernel_size - 1, C), key=ks[2]).astype(dtype)
    mask = mx.array([[True, True], [False, True]])

    def run(fn, cut=slice(None), cs=conv_state, s=r["state"], x=qkv, pad=None):
        return fn(x[:, cut], cs, m.conv1d.weight, r["a"][:, cut], r["b"][:, cut], m.A_log, m.dt_bias, s, pad,
                  heads=heads)

    try:
        y, s, c = run(conv_recurrence)
        y_ref, s_ref, c_ref = run(gdn_fused.gated_delta_conv_reference)
        yp, sp, cp = run(conv_recurrence, pad=mask)
        yp_ref, sp_ref, cp_ref = run(gdn_fused.gated_delta_conv_reference, pad=mask)
        y0, s0, c0 = run(conv_recurrence, slice(0, 1))
        y1, s1, c1 = run(conv_recurrence, slice(1, 2), c0, s0)
        y_dense, s_dense, c_dense = run(conv_recurrence, x=mx.contiguous(qkv))
        off = _off_reference(y, s, y_ref, s_ref) or _off_reference(yp, sp, yp_ref, sp_ref)
        if off is None and not (_same(c, c_ref) and _same(cp, cp_ref)):
            off = "the conv state it leaves is not the window's last rows"
        stepwise = _same(mx.concatenate([y0, y1], axis=1), y) and _same(s1, s) and _same(c1, c)
        strided = _same(y_dense, y) and _same(s_dense, s) and _same(c_dense, c)
    except Exception as exc:  # noqa: BLE001 - as in self_check
        return f"the folded conv kernel raised {type(exc).__name__}: {str(exc)[:300]}"
    return _verdict("the folded conv kernel", off, stepwise, strided)


def install(text_module, recurrence: Callable = gdn_fused.gated_delta_fused,
            conv_recurrence: Callable | None = None) -> int:
    """Swap every GatedDeltaNet layer onto ``recurrence``, and with ``conv_recurrence`` (the
    caller checked ``conv_refusal`` and ``conv_self_check``) the conv folded into that kernel;
    returns how many. The caller checked ``refusal``; the traces of a compiled step made
    before hold the old forward."""
    n = 0
    for m in layers(text_module):
        base = getattr(type(m), "_base", type(m))
        m.__class__ = _fused_class(base, recurrence, conv_recurrence)
        n += 1
    return n


def uninstall(text_module) -> None:
    for m in layers(text_module):
        m.__class__ = getattr(type(m), "_base", type(m))


def installed(text_module) -> bool:
    return any(getattr(m, "fused_recurrence", None) is not None for m in layers(text_module))


def conv_folded(text_module) -> bool:
    return any(getattr(m, "fused_conv_recurrence", None) is not None for m in layers(text_module))
