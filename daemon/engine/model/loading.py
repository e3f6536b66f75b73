"""Loading a model with mlx-lm into a ``LoadedModel`` (and, where it is bit-identical to
eager, switching its decode steps to the compiled forward)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from ..kernels import gdn_fused, gdn_layer, merged_linears
from ..kernels.chunked_prefill import default_enabled
from .compiled import enable_compiled_decode
from .model import LoadedModel


# Weights are read in steps of about this share of the model, one progress report each.
PROGRESS_STEP = 0.05


def _read_weights(model, progress: Callable[[int, int, float], None] | None) -> None:
    """Read a lazily loaded model's weights from disk (mx.eval), in steps of about
    PROGRESS_STEP of the bytes, reporting (bytes read, total bytes, seconds) after each:
    a 15 GB checkpoint takes tens of seconds, which a log and a service manager should see."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    params = [v for _, v in tree_flatten(model.parameters())]
    total = sum(v.nbytes for v in params)
    step = max(int(total * PROGRESS_STEP), 1)
    t0 = time.perf_counter()
    done = 0
    group: list = []
    group_bytes = 0
    for v in params:
        group.append(v)
        group_bytes += v.nbytes
        if group_bytes >= step:
            mx.eval(group)
            done += group_bytes
            group, group_bytes = [], 0
            if progress is not None:
                progress(done, total, time.perf_counter() - t0)
    if group:
        mx.eval(group)
        done += group_bytes
    if progress is not None:
        progress(done, total, time.perf_counter() - t0)


def _put_recurrence(lm: LoadedModel, fused: bool | None, fold_conv: bool = True) -> str:
    """Install the fused GatedDeltaNet kernel where asked and possible (before the compiled
    step is traced: its traces hold the layers' forward), with the conv folded into it where
    that passes its own check (which covers the recurrence's arithmetic too); returns
    ``lm.recurrence``: "fused" (conv folded), "fused recurrence, conv in mlx ops: <why>" or
    "mlx-lm: <why>"."""
    if fused is False:
        return "mlx-lm: configured (gdn_kernel = \"off\")"
    why = gdn_layer.refusal(lm.text_module)
    conv_why = why or (None if fold_conv else "configured (gdn_conv_fold = \"off\")")
    conv_why = conv_why or gdn_layer.conv_refusal(lm.text_module) or gdn_layer.conv_self_check(lm.text_module)
    if conv_why is None:
        gdn_layer.install(lm.text_module, conv_recurrence=gdn_fused.gated_delta_conv_fused)
        return "fused"
    if why is None:
        why = gdn_layer.self_check(lm.text_module)
    if why is not None:
        if fused:
            raise ValueError(f"the fused GatedDeltaNet kernel cannot run here: {why}")
        return f"mlx-lm: {why}"
    gdn_layer.install(lm.text_module)
    return f"fused recurrence, conv in mlx ops: {conv_why}"


def _put_merged_linears(lm: LoadedModel, merge: bool | None) -> str:
    """Merge the projections that read one input where asked and the fused recurrence runs
    (its forward is the one that reads the merged matmul); returns ``lm.linears``."""
    if merge is False:
        return "separate: configured (merge_linears = \"off\")"
    if not lm.recurrence.startswith("fused"):
        return "separate: the GatedDeltaNet layers run mlx-lm's block"
    n = merged_linears.install(lm.text_module)
    return f"merged {n}" if n else "separate: no projections merge"


def load_model(path: str | Path, *, compile_decode: bool = True, chunked_prefill: bool | None = None,
               progress: Callable[[int, int, float], None] | None = None, group=None,
               compile_check: Callable | None = None, fused_recurrence: bool | None = None,
               merge_linears: bool | None = None, fold_conv: bool = True,
               before_forward: Callable[[], None] | None = None) -> LoadedModel:
    """Load weights and tokenizer with mlx-lm. Raises FileNotFoundError / ValueError with
    the path in the message on a missing or unsupported model. ``compile_decode``: use the
    compiled one-token forward (``compiled.py``) where it is bit-identical to eager.
    ``chunked_prefill``: prefill GatedDeltaNet layers in chunked form (``chunked_prefill.py``;
    None: on a GPU without Metal, i.e. CUDA, the one backend where it was measured faster).
    ``progress(bytes_read, total_bytes, seconds)`` is called as the weights are read.
    ``group``: an ``mx.distributed`` group of more than one rank splits the model across it
    (tensor parallel, ``sharding.py``) before the weights are read; ShardingRefused when the
    model does not divide. ``compile_check``: answers for the compiled step's self-check
    (``compiled.enable_compiled_decode``'s ``checked``), e.g. from a stored verdict.
    ``fused_recurrence``: run every GatedDeltaNet layer's recurrence (and its conv, where
    that checks out) on the fused kernel (engine/kernels/gdn_fused.py); None: where it can run
    (CUDA), False: mlx-lm's own path; ``fold_conv`` False keeps the conv out of the kernel;
    ``lm.recurrence`` says which, and why. ``merge_linears``: projections that read one input
    as one matmul (engine/kernels/merged_linears.py); None: with the fused recurrence, False:
    never; ``lm.linears`` says which. ``before_forward`` is called once the weights are read,
    before the first forward (the kernel prebuild's wait: startup.py)."""
    import mlx_lm

    path = Path(path).expanduser().resolve()
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"no model at {path}: config.json is missing")
    model, tokenizer = mlx_lm.load(str(path), lazy=True)
    config = json.loads((path / "config.json").read_text())
    if group is not None and group.size() > 1:
        from .sharding import shard_model

        shard_model(model, config, group)
    _read_weights(model, progress)
    if before_forward is not None:
        before_forward()
    eos = set(getattr(tokenizer, "eos_token_ids", None) or [])
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    lm = LoadedModel(
        model=model,
        tokenizer=tokenizer,
        path=path,
        config=config,
        model_type=config.get("model_type", ""),
        eos_token_ids=frozenset(eos),
    )
    lm.recurrence = _put_recurrence(lm, fused_recurrence, fold_conv)
    lm.linears = _put_merged_linears(lm, merge_linears)
    if chunked_prefill is None:
        chunked_prefill = default_enabled()
    lm.chunked_prefill = bool(chunked_prefill) and lm.supports_mtp
    if compile_decode and lm.supports_mtp:
        reason = enable_compiled_decode(lm, compile_check)
        lm.decode_path = "compiled" if reason is None else f"eager: {reason}"
    elif compile_decode:
        lm.decode_path = f"eager: no compiled step for model type {lm.model_type!r}"
    return lm
