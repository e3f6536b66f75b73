"""A compiled forward for decode steps and verifies: one row (serial decode, speculation's
serial step) and, once its own check passes, a batch of B rows (the continuous batch).

Why: a decode step of a small batch is bound by the number of kernels, not by bytes (on the
H200 a 27B-shaped step is ~3,500 kernels at ~6.5 us each; on CPU each op pays dispatch; an
eager B=4 step cost ~3.5 ms there against ~1.1 ms for one compiled row).
``mx.compile`` fuses the elementwise chains of a GatedDeltaNet layer (gates, conv SiLU,
norms, the gated RMSNorm, MLP activations) into fewer kernels and skips re-tracing Python.

What is compiled, for short forwards (T <= MAX_T: a decode step, a speculative verify of
k + 1 tokens, snapshot rollback's re-forward of the accepted prefix) of B rows:
- every linear-attention decoder layer whole: (x, conv_state, recurrent_state) ->
  (x', conv_state', recurrent_state'). Its state has a fixed shape per height, [B, ...], so
  one trace per (B, T) serves every step; capture rollback's variant also returns the
  per-token states;
- every full-attention layer but its middle: where the attention comes in parts (merged
  q, k, v: ``MergedAttention.project`` / ``finish``), the norm and projections before it and
  the gated output projection after it with the layer's second half (post-norm + MLP +
  residual); else that second half alone. The middle (RoPE at the cache's offset, the cache's
  update, the attention) stays eager: its KV cache is written in place at a moving offset, which a trace
  cannot hold; and it is where a batch's rows differ (left padding, a speculating batch's
  holes, per-row RoPE offsets), all carried by the mask and offsets the eager attention
  builds from the cache (BatchKVCache, ragged_cache.RaggedKVCache) at every step;
- the final norm.

Both residual adds of a layer are written by the matmul before them where it takes a residual
(forward.decoder_layer: the routed quantized linears on CUDA), with the bits of the add apart;
the eager forward the self-check compares against is mlx-lm's, which adds apart.

Heights: a trace per (B, T) (mx.compile keeps one per input shape), not shapeless: the
layers reshape to B-dependent shapes and split, which a shapeless trace cannot infer
("Split cannot infer output shapes", MLX 0.32.4), and not padded up to a bucket: a padded
row would change the matmuls' M, hence (on CUDA) their rounding, against the eager step at
the real height. A batch's heights are bounded (scheduler.batch_rows), so are its traces;
the warm-up makes them before ready on a GPU.

Batch rows need no mask in the compiled layers: a batch's GatedDeltaNet state is each
row's own, stacked on the batch axis (ArraysCache.merge of filled states: no left padding,
no lengths), so a row's step reads only its own state, as the eager layer does with a None
mask. A linear cache that carries left padding or lengths (mlx-lm's own batched prefill of
empty rows) masks its inputs: eager.

Exactness: a compiled step is used only when it reproduces the eager forward bit for bit
(``self_check``, on one layer of each kind (``LoadedModel.layer_kinds_view``): a few steps
from a fixed prompt, both ways, every hidden state compared;
for batches, ``compiled_batch.batch_self_check``: the plain and the speculating batch at
two heights, padded and holed rows). Fusion keeps every intermediate in its own dtype on
the backends measured (CPU, CUDA), but a backend or model where it does not is caught
here, and the daemon keeps the eager path (logged; ``LoadedModel.batch_decode_path`` says
which the batch takes). The batch's check runs only when the one-row check passed; a batch
that fails it stays eager while one row stays compiled. So serial decode, the batch and
the verify forwards keep the numerics the fidelity gate was proven on.

Anything else (a prompt chunk longer than MAX_T, a padded or masked linear cache, a
pipeline-parallel model, a first step with an empty linear cache) takes the eager forward.

The traces hold the weights they were made with: a model whose weights change afterwards
(quantized in place, say) needs ``enable_compiled_decode`` again.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache

from ..kernels.forward import cache_arrays, compiled_forward, decoder_layer, gdn_capture_forward, with_residual
from ..pieces import pause
from .capture import capture_hidden
from .compiled_batch import batch_self_check

SELF_CHECK_STEPS = 4
VERIFY_T = 4  # the self-check's verify length (depth 3)
# Longest forward compiled: verify is k + 1 <= 9 tokens; longer ones are prompt chunks,
# whose many distinct lengths would each cost a trace.
MAX_T = 16


def _linear_layer_step(layer: nn.Module) -> Callable:
    def step(x: mx.array, conv_state: mx.array, state: mx.array):
        c = ArraysCache(2)
        c[0], c[1] = conv_state, state
        y = decoder_layer(layer, x, None, c)
        return y, c[0], c[1]

    return mx.compile(step)


def _linear_layer_capture(layer: nn.Module) -> Callable:
    def step(x: mx.array, conv_state: mx.array, state: mx.array):
        h, conv_input, states = gdn_capture_forward(layer.linear_attn, layer.input_layernorm(x), conv_state, state,
                                                    residual=x)
        return (with_residual(layer.mlp, layer.post_attention_layernorm(h), h), conv_input, *states)

    return mx.compile(step)


def _attention_tail(layer: nn.Module) -> Callable:
    # mlx-lm's qwen3_5 / qwen3_next DecoderLayer: h = x + attn(norm(x)) (eager, in
    # forward.compiled_forward); h + mlp(norm2(h)).
    def tail(h: mx.array) -> mx.array:
        return with_residual(layer.mlp, layer.post_attention_layernorm(h), h)

    return mx.compile(tail)


# False: every attention eager up to its traced tail, as before 2026-12-06 evening (an A/B arm).
TRACE_ATTENTION_PARTS = True


def _attention_parts(layer: nn.Module) -> tuple[Callable, Callable] | None:
    # An attention that comes in parts (merged_linears.MergedAttention and its invariant
    # subclass): the norm and projections traced before the eager middle (RoPE, the cache's
    # update, the attention), the gated output projection traced with the tail after it. The
    # 16 attention layers of a 27B step were ~2 ms of its host time eager (~125 us each,
    # bench/results/h100_2026-12-06b).
    attn = layer.self_attn
    if not TRACE_ATTENTION_PARTS or not all(hasattr(attn, f) for f in ("project", "attend_cached", "finish")):
        return None

    def head(x: mx.array):
        return attn.project(layer.input_layernorm(x))

    def tail(x: mx.array, output: mx.array, gate: mx.array) -> mx.array:
        h = attn.finish(output, gate, x)
        return with_residual(layer.mlp, layer.post_attention_layernorm(h), h)

    return mx.compile(head), mx.compile(tail)


class CompiledDecode:
    """``hidden(tokens, cache)`` for short forwards, with compiled layers; ``None`` from
    ``try_hidden`` means "not a step this handles, use the eager forward". Batches of
    B >= 2 rows only while ``batched`` (set once ``batch_self_check`` passed; else
    ``batch_reason`` says why not)."""

    def __init__(self, backbone: nn.Module):
        self.backbone = backbone
        self.layers = list(getattr(backbone, "pipeline_layers", backbone.layers))
        self.steps = [_linear_layer_step(l) if l.is_linear else _attention_tail(l) for l in self.layers]
        self.capture_steps = [_linear_layer_capture(l) if l.is_linear else None for l in self.layers]
        self.attention_parts = [None if l.is_linear else _attention_parts(l) for l in self.layers]
        self.norm = mx.compile(lambda h: backbone.norm(h))
        self.fa_idx = getattr(backbone, "fa_idx", None)
        self.batched = False
        self.batch_reason = "not checked"

    def applies(self, tokens: mx.array, cache: list | None) -> bool:
        if cache is None or tokens.ndim != 2 or not 1 <= tokens.shape[1] <= MAX_T:
            return False
        if tokens.shape[0] != 1 and not self.batched:
            return False
        if len(cache) != len(self.layers):
            return False
        if getattr(self.backbone, "pipeline_size", 1) > 1:
            return False
        for layer, c in zip(self.layers, cache):
            if layer.is_linear:
                if not isinstance(c, ArraysCache) or c.lengths is not None or c.left_padding is not None:
                    return False
                if c[0] is None or c[1] is None:  # first step of an empty cache: eager builds them
                    return False
                if c[1].shape[0] != tokens.shape[0]:  # not this cache's rows: let eager say so
                    return False
        return True

    def try_hidden(self, tokens: mx.array, cache: list | None) -> mx.array | None:
        if not self.applies(tokens, cache):
            return None
        return compiled_forward(self, tokens, cache, None)

    def capture_hidden(self, tokens: mx.array, cache: list, rec: list) -> mx.array:
        """rollback.capture_hidden's forward, compiled (the caller checked ``applies``)."""
        return compiled_forward(self, tokens, cache, rec)


def self_check(lm, compiled: CompiledDecode, steps: int = SELF_CHECK_STEPS) -> str | None:
    """Decode ``steps`` greedy tokens from a fixed prompt eagerly and compiled, on fresh
    caches; None when every hidden state is bit-identical, else the reason it is not."""
    vocab = lm.text_args.vocab_size
    prompt = mx.array([[(7 * i + 3) % vocab for i in range(8)]], dtype=mx.uint32)

    def run(use_compiled: bool) -> list[mx.array]:
        cache = lm.make_cache()
        lm.backbone(prompt, cache)  # eager prefill builds every state
        tok = prompt[:, -1:]
        out = []
        for _ in range(steps):
            h = compiled.try_hidden(tok, cache) if use_compiled else lm.backbone(tok, cache)
            if h is None:
                raise RuntimeError("the compiled step declined a plain one-token step")
            tok = mx.argmax(lm.logits(h)[:, -1, :], axis=-1).reshape(1, 1).astype(mx.uint32)
            mx.eval(h, tok)
            out.append(h)
        return out

    def verify(use_compiled: bool, capture: bool) -> list[mx.array]:
        saved = lm.compiled_decode
        lm.compiled_decode = compiled if use_compiled else None
        try:
            cache = lm.make_cache()
            lm.backbone(prompt, cache)
            block = prompt[:, :VERIFY_T]
            rec: list = []
            h = capture_hidden(lm, block, cache, rec) if capture else lm.hidden(block, cache)
            if use_compiled and not compiled.applies(block, cache):
                raise RuntimeError(f"the compiled step declined a {VERIFY_T}-token verify")
            out = [h] + [s for cap in rec for s in cap.states] + cache_arrays(cache)
            mx.eval(out)
            return out
        finally:
            lm.compiled_decode = saved

    checks = []
    # A piece per arm when run piecewise (pieces.py): never inside verify()'s swap of the step.
    for what, arm in (("step", run), ("verify", lambda c: verify(c, False)),
                      ("capture verify", lambda c: verify(c, True))):
        eager = arm(False)
        pause()
        checks.append((what, eager, arm(True)))
        pause()
    for what, eager, comp in checks:
        for i, (a, b) in enumerate(zip(eager, comp, strict=True)):
            if not mx.array_equal(a, b).item():
                diff = mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()
                return f"{what} {i}: compiled differs from eager by up to {diff:.3g}"
    return None


def enable_compiled_decode(lm, checked: Callable[..., str | None] | None = None) -> str | None:
    """Compile ``lm``'s short forwards and switch ``lm.hidden`` to them when bit-identical
    to eager. Returns None when the one-row step is enabled, else why it was not; batches
    run compiled as well when their own check passes (``compiled.batched``; else
    ``compiled.batch_reason``, which ``lm.batch_decode_path`` reports).
    ``checked(lm, run_check, variant)``, when given, answers for a check ("self_check" for
    one row, "batch_self_check" for batches): the daemon reads a verdict stored by an
    earlier start (probe_verdicts.py) and runs the check only on a miss. The traces are
    made at their first call either way."""
    compiled, reason = checked_compiled_decode(lm, checked)
    if compiled is not None:
        lm.compiled_decode = compiled
    return reason


def checked_compiled_decode(lm, checked: Callable[..., str | None] | None = None) -> tuple[CompiledDecode | None, str | None]:
    """``enable_compiled_decode``'s checks without the switch: the checked step (None where
    the one-row check failed) and why not. The daemon's start-up runs this piecewise while it
    serves eagerly (engine/pieces.py) and switches the step in afterwards."""
    try:
        compiled = CompiledDecode(lm.backbone)
        # The checks run one layer of each kind (``LoadedModel.layer_kinds_view``), compiled
        # by the same builders: a layer's compiled step is its own trace of its own kind's
        # code (no trace spans two layers), and MLX picks kernels by shapes and dtypes, so
        # one layer of a kind giving eager's bits answers for every layer of it. On this
        # project's 2-core CPU the checks of the bundled model's 6 layers took ~1.2 s of a
        # fresh start's first round; a 64-layer Qwen3.5 still runs 2. A pipeline-split
        # backbone is its own view (whole).
        view = lm.layer_kinds_view()
        probe = compiled if view is lm else CompiledDecode(view.backbone)
        run = partial(self_check, view, probe)
        reason = run() if checked is None else checked(lm, run, "self_check")
    except Exception as exc:  # noqa: BLE001 - any model or backend that cannot: stay eager
        return None, f"compile failed: {type(exc).__name__}: {exc}"
    if reason is not None:
        return None, reason
    compiled.batched = probe.batched = True  # admit batches while their check runs
    try:
        run = partial(batch_self_check, view, probe)
        reason = run() if checked is None else checked(lm, run, "batch_self_check")
    except Exception as exc:  # noqa: BLE001 - batches stay eager; one row keeps its proven step
        reason = f"compile failed: {type(exc).__name__}: {exc}"
    compiled.batched = reason is None
    compiled.batch_reason = reason or ""
    return compiled, None
