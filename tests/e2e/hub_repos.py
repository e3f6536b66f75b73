"""Repos for the fake Hub, built from the bundled model, named as their real counterparts are.

- ``mlx-community/Qwen3.5-Tiny-bf16``: the bundled base without ``mtp.*`` (as mlx-community
  conversions publish Qwen3.5: the head dropped), one ``model.safetensors``;
- ``Qwen/Qwen3.5-Tiny``: the original release, sharded like Qwen's (``model-0000N-of-00003``
  with ``model.safetensors.index.json``), the head alone in the last shard;
- ``Qwen/Qwen3.6-Tiny``: another release with a head of the same shapes trained on another
  trunk (here: random weights), which `--mtp-from` must refuse;
- ``mlx-community/Qwen3.5-Tiny-truncated``: a base whose published shard is cut short;
- ``mlx-community/Qwen3.5-Tiny-4bit``: what ``mlx_lm.convert -q`` makes of the bundled model
  (4-bit affine, group 64, mlx layout, head dropped), as mlx-community's 4-bit repos are made.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import mlx.core as mx

from daemon.engine.model.head_layout import is_mtp_key
from daemon.paths import BUNDLED_MODEL

BASE = "mlx-community/Qwen3.5-Tiny-bf16"
SOURCE = "Qwen/Qwen3.5-Tiny"
FOREIGN = "Qwen/Qwen3.6-Tiny"
TRUNCATED = "mlx-community/Qwen3.5-Tiny-truncated"
QUANTIZED = "mlx-community/Qwen3.5-Tiny-4bit"
TEXT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def _st_bytes(tensors: dict, metadata: dict | None = None) -> bytes:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "x.safetensors"
        mx.save_safetensors(str(path), tensors, metadata=metadata or {"format": "pt"})
        return path.read_bytes()


def _text_files() -> dict[str, bytes]:
    return {name: (BUNDLED_MODEL / name).read_bytes() for name in TEXT_FILES}


def _sharded(base: dict, head: dict) -> dict[str, bytes]:
    names = sorted(base)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    shards = {"model-00001-of-00003.safetensors": {k: base[k] for k in halves[0]},
              "model-00002-of-00003.safetensors": {k: base[k] for k in halves[1]},
              "model-00003-of-00003.safetensors": head}
    files = {name: _st_bytes(t) for name, t in shards.items()}
    index = {"metadata": {"total_size": sum(v.nbytes for t in shards.values() for v in t.values())},
             "weight_map": {k: name for name, t in shards.items() for k in t}}
    files["model.safetensors.index.json"] = json.dumps(index, indent=2).encode()
    return files


def _mlx_4bit() -> dict[str, bytes]:
    from mlx_lm import convert

    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "q4"
        convert(str(BUNDLED_MODEL), mlx_path=str(out), quantize=True, q_bits=4, q_group_size=64)
        return {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}


def build_repos() -> dict[str, dict[str, bytes]]:
    weights = mx.load(str(BUNDLED_MODEL / "model.safetensors"))
    base = {k: v for k, v in weights.items() if not is_mtp_key(k)}
    head = {k: v for k, v in weights.items() if is_mtp_key(k)}
    base_file = _st_bytes(base)
    keys = mx.random.split(mx.random.key(7), len(head))
    foreign_head = {k: (mx.random.normal(v.shape, key=keys[i]) * 0.05).astype(v.dtype)
                    for i, (k, v) in enumerate(sorted(head.items()))}
    return {
        BASE: {**_text_files(), "model.safetensors": base_file, "README.md": b"# tiny base, head dropped\n"},
        SOURCE: {**_text_files(), **_sharded(base, head)},
        FOREIGN: {**_text_files(), **_sharded(base, foreign_head)},
        TRUNCATED: {**_text_files(), "model.safetensors": base_file[: len(base_file) * 2 // 3]},
        QUANTIZED: _mlx_4bit(),
    }
