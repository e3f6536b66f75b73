"""The bundled model (daemon/assets/tiny-qwen35): a small trained Qwen3.5 with a native MTP
head, in the HF format real Qwen3.5 checkpoints use. Built by tools/train_tiny_model.py;
MODEL_CARD.md in the folder holds the recipe and the measured numbers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from daemon.paths import BUNDLED_MODEL

MAX_BYTES = 16_000_000  # the whole folder, card included
# mlx (cpu, float32) vs transformers (torch cpu, float32), same bf16 weights. mlx-lm's
# sanitize adds the +1 to the zero-centred norm weights in bf16 (the checkpoint's dtype),
# transformers computes 1 + w in float32: that rounding alone moves the logits by a few
# 1e-2 (measured max abs 0.049 on logits of std ~3). With the reference given the same
# bf16 rounding of 1 + w, the two agree to float32 noise (measured ~2e-5).
LOGITS_ATOL_EXACT_HF = 0.15
LOGITS_ATOL_SAME_ROUNDING = 1e-3
NORM_SUFFIXES = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                 ".q_norm.weight", ".k_norm.weight")

CODE = (
    "import os\n\n\ndef walk(top, topdown=True):\n"
    "    \"\"\"Directory tree generator.\"\"\"\n"
    "    for name in os.listdir(top):\n"
    "        path = os.path.join(top, name)\n"
    "        if os.path.isdir(path):\n"
    "            yield from walk(path, topdown)\n"
    "    return {'a': 1, \"b\": [2.5, -3]}  # café ünïcode ✓\n"
)

MTP_SUFFIXES = {
    "fc.weight",
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
    "norm.weight",
    "layers.0.input_layernorm.weight",
    "layers.0.post_attention_layernorm.weight",
    "layers.0.self_attn.q_proj.weight",
    "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight",
    "layers.0.self_attn.q_norm.weight",
    "layers.0.self_attn.k_norm.weight",
    "layers.0.mlp.gate_proj.weight",
    "layers.0.mlp.up_proj.weight",
    "layers.0.mlp.down_proj.weight",
}


@pytest.fixture(scope="module")
def config():
    return json.loads((BUNDLED_MODEL / "config.json").read_text())


@pytest.fixture(scope="module")
def loaded():
    from mlx_lm import load

    return load(str(BUNDLED_MODEL))


def test_files_present_and_small():
    names = {p.name for p in BUNDLED_MODEL.iterdir()}
    for need in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "MODEL_CARD.md"):
        assert need in names, need
    total = sum(p.stat().st_size for p in BUNDLED_MODEL.rglob("*") if p.is_file())
    assert total <= MAX_BYTES, total


def test_config_is_qwen35_with_mtp(config):
    assert config["model_type"] == "qwen3_5"
    assert config["mtp_num_hidden_layers"] == 1
    types = config["layer_types"]
    assert len(types) == config["num_hidden_layers"] >= 4
    assert {"linear_attention", "full_attention"} == set(types)
    k = config["full_attention_interval"]
    assert types == ["linear_attention" if (i + 1) % k else "full_attention" for i in range(len(types))]


def test_safetensors_holds_base_and_mtp_in_hf_convention(config):
    from safetensors import safe_open

    with safe_open(str(BUNDLED_MODEL / "model.safetensors"), framework="numpy") as f:
        keys = set(f.keys())
        H = config["hidden_size"]
        mtp = {k[len("mtp."):] for k in keys if k.startswith("mtp.")}
        assert mtp == MTP_SUFFIXES
        assert f.get_slice("mtp.fc.weight").get_shape() == [H, 2 * H]
        nh, hd = config["num_attention_heads"], config["head_dim"]
        assert f.get_slice("mtp.layers.0.self_attn.q_proj.weight").get_shape() == [2 * nh * hd, H]
        # HF conv1d layout [C, 1, K] (mlx-lm's sanitize keys its +1 on norms off this)
        conv = [k for k in keys if k.endswith("linear_attn.conv1d.weight")]
        assert conv and all(f.get_slice(k).get_shape()[1:] == [1, config["linear_conv_kernel_dim"]] for k in conv)
        assert "model.embed_tokens.weight" in keys and "model.norm.weight" in keys
        # zero-centred norms: a trained HF norm weight sits near 0, not near 1
    import mlx.core as mx

    w = mx.load(str(BUNDLED_MODEL / "model.safetensors"))["model.layers.0.input_layernorm.weight"]
    assert abs(float(mx.mean(w.astype(mx.float32)).item())) < 0.9


def test_mlx_lm_loads_and_decodes(loaded):
    import mlx.core as mx

    model, tok = loaded
    ids = tok.encode("def fibonacci(n):\n")
    out = []
    x = mx.array([ids])
    cache = model.make_cache()
    for _ in range(8):
        logits = model(x, cache=cache)
        nxt = int(mx.argmax(logits[0, -1]).item())
        out.append(nxt)
        x = mx.array([[nxt]])
    assert len(out) == 8 and all(0 <= t < 4096 for t in out)


def test_tokenizer_round_trips_code_and_specials(loaded):
    _, tok = loaded
    ids = tok.encode(CODE)
    assert tok.decode(ids) == CODE
    assert len(ids) < len(CODE.encode()) // 2  # it is a trained BPE, not bytes
    for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        enc = tok.encode(s, add_special_tokens=False)
        assert len(enc) == 1, (s, enc)


def test_chat_template_renders(loaded):
    _, tok = loaded
    text = tok.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        add_generation_prompt=True, tokenize=False,
    )
    assert text == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                    "<|im_start|>assistant\n")


def test_mlx_logits_match_transformers(loaded, config):
    torch = pytest.importorskip("torch")
    import mlx.core as mx
    from safetensors.torch import load_file
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    model, tok = loaded
    ids = tok.encode(CODE)
    model.set_dtype(mx.float32)
    try:
        got = np.array(model(mx.array([ids])).astype(mx.float32))[0]
    finally:
        model.set_dtype(mx.bfloat16)

    kw = {k: v for k, v in config.items()
          if k not in ("model_type", "architectures", "transformers_version", "dtype", "torch_dtype",
                       "full_attention_interval", "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings")}
    ref_model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**kw)).float().eval()
    sd = {k: v.float() for k, v in load_file(str(BUNDLED_MODEL / "model.safetensors")).items()
          if not k.startswith("mtp.")}
    missing, unexpected = ref_model.load_state_dict(sd, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected
    ref_model.tie_weights()
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0].numpy()
        for name, p in ref_model.named_parameters():
            if name.endswith(NORM_SUFFIXES):
                p.copy_((1.0 + p.to(torch.bfloat16)).float() - 1.0)  # 1 + w rounded as in mlx-lm
        ref_rounded = ref_model(torch.tensor([ids])).logits[0].numpy()
    diff = float(np.abs(got - ref).max())
    diff_r = float(np.abs(got - ref_rounded).max())
    print(f"\nmax abs logit diff mlx vs transformers over {len(ids)} tokens: {diff:.3e} "
          f"(same 1+w rounding: {diff_r:.3e}; logit std {ref.std():.2f})")
    assert diff_r < LOGITS_ATOL_SAME_ROUNDING
    assert diff < LOGITS_ATOL_EXACT_HF
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.95
