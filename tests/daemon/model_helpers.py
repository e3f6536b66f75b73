"""Helpers the engine tests share: a head whose drafts are accepted, and a prefilled cache
with the next token's logits from it."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from daemon.engine.prefill.prefill import ChunkedPrefill
from daemon.engine.model.mtp_head import copy_head_tensors, load_mtp_head


def make_copy_head(lm, folder: Path):
    """An MTP head (written to ``folder``) that drafts what the base model would say, so its
    drafts are accepted: speculation's accept paths run, not only its rejections."""
    mx.save_safetensors(str(folder / "mtp.safetensors"), copy_head_tensors(lm.config["text_config"]),
                        metadata={"format": "pt"})
    return load_mtp_head(lm, folder=folder)


def prefilled(lm, tokens: list[int], chunk: int):
    """A cache holding ``tokens`` (prefilled in chunks, as the engine does)."""
    pre = ChunkedPrefill(lm, tokens + [1], chunk, lm.make_cache())
    while not pre.done:
        pre.step()
    return pre.cache


def next_logits(lm, cache, token: int) -> mx.array:
    """The logits after feeding ``token`` to ``cache`` (which it advances)."""
    return lm.logits(lm.hidden(mx.array([[token]], dtype=mx.uint32), cache))[0, -1]
