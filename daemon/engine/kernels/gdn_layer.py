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
from .forward import gdn_conv_input, gdn_conv_qkv, gdn_projections, gdn_recurrence

_BASES = (qwen3_5.GatedDeltaNet, qwen3_next.Qwen3NextGatedDeltaNet)


class _FusedBlock:
    """mlx-lm's GatedDeltaNet.__call__ (qwen3_5 / qwen3_next), op for op, but for the
    recurrence: ``forward.gdn_recurrence``, which takes ``fused_recurrence``."""

    fused_recurrence: Callable

    def __call__(self, inputs: mx.array, mask: mx.array | None = None, cache=None) -> mx.array:
        B, S, _ = inputs.shape
        if self.sharding_group is not None:
            inputs = sum_gradients(self.sharding_group)(inputs)
        qkv, z, b, a = gdn_projections(self, inputs)
        conv_input = gdn_conv_input(self, qkv, mask, cache)
        q, k, v = gdn_conv_qkv(self, conv_input, B, S)
        out, state = gdn_recurrence(self, q, k, v, a, b, cache[1] if cache else None, mask)
        if cache is not None:
            cache[1] = state
            cache.advance(S)
        out = self.out_proj(self.norm(out, z).reshape(B, S, -1))
        if self.sharding_group is not None:
            out = mx.distributed.all_sum(out, group=self.sharding_group)
        return out


_classes: dict[tuple[type, Callable], type] = {}


def _fused_class(base: type, recurrence: Callable) -> type:
    key = (base, recurrence)
    if key not in _classes:
        _classes[key] = type(f"Fused{base.__name__}", (_FusedBlock, base),
                             {"fused_recurrence": staticmethod(recurrence), "_base": base})
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
        f = mx.float32
        err = (mx.abs(y.astype(f) - y_ref.astype(f)).max() / mx.maximum(mx.abs(y_ref.astype(f)).max(), 1e-6)).item()
        state_err = mx.abs(s - s_ref).max().item()
        stepwise = mx.array_equal(mx.concatenate([y0, y1], axis=1), y).item() and mx.array_equal(s1, s).item()
        strided = mx.array_equal(y_view, y).item() and mx.array_equal(s_view, s).item()
    except Exception as exc:  # noqa: BLE001 - a kernel that cannot compile or run here is refused, not fatal
        return f"the fused recurrence raised {type(exc).__name__}: {str(exc)[:300]}"
    if not err <= 0.02 or not state_err <= 1e-4:
        return f"the fused recurrence is off the reference: y by {err:.3g} of its range, the state by {state_err:.3g}"
    if not stepwise:
        return "the fused recurrence gives other bits for two tokens in one call than one at a time"
    if not strided:
        return "the fused recurrence reads views of its inputs wrong (other bits than the same values contiguous)"
    return None


def install(text_module, recurrence: Callable = gdn_fused.gated_delta_fused) -> int:
    """Swap every GatedDeltaNet layer onto ``recurrence``; returns how many. The caller checked
    ``refusal``; the traces of a compiled step made before hold the old forward."""
    n = 0
    for m in layers(text_module):
        base = getattr(type(m), "_base", type(m))
        m.__class__ = _fused_class(base, recurrence)
        n += 1
    return n


def uninstall(text_module) -> None:
    for m in layers(text_module):
        m.__class__ = getattr(type(m), "_base", type(m))


def installed(text_module) -> bool:
    return any(getattr(m, "fused_recurrence", None) is not None for m in layers(text_module))
