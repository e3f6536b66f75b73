"""Tensor-parallel split of a loaded model across an ``mx.distributed`` group.

mlx-lm's ``Model.shard(group)`` (qwen3_5, qwen3_5_moe, qwen3_next) splits GatedDeltaNet
heads, attention heads and MLP channels across the ranks, with an all_sum after each
block. It asserts (or silently mis-splits) when a dimension does not divide by the group
size; ``split_problems`` names every such dimension first, so the daemon can refuse at
start-up with the reason instead of failing mid-load.
"""

from __future__ import annotations

from typing import Any


class ShardingRefused(ValueError):
    """The model cannot be split across this many ranks (the message says which dimension)."""


def _text_config(config: dict) -> dict:
    return config.get("text_config", config)


def split_problems(config: dict, ranks: int) -> list[str]:
    """Each dimension of the model that ``ranks`` does not divide, in words ([] if none)."""
    if ranks <= 1:
        return []
    t = _text_config(config)
    out = []

    def need(key: str, what: str) -> None:
        value = t.get(key)
        if isinstance(value, int) and value > 0 and value % ranks:
            out.append(f"{key} = {value} ({what}) is not divisible by {ranks} ranks")

    need("num_attention_heads", "attention heads")
    kv = t.get("num_key_value_heads")
    # mlx-lm repeats KV heads when there are fewer than ranks: then ranks must be a multiple.
    if isinstance(kv, int) and kv > 0 and (kv % ranks if kv >= ranks else ranks % kv):
        out.append(f"num_key_value_heads = {kv} (KV heads) neither divides nor is divided by {ranks} ranks")
    need("linear_num_key_heads", "GatedDeltaNet key heads")
    need("linear_num_value_heads", "GatedDeltaNet value heads")
    if t.get("num_experts", 0):
        need("moe_intermediate_size", "expert MLP width")
        need("shared_expert_intermediate_size", "shared expert MLP width")
    else:
        need("intermediate_size", "MLP width")
    if not t.get("tie_word_embeddings", config.get("tie_word_embeddings", False)):
        need("vocab_size", "output vocabulary")
    return out


def shard_model(model: Any, config: dict, group: Any) -> None:
    """Split ``model`` in place across ``group`` (before its weights are read, so each rank
    reads only its share). Raises ShardingRefused with the reason when it cannot."""
    n = group.size()
    if n <= 1:
        return
    if not hasattr(model, "shard"):
        raise ShardingRefused(f"model type {config.get('model_type')!r} has no tensor-parallel split in mlx-lm "
                              f"(Model.shard); serve it on one rank")
    problems = split_problems(config, n)
    if problems:
        raise ShardingRefused(f"the model cannot be split across {n} ranks: " + "; ".join(problems))
    model.shard(group)


def shard_head(head: Any, group: Any) -> None:
    """Split a dense MTP head's decoder layer across ``group`` as mlx-lm splits the base's
    attention layers (heads of q/k/v, then o_proj and the MLP with an all_sum each); fc and
    the norms stay whole. The daemon replicates the head instead (no collective per draft);
    this exists so bench/distributed_bench.py can measure the two against each other."""
    from mlx.nn.layers.distributed import shard_linear

    n = group.size()
    if n <= 1:
        return
    if getattr(head, "moe", False):
        raise ShardingRefused("splitting an MoE head is not implemented; it is replicated")
    for layer in head.layers:
        attn = layer.self_attn
        if attn.num_attention_heads % n or attn.num_key_value_heads % n:
            raise ShardingRefused(f"the head's {attn.num_attention_heads} attention / {attn.num_key_value_heads} KV "
                                  f"heads do not divide by {n} ranks")
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(attn, name, shard_linear(getattr(attn, name), "all-to-sharded", group=group))
        attn.o_proj = shard_linear(attn.o_proj, "sharded-to-all", group=group)
        attn.num_attention_heads //= n
        attn.num_key_value_heads //= n
        mlp = layer.mlp
        mlp.gate_proj = shard_linear(mlp.gate_proj, "all-to-sharded", group=group)
        mlp.up_proj = shard_linear(mlp.up_proj, "all-to-sharded", group=group)
        mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=group)
