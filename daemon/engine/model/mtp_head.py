"""The native multi-token-prediction (MTP) head of Qwen3.5 / Qwen3-Next checkpoints.

mlx-lm's ``sanitize`` drops every ``mtp.*`` tensor, so the head is loaded here, separately:
from the checkpoint's own safetensors (reading only the head's tensors, shard by shard,
through ``mx.load``) or from a sidecar (``mtp.safetensors``, ``model-mtp.safetensors``); the
names and dtypes accepted are listed in ``daemon/models/layout.py``.

Forward for the pair (base hidden at t, token t+1)::

    e = pre_fc_norm_embedding(embed(token t+1))     # embedding first
    h = pre_fc_norm_hidden(base hidden at t)        # final-normed base hidden
    x = fc(concat[e, h])                            # [2H] -> [H]
    x = decoder layer (gated full attention + MLP/MoE) with the head's own KV cache
    out = norm(x)                                   # fed back at depth > 1
    logits = the base model's (possibly tied) lm_head(out)

The head's attention is mlx-lm's ``Qwen3NextAttention``: its q_proj is twice as wide and the
class splits it per head into query channels then gate channels (``reshape(B, L, H, -1)``
then ``split(2)``), applying ``sigmoid(gate)`` before ``o_proj``. HF checkpoints store norm
weights zero-centred (scale = 1 + w); loading applies the same +1 that mlx-lm applies to the
base's input/post-attention/q/k/final norms, to all five head norms. fc and norms are never
quantized; the rest follows the base's quantization, module by module.

The head holds weights only. Its KV cache is per request (``make_cache``), so interleaved
requests never share head history.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .head_layout import SIDECARS, head_files, head_tensor_shapes, is_mtp_key, read_header, shard_files, strip_mtp

from .model import HYBRID_MTP_TYPES, LoadedModel

_NORM_SUFFIXES = (
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "q_norm.weight",
    "k_norm.weight",
)


class NoMTPHead(Exception):
    """The model has no MTP head (wrong family, or no ``mtp.*`` tensors anywhere)."""


class MTPLayer(nn.Module):
    """One gated full-attention decoder layer, as the base's attention layers are built."""

    def __init__(self, args: Any, moe: bool):
        super().__init__()
        from mlx_lm.models.qwen3_next import Qwen3NextAttention, Qwen3NextMLP, Qwen3NextSparseMoeBlock

        self.self_attn = Qwen3NextAttention(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.mlp = Qwen3NextSparseMoeBlock(args) if moe else Qwen3NextMLP(args.hidden_size, args.intermediate_size)

    def __call__(self, x: mx.array, mask: Any, cache: Any) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class MTPHead(nn.Module):
    def __init__(self, args: Any, moe: bool = False, num_layers: int = 1, dedicated_embeddings: bool = False):
        super().__init__()
        hsz, eps = args.hidden_size, args.rms_norm_eps
        if dedicated_embeddings:  # config mtp_use_dedicated_embeddings: the head's own table
            self.embed_tokens = nn.Embedding(args.vocab_size, hsz)
        self.fc = nn.Linear(2 * hsz, hsz, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(hsz, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hsz, eps=eps)
        self.layers = [MTPLayer(args, moe) for _ in range(num_layers)]
        self.norm = nn.RMSNorm(hsz, eps=eps)
        self._lm: LoadedModel | None = None
        self.moe = moe
        self.unloaded = False

    # -- forward -------------------------------------------------------------------------

    def make_cache(self) -> list:
        from mlx_lm.models.cache import KVCache

        return [KVCache() for _ in self.layers]

    def __call__(self, hidden: mx.array, tokens: mx.array, cache: list) -> mx.array:
        """hidden [B, T, H] (final-normed base hidden, or the head's own output at depth > 1),
        tokens [B, T] (token t+1 for hidden t). Returns the head's output hidden [B, T, H]
        (after mtp.norm). Writes T slots to ``cache``."""
        if self.unloaded:
            raise RuntimeError("MTP head was unloaded")
        from mlx_lm.models.base import create_attention_mask

        embed = self.embed_tokens if "embed_tokens" in self else self._lm.embed
        e = self.pre_fc_norm_embedding(embed(tokens))
        h = self.pre_fc_norm_hidden(hidden)
        x = self.fc(mx.concatenate([e, h], axis=-1))
        mask = create_attention_mask(x, cache[0])
        for layer, c in zip(self.layers, cache):
            x = layer(x, mask, c)
        return self.norm(x)

    def logits(self, out: mx.array) -> mx.array:
        return self._lm.logits(out)

    # -- residency -----------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for _, v in tree_flatten(self.parameters()))

    def unload(self) -> None:
        """Drop every weight this head holds and return MLX's cached buffers. The caller
        must drop its own references too (and its per-request head caches)."""
        for key in list(self.keys()):
            del self[key]
        self._lm = None
        self.unloaded = True
        mx.clear_cache()


# -- loading --------------------------------------------------------------------------------

def read_tensors(path: Path, select) -> tuple[dict[str, mx.array], dict]:
    """The tensors of one safetensors file whose names satisfy ``select``, through
    ``mx.load`` (lazy: only the selected tensors are ever read from disk), and the file's
    metadata. F8_E4M3 tensors (``mx.load`` hands them over as raw uint8) are dequantized to
    bfloat16, with their ``<name>_scale_inv`` block scales where the file has them (FP8
    releases: one scale per 128x128 block)."""
    header = read_header(path)  # also refuses a truncated file with a clear message
    arrays, meta = mx.load(str(path), return_metadata=True)
    out: dict[str, mx.array] = {}
    for name, arr in arrays.items():
        if not select(name) or name.endswith("_scale_inv"):
            continue
        dtype = header[name]["dtype"]
        if dtype.startswith("F8_"):
            if dtype != "F8_E4M3":
                raise NoMTPHead(f"{path.name}: tensor {name} has dtype {dtype}; only F8_E4M3 is supported")
            arr = _dequantize_fp8(arr, arrays.get(name + "_scale_inv"))
        elif dtype == "F64":
            arr = arr.astype(mx.float32)
        out[name] = arr
    return out, dict(meta or {})


def _dequantize_fp8(raw: mx.array, scale_inv: mx.array | None) -> mx.array:
    w = mx.from_fp8(raw, dtype=mx.float32)
    if scale_inv is not None:  # [ceil(rows/B), ceil(cols/B)] -> one value per weight
        rows, cols = w.shape
        b_r, b_c = -(-rows // scale_inv.shape[0]), -(-cols // scale_inv.shape[1])
        s = mx.repeat(mx.repeat(scale_inv.astype(mx.float32), b_r, axis=0), b_c, axis=1)[:rows, :cols]
        w = w * s
    return w.astype(mx.bfloat16)


def find_mtp_tensors(folder: Path) -> tuple[dict[str, mx.array], str, dict]:
    """Return (tensors without the ``mtp.`` prefix, source description, metadata).
    Looks in the checkpoint's shards first (via the index where there is one), then in
    the sidecars (``layout.SIDECARS``). Raises NoMTPHead when none holds any."""
    folder = Path(folder)
    files = head_files(folder)
    tensors: dict[str, mx.array] = {}
    meta: dict = {}
    for f in files:
        sidecar = f.name in SIDECARS
        got, m = read_tensors(f, (lambda k: True) if sidecar else is_mtp_key)
        meta = meta or m
        tensors.update({(strip_mtp(k) if is_mtp_key(k) else k): v for k, v in got.items()})
    if tensors:
        kind = "sidecar" if all(f.name in SIDECARS for f in files) else "checkpoint"
        return tensors, f"{kind} ({', '.join(f.name for f in files)})", meta
    raise NoMTPHead(
        f"no MTP head for {folder}: no 'mtp.*' tensors in the checkpoint's safetensors and no "
        f"{' / '.join(SIDECARS)} sidecar; speculation is unavailable, serve serial decode "
        "(`councild model pull REPO --mtp-from SOURCE` adds one)"
    )


def _zero_centred(weights: dict[str, mx.array], meta: dict, checkpoint_is_hf: bool) -> bool:
    """Whether the head's norm weights are stored HF-style (scale = 1 + w)."""
    if meta.get("format") != "mlx" or checkpoint_is_hf:
        return True
    # An mlx-format file with mtp tensors: decide by value (shifted norms sit near 1).
    norms = [v for k, v in weights.items() if k.endswith(_NORM_SUFFIXES) or k == "norm.weight"]
    mean = mx.mean(mx.concatenate([n.astype(mx.float32).reshape(-1) for n in norms])).item()
    return abs(mean) < 0.5


def sanitize_mtp(weights: dict[str, mx.array], zero_centred: bool, num_experts: int) -> dict[str, mx.array]:
    out = dict(weights)
    # MoE: stack per-expert weights (or split a fused gate_up) into switch_mlp, as mlx-lm does.
    layer_ids = sorted({int(k.split(".")[1]) for k in out if k.startswith("layers.")})
    for li in layer_ids:
        prefix = f"layers.{li}.mlp"
        if f"{prefix}.experts.gate_up_proj" in out:
            gate_up = out.pop(f"{prefix}.experts.gate_up_proj")
            mid = gate_up.shape[-2] // 2
            out[f"{prefix}.switch_mlp.gate_proj.weight"] = gate_up[..., :mid, :]
            out[f"{prefix}.switch_mlp.up_proj.weight"] = gate_up[..., mid:, :]
            out[f"{prefix}.switch_mlp.down_proj.weight"] = out.pop(f"{prefix}.experts.down_proj")
        elif f"{prefix}.experts.0.up_proj.weight" in out:
            for n in ("up_proj", "down_proj", "gate_proj"):
                out[f"{prefix}.switch_mlp.{n}.weight"] = mx.stack(
                    [out.pop(f"{prefix}.experts.{e}.{n}.weight") for e in range(num_experts)]
                )
    if zero_centred:
        for k, v in out.items():
            if (k.endswith(_NORM_SUFFIXES) or k == "norm.weight") and v.ndim == 1:
                out[k] = v + 1.0
    return out


def _base_attention_layer(lm: LoadedModel) -> nn.Module:
    for layer in lm.backbone.layers:
        if not getattr(layer, "is_linear", False):
            return layer
    raise NoMTPHead(f"{lm.path}: the base model has no full-attention layer to mirror")


def _quantize_like_base(head: MTPHead, lm: LoadedModel, prequantized: set[str], declared: dict | None = None) -> None:
    """Quantize every head Linear whose counterpart in the base's attention layer is
    quantized, with that module's group size / bits / mode. fc and norms stay as they are.
    ``declared``: per-module parameters a sidecar's metadata states (``councild_quantization``),
    which win for the modules the file holds quantized."""
    declared = declared or {}
    ref = _base_attention_layer(lm)
    ref_modules = dict(ref.named_modules())
    default = None
    for _, m in ref_modules.items():
        if isinstance(m, (nn.QuantizedLinear,)) or hasattr(m, "bits") and hasattr(m, "group_size"):
            default = m
            break
    if default is None and not prequantized and not declared:
        return

    def params_of(m: nn.Module) -> dict:
        return {"group_size": m.group_size, "bits": m.bits, "mode": getattr(m, "mode", "affine")}

    def predicate(path: str, module: nn.Module):
        if path in ("fc", "embed_tokens") or not hasattr(module, "to_quantized"):
            return False
        # layers.0.self_attn.q_proj -> self_attn.q_proj in the base's attention layer
        sub = path.split(".", 2)[2] if path.startswith("layers.") else path
        base_m = ref_modules.get(sub)
        if path in prequantized:
            if path in declared:
                return dict(declared[path])
            if base_m is not None and hasattr(base_m, "bits") and hasattr(base_m, "group_size"):
                return params_of(base_m)
            return params_of(default) if default is not None else True
        if base_m is not None and hasattr(base_m, "bits") and hasattr(base_m, "group_size"):
            return params_of(base_m)
        return False

    nn.quantize(head, class_predicate=predicate)


def load_mtp_head(lm: LoadedModel, folder: str | Path | None = None, zero_centred: bool | None = None) -> MTPHead:
    """Load the MTP head of ``lm`` (from ``folder``, default the model's own folder)."""
    if lm.model_type not in HYBRID_MTP_TYPES:
        raise NoMTPHead(f"{lm.path}: model type {lm.model_type!r} has no native MTP head (serial only)")
    folder = Path(folder) if folder is not None else lm.path
    weights, source, meta = find_mtp_tensors(folder)
    args = lm.text_args
    moe = any(".mlp.experts." in k or ".mlp.switch_mlp." in k for k in weights)
    num_layers = 1 + max((int(k.split(".")[1]) for k in weights if k.startswith("layers.")), default=0)

    # HF checkpoints keep conv1d as [C, 1, K]; mlx-lm's layout is [C, K, 1].
    checkpoint_is_hf = False
    if not source.startswith("sidecar"):
        checkpoint_is_hf = any(
            "conv1d.weight" in k and info["shape"][-1] != 1
            for shard in shard_files(folder)
            if shard.exists()
            for k, info in read_header(shard).items()
            if k != "__metadata__"
        )
    if zero_centred is None:
        zero_centred = _zero_centred(weights, meta, checkpoint_is_hf)
    weights = sanitize_mtp(weights, zero_centred, getattr(args, "num_experts", 0))

    head = MTPHead(args, moe=moe, num_layers=num_layers, dedicated_embeddings="embed_tokens.weight" in weights)
    prequantized = {k[: -len(".scales")] for k in weights if k.endswith(".scales")}
    declared = json.loads(meta["councild_quantization"]) if meta.get("councild_quantization") else {}
    if prequantized:  # the file holds quantized tensors: shape the modules first
        _quantize_like_base(head, lm, prequantized, declared)
    head.load_weights(list(weights.items()), strict=True)
    # Float weights follow the base's activation dtype (norm +1 in that dtype, as mlx-lm).
    dtype = lm.backbone.embed_tokens.weight.dtype
    if dtype not in (mx.float32, mx.float16, mx.bfloat16):
        dtype = lm.backbone.norm.weight.dtype
    head.apply(lambda x: x.astype(dtype) if mx.issubdtype(x.dtype, mx.floating) and x.dtype != dtype else x)
    if not prequantized:
        _quantize_like_base(head, lm, set())
    mx.eval(head.parameters())
    head._lm = lm
    head.source = source
    return head


def copy_head_tensors(text_cfg: dict, dtype: mx.Dtype = mx.bfloat16) -> dict[str, mx.array]:
    """HF-named tensors of a synthetic head that drafts (roughly) its own input token:
    fc = [I, 0] passes the normed embedding through, o_proj and down_proj are zero so the
    decoder layer is the identity, and the tied lm_head scores the token's own embedding
    highest. On a random model, whose greedy output loops, it is accepted often; tests and
    the CPU bench use it to drive every accept length through the real code path."""
    h = text_cfg["hidden_size"]
    weights = {name: mx.zeros(shape, dtype=dtype) for name, shape in head_tensor_shapes(text_cfg).items()}
    weights["mtp.fc.weight"] = mx.concatenate([mx.eye(h), mx.zeros((h, h))], axis=1).astype(dtype)
    return weights
