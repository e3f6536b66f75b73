"""The head loader reads the layouts conversions publish (names, sidecars, FP8), and
`councild model inspect` reports the bundled model's real figures."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from daemon.engine.model.head_layout import SafetensorsError, is_mtp_key, read_header
from daemon.engine.model.loading import load_model
from daemon.engine.model.mtp_head import load_mtp_head
from daemon.paths import BUNDLED_MODEL

TEXT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def bundled():
    weights = mx.load(str(BUNDLED_MODEL / "model.safetensors"))
    base = {k: v for k, v in weights.items() if not is_mtp_key(k)}
    head = {k: v for k, v in weights.items() if is_mtp_key(k)}
    lm = load_model(BUNDLED_MODEL, compile_decode=False)
    reference = dict(tree_flatten(load_mtp_head(lm).parameters()))
    return base, head, reference


def _folder(tmp_path, base: dict):
    for name in TEXT_FILES:
        shutil.copy(BUNDLED_MODEL / name, tmp_path / name)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), base, metadata={"format": "pt"})
    return tmp_path


def _same_head(folder, reference, source: str) -> None:
    lm = load_model(folder, compile_decode=False)
    head = load_mtp_head(lm)
    assert head.source == source
    got = dict(tree_flatten(head.parameters()))
    assert got.keys() == reference.keys()
    for k, v in reference.items():
        assert mx.array_equal(got[k], v), k


def test_multimodal_names_in_a_model_mtp_sidecar_listed_by_the_index(tmp_path, bundled):
    base, head, reference = bundled
    folder = _folder(tmp_path, base)
    renamed = {"model.language_model." + k: v for k, v in head.items()}
    mx.save_safetensors(str(folder / "model-mtp.safetensors"), renamed, metadata={"format": "pt"})
    index = {"weight_map": {**{k: "model.safetensors" for k in base}, **{k: "model-mtp.safetensors" for k in renamed}}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    _same_head(folder, reference, "sidecar (model-mtp.safetensors)")


def test_language_model_names_inside_the_checkpoint(tmp_path, bundled):
    base, head, reference = bundled
    folder = _folder(tmp_path, {**base, **{"language_model." + k: v for k, v in head.items()}})
    _same_head(folder, reference, "checkpoint (model.safetensors)")


def _retype(path, dtypes: dict[str, str]) -> None:
    """Rewrite a safetensors header's dtype strings (the data stays): how an F8_E4M3 file is
    made here, since mx.save_safetensors writes fp8 bytes as U8."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    for k, d in dtypes.items():
        header[k]["dtype"] = d
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


def test_fp8_head_with_block_scales(tmp_path, bundled):
    """FP8 releases store projections as F8_E4M3 with one float32 ``weight_scale_inv`` per
    128x128 block; the loader dequantizes them (w = fp8(w) * scale)."""
    base, head, reference = bundled
    folder = _folder(tmp_path, base)
    stored, f8 = {}, {}
    for k, v in head.items():
        if k.endswith("_proj.weight"):
            w = v.astype(mx.float32)
            rows, cols = w.shape
            br, bc = -(-rows // 128), -(-cols // 128)
            padded = mx.pad(mx.abs(w), [(0, br * 128 - rows), (0, bc * 128 - cols)])
            scale = padded.reshape(br, 128, bc, 128).max(axis=(1, 3)) / 448.0  # e4m3's largest
            full = mx.repeat(mx.repeat(scale, 128, axis=0), 128, axis=1)[:rows, :cols]
            stored[k] = mx.to_fp8(w / full)
            stored[k + "_scale_inv"] = scale
            f8[k] = "F8_E4M3"
        else:
            stored[k] = v
    mx.save_safetensors(str(folder / "mtp.safetensors"), stored, metadata={"format": "pt"})
    _retype(folder / "mtp.safetensors", f8)
    assert read_header(folder / "mtp.safetensors")["mtp.fc.weight"]["dtype"] == "BF16"

    lm = load_model(folder, compile_decode=False)
    got = dict(tree_flatten(load_mtp_head(lm).parameters()))
    assert got.keys() == reference.keys()
    for k, v in reference.items():
        if k.endswith("_proj.weight"):
            err = mx.max(mx.abs(got[k].astype(mx.float32) - v.astype(mx.float32))).item()
            assert 0 < err <= 0.07 * mx.max(mx.abs(v)).item(), (k, err)  # e4m3: 3 mantissa bits
        else:
            assert mx.array_equal(got[k], v), k


@pytest.mark.quick
def test_a_truncated_shard_is_named_not_misread(tmp_path):
    data = (BUNDLED_MODEL / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(SafetensorsError, match="truncated download"):
        read_header(tmp_path / "model.safetensors")


def test_inspect_prints_the_bundled_models_real_figures():
    r = subprocess.run([sys.executable, "-m", "daemon.cli", "model", "inspect", str(BUNDLED_MODEL), "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    # The model card's parameter counts, in bf16.
    assert info["base_bytes"] == 6_446_880 * 2
    assert info["head_bytes"] == 984_448 * 2
    assert info["head"]["files"] == {"model.safetensors": 15} and info["head"]["layout"] == ["mtp.*"]
    # 2 full-attention layers x (K, V) x 2 KV heads x head_dim 64 x 2 bytes.
    assert info["kv_bytes_per_token"] == 2 * 2 * 2 * 64 * 2
    # 4 GatedDeltaNet layers x (fp32 state 4x64x64 + bf16 conv window 3 x (2*4*64 + 4*64)).
    assert info["recurrent_bytes_per_sequence"] == 4 * (4 * 64 * 64 * 4 + 3 * 768 * 2)
    assert (info["layers"], info["full_attention_layers"], info["quantization"]) == (6, 2, None)
    assert info["machine"]["total_bytes"] > 0
    text = subprocess.run([sys.executable, "-m", "daemon.cli", "model", "inspect", str(BUNDLED_MODEL)],
                          capture_output=True, text=True, timeout=120).stdout
    assert "12.9 MB" in text and "present: model.safetensors (15 tensors)" in text
