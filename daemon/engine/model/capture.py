"""The backbone forward with capture (capture rollback's verify): ``lm.hidden`` op for op,
with every linear layer's GatedDeltaNet block recording its per-token states into ``rec``
(forward.py's ``gdn_capture``). It takes a loaded model, so it sits above model.py, while
the block-level walks it uses sit below it (model.py reaches them through
chunked_prefill.py): dependencies point one way, capture -> model -> forward.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask, create_ssm_mask

from ..kernels.forward import backbone_layers, gdn_capture
from .model import LoadedModel


def capture_hidden(lm: LoadedModel, tokens: mx.array, cache: list, rec: list) -> mx.array:
    """``lm.hidden`` with capture: qwen3_5/qwen3_next backbone forward, op for op."""
    compiled = lm.compiled_decode
    if compiled is not None and compiled.applies(tokens, cache):
        return compiled.capture_hidden(tokens, cache, rec)
    bb = lm.backbone
    h = bb.embed_tokens(tokens)
    layers = backbone_layers(bb)
    fa_mask = create_attention_mask(h, cache[bb.fa_idx]) if bb.fa_idx is not None else None
    ssm_mask = create_ssm_mask(h, cache[bb.ssm_idx]) if bb.ssm_idx is not None else None
    for layer, c in zip(layers, cache):
        if layer.is_linear:
            r = gdn_capture(layer.linear_attn, layer.input_layernorm(h), ssm_mask, c, rec)
            h = h + r
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        else:
            h = layer(h, mask=fa_mask, cache=c)
    return bb.norm(h)
