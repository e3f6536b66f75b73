"""What one request's caches take at a given context: the governor admits another row only
while the memory headroom holds it (governor/row_limit.py).

Counted from the model's shapes, with no forward: an attention layer keeps keys and values
for every position (its KV cache grows with the context), a GatedDeltaNet layer a state of
fixed size (its convolution's last kernel - 1 inputs, in the activations' dtype, and the
recurrent state per value head, in float32: what mlx-lm's ArraysCache holds).
"""

from __future__ import annotations

import mlx.core as mx

# mlx-lm's KVCache grows its buffers in steps of this many positions.
KV_STEP = 256


def row_cache_bytes(lm, context: int) -> int:
    """Bytes one row's caches take once it holds ``context`` positions."""
    a = lm.text_args
    act = lm.embed(mx.array([[1]])).dtype.size  # the activations' dtype, as the caches store them
    positions = -(-max(context, 1) // KV_STEP) * KV_STEP
    kv_layers = sum(1 for c in lm.make_cache() if "KV" in type(c).__name__)
    linear_layers = a.num_hidden_layers - kv_layers
    kv = 2 * a.num_key_value_heads * a.head_dim * act * positions
    nk, nv = getattr(a, "linear_num_key_heads", 0), getattr(a, "linear_num_value_heads", 0)
    dk, dv = getattr(a, "linear_key_head_dim", 0), getattr(a, "linear_value_head_dim", 0)
    conv = (getattr(a, "linear_conv_kernel_dim", 1) - 1) * (2 * nk * dk + nv * dv) * act
    recurrent = nv * dk * dv * mx.float32.size
    return kv_layers * kv + linear_layers * (conv + recurrent)
