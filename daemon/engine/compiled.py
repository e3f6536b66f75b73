"""A compiled one-token forward for decode steps (serial decode, speculation's serial step).

Why: a decode step of a small batch is bound by the number of kernels, not by bytes (on the
H200 a 27B-shaped step is ~3,500 kernels at ~6.5 us each; on CPU each op pays dispatch).
``mx.compile`` fuses the elementwise chains of a GatedDeltaNet layer (gates, conv SiLU,
norms, the gated RMSNorm, MLP activations) into fewer kernels and skips re-tracing Python.

What is compiled, for one sequence (B = 1) and short forwards (T <= MAX_T: a decode step,
a speculative verify of k + 1 tokens, snapshot rollback's re-forward of the accepted prefix):
- every linear-attention decoder layer whole: (x, conv_state, recurrent_state) ->
  (x', conv_state', recurrent_state'). Its state has a fixed shape, so one trace per T
  serves every step; capture rollback's variant also returns the per-token states;
- every full-attention layer's second half (residual + post-norm + MLP). The attention
  itself stays eager: its KV cache is written in place at a moving offset, which a trace
  cannot hold;
- the final norm.

Exactness: a compiled step is used only when it reproduces the eager forward bit for bit
(``self_check``: a few steps from a fixed prompt, both ways, every hidden state compared).
Fusion keeps every intermediate in its own dtype on the backends measured (CPU, CUDA), but
a backend or model where it does not is caught here, and the daemon keeps the eager path
(logged). So serial decode, speculation's serial step and the verify forward keep the
numerics the fidelity gate was proven on.

Anything else (a prompt chunk longer than MAX_T, a batch, a padded or masked cache, a
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

from .capture import capture_hidden
from .forward import cache_arrays, compiled_forward, gdn_capture_forward

SELF_CHECK_STEPS = 4
VERIFY_T = 4  # the self-check's verify length (depth 3)
# Longest forward compiled: verify is k + 1 <= 9 tokens; longer ones are prompt chunks,
# whose many distinct lengths would each cost a trace.
MAX_T = 16


def _linear_layer_step(layer: nn.Module) -> Callable:
    def step(x: mx.array, conv_state: mx.array, state: mx.array):
        c = ArraysCache(2)
        c[0], c[1] = conv_state, state
        y = layer(x, mask=None, cache=c)
        return y, c[0], c[1]

    return mx.compile(step)


def _linear_layer_capture(layer: nn.Module) -> Callable:
    def step(x: mx.array, conv_state: mx.array, state: mx.array):
        r, conv_input, states = gdn_capture_forward(layer.linear_attn, layer.input_layernorm(x), conv_state, state)
        h = x + r
        return (h + layer.mlp(layer.post_attention_layernorm(h)), conv_input, *states)

    return mx.compile(step)


def _attention_tail(layer: nn.Module) -> Callable:
    # mlx-lm's qwen3_5 / qwen3_next DecoderLayer: h = x + attn(norm(x)); h + mlp(norm2(h)).
    def tail(x: mx.array, r: mx.array) -> mx.array:
        h = x + r
        return h + layer.mlp(layer.post_attention_layernorm(h))

    return mx.compile(tail)


class CompiledDecode:
    """``hidden(tokens, cache)`` for one-token steps, with compiled layers; ``None`` from
    ``try_hidden`` means "not a step this handles, use the eager forward"."""

    def __init__(self, backbone: nn.Module):
        self.backbone = backbone
        self.layers = list(getattr(backbone, "pipeline_layers", backbone.layers))
        self.steps = [_linear_layer_step(l) if l.is_linear else _attention_tail(l) for l in self.layers]
        self.capture_steps = [_linear_layer_capture(l) if l.is_linear else None for l in self.layers]
        self.norm = mx.compile(lambda h: backbone.norm(h))
        self.fa_idx = getattr(backbone, "fa_idx", None)

    def applies(self, tokens: mx.array, cache: list | None) -> bool:
        if cache is None or tokens.ndim != 2 or tokens.shape[0] != 1 or not 1 <= tokens.shape[1] <= MAX_T:
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

    checks = [("step", run(False), run(True)),
              ("verify", verify(False, False), verify(True, False)),
              ("capture verify", verify(False, True), verify(True, True))]
    for what, eager, comp in checks:
        for i, (a, b) in enumerate(zip(eager, comp, strict=True)):
            if not mx.array_equal(a, b).item():
                diff = mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()
                return f"{what} {i}: compiled differs from eager by up to {diff:.3g}"
    return None


def enable_compiled_decode(lm, checked: Callable[[object, Callable[[], str | None]], str | None] | None = None
                           ) -> str | None:
    """Compile ``lm``'s one-token forward and switch ``lm.hidden`` to it when it is
    bit-identical to eager. Returns None when enabled, else why it was not.
    ``checked(lm, run_self_check)``, when given, answers for the self-check: the daemon
    reads a verdict stored by an earlier start (probe_verdicts.py) and runs the check only
    on a miss. The traces are made at their first call either way."""
    try:
        compiled = CompiledDecode(lm.backbone)
        run = partial(self_check, lm, compiled)
        reason = run() if checked is None else checked(lm, run)
    except Exception as exc:  # noqa: BLE001 - any model or backend that cannot: stay eager
        return f"compile failed: {type(exc).__name__}: {exc}"
    if reason is not None:
        return reason
    lm.compiled_decode = compiled
    return None
