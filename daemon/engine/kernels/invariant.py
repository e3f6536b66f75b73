"""Matmuls and attention whose result for a row does not depend on who else is in the forward.

Exact mode promises serial decode's tokens. Where MLX's kernels round a row differently
depending on how many rows and positions share the forward (measured on the H200: a
T-position forward gives other bits than T one-token steps, and a left-padded or holed row
other bits than the same row alone), exact rows could neither batch nor speculate. Both
kinds of kernel do it there: bf16 matmuls at the bundled model's own shapes, and the fused
attention, which picks its kernel and its key blocking by the number of queries and the
padded key length (bench/probes/invariance_trace.py finds the first module that differs).

The fix is two kernels, written for CUDA (``mx.fast.cuda_kernel``) and Metal
(``mx.fast.metal_kernel``), and the classes that route a model through them:

``invariant_matmul`` (every plain nn.Linear, and the tied output head) sums each output
element in an order fixed by the input dimension alone: one warp per output column, each
lane a fixed share of K, then a fixed butterfly. MLX's own matmul on the H200 gives a row
other bits at M = 2..16 than at M = 1 even at the bundled model's shapes (768x256, 512x256).

A quantized model's linears (``nn.QuantizedLinear``, a quantized tied head) take the same
kind of fixed-order kernel for MLX's affine 2/4/8-bit groups: engine/kernels/invariant_quant.py,
which ``install`` routes them to (a layout that kernel cannot take stays MLX's, with its
reason in ``REFUSED``, and the probes decide).

``invariant_sdpa`` (with ``invariant_matmul`` in engine/kernels/invariant_kernels.py) computes one query's attention in chunks of its visible keys, one warp
(one SIMD group on Metal) per chunk: the lanes split the head dimension, and the chunk's keys
are visited one at a time in their cache order, skipping every key the mask hides (left
padding, holes punched by a rejected verify, future positions); the chunks are merged in
order. Each visit is a dot product summed by a fixed butterfly of shuffles
(commutative at every step, so every lane holds the same sum), then an online-softmax update
in float32. A row's keys are thus reduced in the same order, with the same operations,
whether the row is alone or one of 16, whether the forward holds 1 position or 8, wherever
its keys sit in the batch's buffer. It is slower than MLX's fused attention (no tensor
cores, a key at a time within a chunk), which is the price of the promise; it is used only
where a start-up probe (exactness.py) proves MLX's own path is not invariant and this one
is (``engine.kernels`` in the log and ``kernels`` in status say so).

On the CPU there is no custom-kernel backend; MLX's CPU kernels are invariant already
(every class of the probes is one), so ``kernels = auto`` keeps them, and a forced
``kernels = invariant`` (the tests) computes with ``reference_sdpa`` and a plain matmul.
``reference_sdpa`` is
the same arithmetic in plain MLX ops (float32, one query at a time is not needed for a
reference), used by tests to check the mask conversion and by the probe script.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_next

from . import invariant_kernels, invariant_quant
from .invariant_kernels import (CHUNK, MATMUL_TILE, backend, gemv_key, invariant_matmul,  # noqa: F401 (re-exported)
                                invariant_sdpa, reference_sdpa, visible_keys)
from .merged_linears import MergedAttention

# Forwards of more rows (batch rows x positions) than this take MLX's own matmul and
# attention: prompt chunks, which are deterministic for a given prompt and chunking. Every
# decode step, verify and batched step must stay under it, so ``install`` raises it to the
# largest such forward the daemon's configuration allows.
MAX_ROWS = 64
# Test hook (config ``debug_perturb_invariant_batch``): scale the output of every invariant
# matmul over more than one row by (1 + 2**-6), so batched and multi-position forwards stop
# matching one-row ones and the start-up probe must refuse the invariant path.
PERTURB_BATCHED = False


def _rows(x: mx.array) -> int:
    n = 1
    for d in x.shape[:-1]:
        n *= d
    return n


class InvariantAttention(MergedAttention):
    """mlx-lm's gated attention (op for op, qwen3_next.Qwen3NextAttention.__call__, through
    merged_linears.MergedAttention, whose q, k and v are one matmul where merged) with
    ``invariant_sdpa`` in place of the fused attention. ``install`` swaps a loaded model's
    attention layers to this class; their weights and submodules stay as they are."""

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array, cache: Any, mask: Any) -> mx.array:
        """The attention proper for queries [B, H, L, D] (after rope and the cache update):
        the invariant kernel for decode-sized forwards, MLX's fused one for a prompt chunk.
        mixed_forward.py calls it per group, so a group gets the kernel its own forward would."""
        B, _, L, _ = queries.shape
        if B * L > MAX_ROWS:  # a prompt chunk: MLX's fused attention
            return qwen3_next.scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale,
                                                           mask=mask)
        return invariant_sdpa(queries, keys, values, self.scale, mask)


class InvariantLinear(nn.Linear):
    """nn.Linear through ``invariant_matmul`` for forwards of at most MAX_ROWS rows."""

    def __call__(self, x: mx.array) -> mx.array:
        if _rows(x) > MAX_ROWS or x.dtype != self.weight.dtype:
            return super().__call__(x)
        y = _perturbed(invariant_matmul(x, self.weight))
        return y + self.bias if "bias" in self else y


class InvariantEmbedding(nn.Embedding):
    """A tied output head (``as_linear``) through ``invariant_matmul``."""

    def as_linear(self, x: mx.array) -> mx.array:
        if _rows(x) > MAX_ROWS or x.dtype != self.weight.dtype:
            return super().as_linear(x)
        return _perturbed(invariant_matmul(x, self.weight))


def _perturbed(y: mx.array) -> mx.array:
    if PERTURB_BATCHED and _rows(y) > 1:
        return y * (1 + 2**-6)
    return y


def invariant_quantized_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
                               bits: int, **launch) -> mx.array:
    """x [..., K] times MLX's affine-quantized w [N, K] transposed, every output summed in an
    order fixed by K alone (engine/kernels/invariant_quant.py); on the CPU its reference ops.
    ``residual=`` adds it (in the kernel's writes where it can: the same bits)."""
    return invariant_quant.quantized_matmul(x, w, scales, biases, group_size, bits, backend(), **launch)


def _quant_routable(x: mx.array) -> bool:
    return _rows(x) <= MAX_ROWS and x.dtype in invariant_quant.FLOAT_INPUTS


class InvariantQuantizedLinear(nn.QuantizedLinear):
    """nn.QuantizedLinear through ``invariant_quantized_matmul`` for forwards of at most
    MAX_ROWS rows (a prompt chunk takes MLX's ``quantized_matmul``). ``install`` swaps only
    layers ``invariant_quant.refusal`` accepts."""

    def __call__(self, x: mx.array) -> mx.array:
        if not _quant_routable(x):
            return super().__call__(x)
        y = _perturbed(invariant_quantized_matmul(x, self["weight"], self["scales"], self["biases"],
                                                  self.group_size, self.bits))
        return y + self["bias"] if "bias" in self else y

    def plus(self, x: mx.array, residual: mx.array) -> mx.array:
        """``residual + self(x)`` (forward.with_residual), the add in the kernel's writes where it
        can take it: the same bits."""
        if not _quant_routable(x) or "bias" in self or (PERTURB_BATCHED and _rows(x) > 1):
            return residual + self(x)
        return invariant_quantized_matmul(x, self["weight"], self["scales"], self["biases"], self.group_size,
                                          self.bits, residual=residual)


class InvariantQuantizedEmbedding(nn.QuantizedEmbedding):
    """A quantized tied output head (``as_linear``) through ``invariant_quantized_matmul``;
    the lookup (a gather and an elementwise dequantize) is MLX's, already row by row."""

    def as_linear(self, x: mx.array) -> mx.array:
        if not _quant_routable(x):
            return super().as_linear(x)
        return _perturbed(invariant_quantized_matmul(x, self["weight"], self["scales"], self["biases"],
                                                     self.group_size, self.bits))


_SWAPS = {qwen3_next.Qwen3NextAttention: InvariantAttention, nn.Linear: InvariantLinear, nn.Embedding: InvariantEmbedding,
          nn.QuantizedLinear: InvariantQuantizedLinear, nn.QuantizedEmbedding: InvariantQuantizedEmbedding,
          MergedAttention: InvariantAttention}
_BACK = {v: k for k, v in _SWAPS.items() if k is not MergedAttention}
_QUANTIZED = (InvariantQuantizedLinear, InvariantQuantizedEmbedding)


def attention_layers(backbone) -> list:
    return [layer.self_attn for layer in backbone.layers if hasattr(layer, "self_attn")]


# What the last ``install`` left MLX's and why: {module path: reason}.
REFUSED: dict[str, str] = {}


def install(text_module, max_rows: int = MAX_ROWS, *, quantized_only: bool = False) -> int:
    """Raise MAX_ROWS to ``max_rows`` (the largest decode forward the caller will run) and
    swap ``text_module``'s gated attention, plain linear layers and embedding (the tied
    output head), and its quantized linears and quantized embedding (engine/kernels/invariant_quant.py),
    to their invariant classes, in place (weights untouched); returns how many modules were
    swapped. A quantized layer the kernel cannot take (``invariant_quant.refusal``) and
    foreign layers are left as they are (the refused ones, with the reason, in ``REFUSED``):
    the start-up probe (exactness.py) then finds the model not invariant and says so.
    ``quantized_only`` swaps the quantized layers alone: on CUDA their decode forwards then run
    on the tensor-core kernel (engine/kernels/quant_mma.py), faster than MLX's at every height it
    takes, whatever the exactness of the rest of the model."""
    global MAX_ROWS
    MAX_ROWS = max(MAX_ROWS, max_rows)
    REFUSED.clear()
    n = 0
    for path, m in text_module.named_modules():
        cls = _SWAPS.get(type(m))
        if cls is None or (quantized_only and cls not in _QUANTIZED):
            continue
        if cls in _QUANTIZED:
            why = invariant_quant.refusal(m)
            if why is not None:
                REFUSED[path] = why
                continue
        m.__class__ = cls
        n += 1
    if backend() == "cuda":
        verify_dense_rows(text_module)
    return n


# What the last ``verify_dense_rows`` found: {"matched": shapes, "mismatched": {shape: why}, "error": ...}.
DENSE_ROWS: dict = {}


def verify_dense_rows(text_module) -> dict:
    """Check ``gemv_rows`` (engine/kernels/invariant_kernels.py) against MLX's gemv for every
    swapped dense layer's weight (its shape and dtype; outside any compiled trace): the shapes that match take it
    from two rows on and MLX's gemv for one, the others keep the fixed-order kernel. A kernel
    that does not compile here leaves every shape on the fixed-order one (``error`` says why)."""
    weights = [m.weight for _, m in text_module.named_modules() if type(m) in (InvariantLinear, InvariantEmbedding)]
    DENSE_ROWS.clear()
    try:
        invariant_kernels.verify_gemv_rows(weights)
    except Exception as exc:  # noqa: BLE001 - the fixed-order kernel serves; the probes decide as before
        DENSE_ROWS["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    shapes = {gemv_key(w) for w in weights}
    DENSE_ROWS["matched"] = sorted(f"{n}x{k} {d}" for n, k, d in shapes & invariant_kernels.GEMV_MATCHED)
    DENSE_ROWS["mismatched"] = {f"{n}x{k} {d}": why for (n, k, d), why in invariant_kernels.GEMV_MISMATCHED.items()
                                if (n, k, d) in shapes}
    return DENSE_ROWS


def restore_classes(text_module, back: dict) -> None:
    """Put every module whose class is a key of ``back`` back on its value (a swap undone)."""
    for _, m in text_module.named_modules():
        cls = back.get(type(m))
        if cls is not None:
            m.__class__ = cls


def holds_classes(text_module, classes) -> bool:
    return any(type(m) in classes for _, m in text_module.named_modules())


def uninstall(text_module) -> None:
    restore_classes(text_module, _BACK)
    for _, m in text_module.named_modules():  # a merged attention goes back to the merged class
        if type(m) is qwen3_next.Qwen3NextAttention and "qkv_proj_merged" in m:
            m.__class__ = MergedAttention


def installed(text_module) -> bool:
    return holds_classes(text_module, _BACK)
