"""A loaded model, and the two halves of its forward that speculation needs (loading it
is ``loading.py``).

mlx-lm's ``model(tokens, cache)`` returns logits only. Native MTP needs the base model's
final-normed hidden states as well, so the forward is split: ``hidden(tokens, cache)`` runs
the backbone, ``logits(hidden)`` applies the (possibly tied) output head. Both serial and
speculative paths go through the same halves, so their numerics match.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .. import source_hash
from ..kernels import chunked_prefill

# mlx-lm model types whose layers are GatedDeltaNet + gated attention and that carry an
# MTP head in their checkpoints.
HYBRID_MTP_TYPES = frozenset({"qwen3_5", "qwen3_5_moe", "qwen3_next"})


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Any
    path: Path
    config: dict
    model_type: str
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    # Set by ``compiled.enable_compiled_decode`` once its one-token forward proved
    # bit-identical to the eager one; None = every forward is eager.
    compiled_decode: Any = None
    # "compiled", or why the one-token forward stayed eager (for logs and benchmarks).
    decode_path: str = "eager: not requested"
    # Prompt chunks run the GatedDeltaNet recurrence in chunked form (chunked_prefill.py)
    # instead of token by token; load_model turns it on on CUDA (chunked_prefill.default_enabled).
    chunked_prefill: bool = False
    # "fused" when every GatedDeltaNet layer runs engine/kernels/gdn_fused.py's recurrence
    # (load_model puts it in on CUDA), else "mlx-lm: <why not>"; the probes' verdicts are keyed
    # by it (the two round differently).
    recurrence: str = "mlx-lm: not requested"
    # "merged N" when merged_linears.py made N groups of projections one matmul each (load_model,
    # with the fused recurrence), else "separate: <why>"; the probes' verdicts are keyed by it.
    linears: str = "separate: not requested"
    # "mlx", or "invariant" once invariant.install swapped the forward's kernels (the daemon's
    # kernel choice, kernel_choice.py); the probes' cached verdicts are keyed by it.
    kernels: str = "mlx"
    # Set on a ``layer_kinds_view`` only: its backbone (a copy holding some of the layers)
    # and which of the model's cache entries those layers use.
    backbone_view: nn.Module | None = None
    view_layers: tuple[int, ...] | None = None

    def arithmetic_key(self) -> dict:
        """What, besides the weights and the library versions, decides a forward's last bits: the
        kernel set, the GatedDeltaNet recurrence, merged projections, and the engine's own code
        (a split or summation order changes without a version). Probe verdicts and prefix
        snapshots on disk are keyed by it."""
        return {"kernels": self.kernels, "recurrence": self.recurrence.split(":")[0],
                "linears": self.linears.split(":")[0], "engine_source": source_hash()}

    @property
    def batch_decode_path(self) -> str:
        """"compiled" when batched steps and verifies (B >= 2 rows) run the compiled forward
        (its batch self-check passed, compiled.py), else "eager: <why>"."""
        c = self.compiled_decode
        if c is None:
            if self.decode_path == "compiled":
                return "eager: compiled steps switched off"
            return f"eager: as one row ({self.decode_path.removeprefix('eager: ')})"
        return "compiled" if c.batched else f"eager: {c.batch_reason}"

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def text_module(self) -> nn.Module:
        """The module that owns embed/layers/norm and lm_head (qwen3_5 wraps it)."""
        return getattr(self.model, "language_model", self.model)

    @property
    def backbone(self) -> nn.Module:
        return self.backbone_view if self.backbone_view is not None else self.text_module.model

    def layer_kinds_view(self) -> LoadedModel:
        """The same model with one layer of each kind (``layer_kind``): the first of each, in
        order, between the same embedding and final norm, forwarding eagerly. A probe on it
        compares every forward's hidden states (or the logits of every position), not only
        the caches: the view's last layer has no layer after it whose cache shows its output.

        For the exactness probes that ask whether two ways of running a forward (in other
        splits, other row counts) give the same bits. MLX picks an op's kernel by its shapes
        and dtypes, never by the values, so a layer that gives the same bits both ways on
        an input does so for every layer of its kind: the view answers for the whole model
        at a fraction of its cost (a 64-layer Qwen3.5 has two kinds; the probes run 2 layers).
        The view forwards eagerly (no compiled step): the compiled step's own self-check,
        which runs on a view too (``compiled.checked_compiled_decode``), proved it bit for bit
        the eager step. A pipeline-split backbone (a group) is returned whole, its ranks'
        layers differ."""
        bb = self.backbone
        if getattr(bb, "pipeline_size", 1) != 1 or self.backbone_view is not None:
            return self
        layers, seen, keep = list(bb.layers), set(), []
        for i, layer in enumerate(layers):
            kind = layer_kind(layer)
            if kind not in seen:
                seen.add(kind)
                keep.append(i)
        view = copy.copy(bb)  # shares every module; only its layer list differs
        view.layers = [layers[i] for i in keep]
        linear = [bool(getattr(layer, "is_linear", False)) for layer in view.layers]
        if hasattr(bb, "ssm_idx"):
            view.ssm_idx = linear.index(True) if True in linear else None
        if hasattr(bb, "fa_idx"):
            view.fa_idx = linear.index(False) if False in linear else None
        return dataclasses.replace(self, compiled_decode=None, decode_path="eager: a layer kinds view",
                                   backbone_view=view, view_layers=tuple(keep))

    @property
    def text_args(self) -> Any:
        return self.text_module.args

    @property
    def supports_mtp(self) -> bool:
        return self.model_type in HYBRID_MTP_TYPES

    def hidden(self, tokens: mx.array, cache: list | None) -> mx.array:
        """Final-normed hidden states, shape [B, T, H]."""
        if self.compiled_decode is not None:
            h = self.compiled_decode.try_hidden(tokens, cache)
            if h is not None:
                return h
        return self.backbone(tokens, cache)

    def prefill_hidden(self, tokens: mx.array, cache: list) -> mx.array:
        """``hidden`` for a prompt chunk: the chunked recurrence where enabled and it applies
        (long enough, one unpadded sequence); decode steps and verifies never come here."""
        if self.chunked_prefill:
            if chunked_prefill.applies(self, tokens, cache):
                return chunked_prefill.prefill_hidden(self, tokens, cache)
        return self.hidden(tokens, cache)

    def logits(self, hidden: mx.array) -> mx.array:
        text = self.text_module
        if text.args.tie_word_embeddings:
            return text.model.embed_tokens.as_linear(hidden)
        out = text.lm_head(hidden)
        if getattr(text, "sharding_group", None) is not None:  # a vocabulary split across ranks
            from mlx_lm.models.base import gather_last_axis

            out = gather_last_axis(out, text.sharding_group)
        return out

    def embed(self, tokens: mx.array) -> mx.array:
        return self.backbone.embed_tokens(tokens)

    def make_cache(self) -> list:
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(self.model)
        return cache if self.view_layers is None else [cache[i] for i in self.view_layers]

    def encode_prompt(self, prompt: str | None, messages: list[dict] | None, tokens: list[int] | None,
                      template_kwargs: dict | None = None, tools: list[dict] | None = None) -> list[int]:
        """Token ids of a request's prompt. ``template_kwargs`` are extra variables for the
        chat template (e.g. ``enable_thinking``), for ``messages`` only; ``tools`` (OpenAI's
        function-tool dicts) are rendered by the template, which knows the model's format."""
        if template_kwargs and messages is None:
            raise ValueError("chat_template_kwargs apply to messages only (the chat template renders them)")
        if tokens is not None:
            return list(tokens)
        if messages is not None:
            if getattr(self.tokenizer, "chat_template", None):
                if tools:
                    template_kwargs = {**(template_kwargs or {}), "tools": tools}
                return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                               **(template_kwargs or {})))
            prompt = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
        return list(self.tokenizer.encode(prompt or ""))


def layer_kind(layer: nn.Module) -> tuple:
    """What decides which kernels a layer's forward runs: its modules' names and classes and
    its parameters' names, shapes and dtypes (a layer quantized to other bits is another kind)."""
    modules = tuple((name, type(m).__name__) for name, m in layer.named_modules())
    params = tuple((name, tuple(a.shape), str(a.dtype)) for name, a in tree_flatten(layer.parameters()))
    return type(layer).__name__, getattr(layer, "is_linear", None), modules, params
