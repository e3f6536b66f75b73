"""A random-weight qwen3_5 checkpoint with an MTP head, built locally in seconds.

Used where a trained model would hide bugs: random logits sit near ties all the time, so
speculation rejects often and every rollback path runs. Also the demo's fallback before the
bundled model exists. The base weights are written in mlx-lm's own layout (loadable by
``mlx_lm.load``); the head goes to a sidecar ``mtp.safetensors`` in the HF layout and norm
convention, which exercises the sidecar loading path (the bundled model carries its head
inside the checkpoint instead).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from .chat_templates import QWEN_TOOLS_TEMPLATE

DEFAULT_TEXT_CONFIG = {
    "model_type": "qwen3_5_text",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rms_norm_eps": 1e-6,
    "vocab_size": 512,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 2,
    "tie_word_embeddings": True,
    "max_position_embeddings": 4096,
    "mtp_num_hidden_layers": 1,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1],
    },
}


def _train_tokenizer(folder: Path, vocab_size: int) -> None:
    """A byte-level BPE over a few standard-library files: real merges, no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    import json as json_module
    import pathlib

    corpus = [Path(m.__file__) for m in (json_module, pathlib)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(p) for p in corpus], trainer)
    tok.save(str(folder / "tokenizer.json"))
    template = QWEN_TOOLS_TEMPLATE  # ChatML, and tools the Qwen3.5 way
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|im_end|>",
                "bos_token": None,
                "pad_token": "<|endoftext|>",
                "chat_template": template,
                "model_max_length": 4096,
            },
            indent=2,
        )
    )


def _random_mtp_tensors(text_cfg: dict, seed: int) -> dict[str, mx.array]:
    """A real head's tensors with random values; norms in the HF zero-centred convention
    (scale = 1 + w), so small values around 0."""
    from .head_layout import head_tensor_shapes

    key = mx.random.key(seed + 1)
    weights = {}
    for name, shape in head_tensor_shapes(text_cfg).items():
        key, sub = mx.random.split(key)
        if len(shape) == 1:
            weights[name] = 0.1 * mx.random.normal(shape, key=sub)
        else:
            bound = shape[1] ** -0.5
            weights[name] = mx.random.uniform(-bound, bound, shape, key=sub)
    return weights


def build_random_model(
    folder: Path, *, seed: int = 0, text_config: dict | None = None, dtype: mx.Dtype = mx.bfloat16
) -> Path:
    """Write a random qwen3_5 checkpoint (+ sidecar MTP head) to ``folder``; return it."""
    from mlx_lm.models import qwen3_5

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    text_cfg = dict(DEFAULT_TEXT_CONFIG, **(text_config or {}))
    config = {"model_type": "qwen3_5", "text_config": text_cfg, "tie_word_embeddings": text_cfg["tie_word_embeddings"]}

    mx.random.seed(seed)
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(config))
    model.apply(lambda x: x.astype(dtype) if x.dtype == mx.float32 else x)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    mtp = {k: v.astype(dtype) for k, v in _random_mtp_tensors(text_cfg, seed).items()}
    mx.save_safetensors(str(folder / "mtp.safetensors"), mtp, metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": None}))
    _train_tokenizer(folder, text_cfg["vocab_size"])
    # The tokenizer decides the eos id; record it where mlx-lm and we look for it.
    tok = json.loads((folder / "tokenizer.json").read_text())
    eos = tok["model"]["vocab"].get("<|im_end|>")
    config["eos_token_id"] = eos
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return folder


def cached_random_model(cache_root: Path, seed: int = 0) -> Path:
    """Build once per seed under ``cache_root`` (the user's cache dir) and reuse it."""
    folder = cache_root / f"random-qwen35-s{seed}"
    if not (folder / "config.json").exists() or not (folder / "mtp.safetensors").exists():
        tmp = folder.with_name(folder.name + ".partial")
        build_random_model(tmp, seed=seed)
        if folder.exists():
            import shutil

            shutil.rmtree(folder)
        tmp.rename(folder)
    return folder


if __name__ == "__main__":  # pragma: no cover - manual use
    out = build_random_model(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("random-qwen35"))
    print(out)
