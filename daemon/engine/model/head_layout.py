"""Where an MTP head sits in a checkpoint (no mlx here: `councild model inspect` reads it too), in the layouts conversions use in the wild.

Tensor names (one decoder layer plus fc and four norms, see engine/model/mtp_head.py):
- ``mtp.*``: Qwen3.5 / Qwen3-Next releases (Qwen/...), MTPLX, vLLM's and SGLang's loaders;
- ``model.mtp.*``: conversions that nest the head under the text model;
- ``language_model.mtp.*`` / ``model.language_model.mtp.*``: the multimodal
  (``*ForConditionalGeneration``) layout, as in Qwen3.5's VL-shaped checkpoints.
Files: the checkpoint's own shards (found through ``model.safetensors.index.json`` where there
is one), or a sidecar beside them: ``mtp.safetensors`` (what `councild model pull --mtp-from`
writes) or ``model-mtp.safetensors`` (what community "add MTP weights" scripts write, often
also listed in the index).
Dtypes: whatever ``mx.load`` reads (F32/F16/BF16, quantized U32 + scales/biases), plus
F8_E4M3 with or without ``weight_scale_inv`` block scales (FP8 releases), dequantized on load.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

SIDECAR = "mtp.safetensors"  # the name `councild model pull --mtp-from` writes
SIDECARS = (SIDECAR, "model-mtp.safetensors")
INDEX = "model.safetensors.index.json"
MTP_PREFIXES = ("mtp.", "model.mtp.", "language_model.mtp.", "model.language_model.mtp.")


def is_mtp_key(name: str) -> bool:
    return name.startswith(MTP_PREFIXES)


def canonical_mtp_key(name: str) -> str:
    """``model.language_model.mtp.fc.weight`` -> ``mtp.fc.weight``."""
    for prefix in MTP_PREFIXES:
        if name.startswith(prefix):
            return "mtp." + name[len(prefix):]
    return name


def strip_mtp(name: str) -> str:
    """The name inside the head module: ``...mtp.layers.0.x`` -> ``layers.0.x``."""
    return canonical_mtp_key(name)[len("mtp."):]


class SafetensorsError(ValueError):
    """A safetensors file is not one (truncated, corrupt header, data out of bounds)."""


def read_header(path: str | Path) -> dict:
    """The JSON header of a safetensors file (tensor name -> dtype/shape/data_offsets, plus
    ``__metadata__``), checked against the file's size so a truncated download is caught here
    rather than deep inside a load. Reads only the header bytes."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise SafetensorsError(f"{path.name}: {size} bytes, too short for a safetensors file")
        n = struct.unpack("<Q", raw)[0]
        if n > min(size - 8, 100_000_000):
            raise SafetensorsError(f"{path.name}: header length {n} does not fit a {size}-byte file")
        try:
            header = json.loads(fh.read(n))
        except ValueError as exc:
            raise SafetensorsError(f"{path.name}: the header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path.name}: the header is not a JSON object")
    data_len = size - 8 - n
    end = max((info["data_offsets"][1] for k, info in header.items() if k != "__metadata__"), default=0)
    if end > data_len:
        raise SafetensorsError(
            f"{path.name}: the header says the data runs to byte {end} but the file holds {data_len} "
            "(truncated download?)")
    return header


def tensor_names(path: str | Path) -> list[str]:
    return [k for k in read_header(path) if k != "__metadata__"]


def shard_files(folder: Path) -> list[Path]:
    """The checkpoint's weight files, sidecars excluded (the index's list where there is one)."""
    index = folder / INDEX
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return sorted({folder / f for f in weight_map.values()} - {folder / s for s in SIDECARS})
    return sorted(p for p in folder.glob("*.safetensors") if p.name not in SIDECARS)


def head_files(folder: str | Path) -> list[Path]:
    """The files holding the head's tensors: the checkpoint's own shards that have any (by the
    index's weight map, else by reading each shard's header), else the first sidecar present.
    Empty when there is no head."""
    folder = Path(folder)
    index = folder / INDEX
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        found = sorted({folder / f for k, f in weight_map.items() if is_mtp_key(k)})
        found = [p for p in found if p.exists()]
    else:
        found = [p for p in shard_files(folder) if any(is_mtp_key(k) for k in tensor_names(p))]
    if found:
        return found
    for name in SIDECARS:
        if (folder / name).exists() and any(is_mtp_key(k) or not k.startswith("model.") for k in tensor_names(folder / name)):
            return [folder / name]
    return []


def head_tensor_shapes(text_cfg: dict) -> dict[str, tuple[int, ...]]:
    """The tensors of a one-layer head as the base's text config fixes them: canonical
    ``mtp.*`` names and shapes (q_proj twice as wide: per head, query channels then gate
    channels). The dense MLP's three tensors are listed only when the config has no experts;
    an MoE head's expert tensors are laid out differently by each conversion."""
    h = text_cfg["hidden_size"]
    nh, nkv = text_cfg["num_attention_heads"], text_cfg["num_key_value_heads"]
    hd = text_cfg.get("head_dim") or h // nh
    p = "mtp.layers.0."
    shapes = {
        "mtp.fc.weight": (h, 2 * h),
        "mtp.pre_fc_norm_embedding.weight": (h,),
        "mtp.pre_fc_norm_hidden.weight": (h,),
        p + "input_layernorm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (2 * nh * hd, h),
        p + "self_attn.k_proj.weight": (nkv * hd, h),
        p + "self_attn.v_proj.weight": (nkv * hd, h),
        p + "self_attn.o_proj.weight": (h, nh * hd),
        p + "self_attn.q_norm.weight": (hd,),
        p + "self_attn.k_norm.weight": (hd,),
    }
    if not text_cfg.get("num_experts"):
        inter = text_cfg["intermediate_size"]
        shapes.update({p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter)})
    shapes["mtp.norm.weight"] = (h,)
    return shapes
