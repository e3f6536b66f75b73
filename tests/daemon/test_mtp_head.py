"""MTP head: loading (sidecar, in-checkpoint, sharded, quantized), forward, residency."""

from __future__ import annotations

import gc
import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from daemon.engine.model.loading import load_model
from daemon.engine.model.mtp_head import MTPHead, NoMTPHead, load_mtp_head, read_tensors


@pytest.fixture(scope="module")
def lm(random_model_path):
    return load_model(random_model_path)


def _params(head: MTPHead) -> dict[str, mx.array]:
    return dict(tree_flatten(head.parameters()))


def test_sidecar_load_applies_hf_norm_shift(lm, random_model_path):
    head = load_mtp_head(lm)
    assert head.source.startswith("sidecar")
    raw, _ = read_tensors(random_model_path / "mtp.safetensors", lambda k: True)
    assert len(raw) == 15
    params = _params(head)
    assert len(params) == 15
    for name, value in raw.items():
        key = name[len("mtp.") :]
        is_norm = "norm" in key
        expected = value + 1.0 if is_norm else value
        assert mx.array_equal(params[key], expected), key
    assert head.nbytes == sum(v.nbytes for v in raw.values())
    assert isinstance(head.fc, nn.Linear) and head.fc.weight.shape == (128, 256)


@pytest.mark.quick
def test_forward_shapes_dtypes_and_own_cache(lm):
    head = load_mtp_head(lm)
    cache = head.make_cache()
    hidden = lm.hidden(mx.array([[5, 6, 7, 8]]), lm.make_cache())
    out = head(hidden, mx.array([[6, 7, 8, 9]]), cache)
    assert out.shape == hidden.shape and out.dtype == hidden.dtype == mx.bfloat16
    assert cache[0].offset == 4
    assert head.logits(out).shape == (1, 4, lm.text_args.vocab_size)
    # Incremental = batched (causal attention over the head's own history).
    cache2 = head.make_cache()
    outs = [head(hidden[:, i : i + 1], mx.array([[6 + i]]), cache2) for i in range(4)]
    assert mx.allclose(mx.concatenate(outs, axis=1).astype(mx.float32), out.astype(mx.float32), atol=2e-2)


def test_gated_attention_splits_query_and_gate_per_head(lm):
    """q_proj is twice as wide: per head, head_dim query channels then head_dim gate channels."""
    head = load_mtp_head(lm)
    attn = head.layers[0].self_attn
    nh, hd = attn.num_attention_heads, attn.head_dim
    assert attn.q_proj.weight.shape[0] == 2 * nh * hd
    x = mx.random.normal((1, 3, lm.text_args.hidden_size), key=mx.random.key(3)).astype(mx.float32)
    a32 = type(attn)(lm.text_args)
    a32.update(attn.parameters())
    a32.apply(lambda t: t.astype(mx.float32))
    got = a32(x, mask="causal", cache=None)
    # Manual reference with the split written out.
    qg = a32.q_proj(x).reshape(1, 3, nh, 2, hd)
    q, gate = qg[..., 0, :], qg[..., 1, :]
    k = a32.k_proj(x).reshape(1, 3, a32.num_key_value_heads, hd)
    v = a32.v_proj(x).reshape(1, 3, a32.num_key_value_heads, hd)
    q = a32.rope(a32.q_norm(q).transpose(0, 2, 1, 3))
    k = a32.rope(a32.k_norm(k).transpose(0, 2, 1, 3))
    v = v.transpose(0, 2, 1, 3)
    o = mx.fast.scaled_dot_product_attention(q, k, v, scale=hd**-0.5, mask="causal")
    o = o.transpose(0, 2, 1, 3).reshape(1, 3, -1)
    want = a32.o_proj(o * mx.sigmoid(gate.reshape(1, 3, -1)))
    assert mx.allclose(got, want, atol=1e-5)


def _merged_copy(src, dst, shards: int):
    """A copy of the random model with the head's tensors inside the checkpoint."""
    shutil.copytree(src, dst)
    (dst / "mtp.safetensors").unlink()
    base = mx.load(str(src / "model.safetensors"))
    head, _ = read_tensors(src / "mtp.safetensors", lambda k: True)
    if shards == 1:
        mx.save_safetensors(str(dst / "model.safetensors"), {**base, **head}, metadata={"format": "mlx"})
        return dst
    (dst / "model.safetensors").unlink()
    names = sorted(base)
    half = len(names) // 2
    parts = [{k: base[k] for k in names[:half]}, {**{k: base[k] for k in names[half:]}, **head}]
    weight_map = {}
    for i, part in enumerate(parts):
        fname = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        mx.save_safetensors(str(dst / fname), part, metadata={"format": "mlx"})
        weight_map.update({k: fname for k in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


@pytest.mark.parametrize("shards", [1, 2])
def test_in_checkpoint_load_matches_sidecar(lm, random_model_path, tmp_path, shards):
    folder = _merged_copy(random_model_path, tmp_path / "merged", shards)
    lm2 = load_model(folder)
    head = load_mtp_head(lm2)  # mlx-format file: the zero-centred norms are recognised by value
    assert head.source.startswith("checkpoint")
    ref = _params(load_mtp_head(lm))
    got = _params(head)
    assert ref.keys() == got.keys()
    for k in ref:
        assert mx.array_equal(ref[k], got[k]), k


def test_no_head_raises(lm, random_model_path, tmp_path):
    folder = tmp_path / "nohead"
    shutil.copytree(random_model_path, folder)
    (folder / "mtp.safetensors").unlink()
    with pytest.raises(NoMTPHead, match="no MTP head"):
        load_mtp_head(load_model(folder))
    other = type(lm)(model=lm.model, tokenizer=lm.tokenizer, path=lm.path, config={}, model_type="llama")
    with pytest.raises(NoMTPHead, match="llama"):
        load_mtp_head(other)


def test_quantized_base_gives_quantized_head(random_model_path, tmp_path):
    from mlx_lm import convert

    qpath = tmp_path / "q4"
    convert(str(random_model_path), str(qpath), quantize=True, q_group_size=32, q_bits=4)
    shutil.copy(random_model_path / "mtp.safetensors", qpath / "mtp.safetensors")
    qlm = load_model(qpath)
    head = load_mtp_head(qlm)
    layer = head.layers[0]
    for m in (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.down_proj):
        assert isinstance(m, nn.QuantizedLinear) and m.bits == 4 and m.group_size == 32
    assert type(head.fc) is nn.Linear
    for n in (head.norm, head.pre_fc_norm_hidden, head.pre_fc_norm_embedding, layer.input_layernorm, layer.self_attn.q_norm):
        assert type(n) is nn.RMSNorm
    hidden = qlm.hidden(mx.array([[3, 4, 5]]), qlm.make_cache())
    out = head(hidden, mx.array([[4, 5, 6]]), head.make_cache())
    assert out.dtype == hidden.dtype and out.shape == hidden.shape
    assert head.nbytes < load_mtp_head(load_model(random_model_path)).nbytes
    # And the quantized pair decodes token-identically to serial.
    import itertools

    from daemon.engine.decoders.sampling import Sampler
    from daemon.engine.decoders.serial import serial_decode
    from daemon.engine.decoders.speculative import speculative_decode
    from daemon.engine.types import SamplingParams

    prompt = [5, 9, 100, 7, 3]
    ref = [t for s in itertools.islice(serial_decode(qlm, prompt, Sampler(SamplingParams())), 16) for t in s.tokens]
    got = []
    for s in speculative_decode(qlm, head, prompt, Sampler(SamplingParams()), 2):
        got += s.tokens
        if len(got) >= 16:
            break
    assert got[:16] == ref


def test_unload_returns_memory(random_model_path):
    lm = load_model(random_model_path)
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    head = load_mtp_head(lm)
    loaded = mx.get_active_memory()
    assert loaded - before >= head.nbytes * 0.9
    nbytes = head.nbytes
    head.unload()
    del head
    gc.collect()
    mx.clear_cache()
    after = mx.get_active_memory()
    assert after - before < nbytes * 0.1, (before, loaded, after)


def test_moe_head_loads_per_expert_tensors(tmp_path):
    """A Qwen3.5-MoE / Qwen3-Next style head: per-expert HF tensors are stacked into switch_mlp."""
    from daemon.engine.model.random_model import build_random_model

    moe_cfg = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64}
    folder = build_random_model(tmp_path / "moe", seed=1, text_config=moe_cfg)
    raw, _ = read_tensors(folder / "mtp.safetensors", lambda k: True)
    h = 128
    p = "mtp.layers.0.mlp."
    raw = {k: v for k, v in raw.items() if not k.startswith(p)}
    key = mx.random.key(5)
    for e in range(4):
        for name, shape in (("gate_proj", (64, h)), ("up_proj", (64, h)), ("down_proj", (h, 64))):
            key, sub = mx.random.split(key)
            raw[f"{p}experts.{e}.{name}.weight"] = (0.05 * mx.random.normal(shape, key=sub)).astype(mx.bfloat16)
    raw[p + "gate.weight"] = (0.05 * mx.random.normal((4, h), key=key)).astype(mx.bfloat16)
    for name, shape in (("gate_proj", (64, h)), ("up_proj", (64, h)), ("down_proj", (h, 64))):
        raw[f"{p}shared_expert.{name}.weight"] = mx.zeros(shape, dtype=mx.bfloat16) + 0.01
    raw[p + "shared_expert_gate.weight"] = mx.zeros((1, h), dtype=mx.bfloat16)
    mx.save_safetensors(str(folder / "mtp.safetensors"), raw, metadata={"format": "pt"})
    lm = load_model(folder)
    head = load_mtp_head(lm)
    assert head.moe
    sw = head.layers[0].mlp.switch_mlp
    assert sw.gate_proj.weight.shape == (4, 64, h)
    assert mx.array_equal(sw.down_proj.weight[2], raw[f"{p}experts.2.down_proj.weight"])
    hidden = lm.hidden(mx.array([[3, 4, 5]]), lm.make_cache())
    out = head(hidden, mx.array([[4, 5, 6]]), head.make_cache())
    assert out.shape == hidden.shape and out.dtype == mx.bfloat16
