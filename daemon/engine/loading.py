"""Loading a model with mlx-lm into a ``LoadedModel`` (and, where it is bit-identical to
eager, switching its decode steps to the compiled forward)."""

from __future__ import annotations

import json
from pathlib import Path

from .chunked_prefill import default_enabled
from .compiled import enable_compiled_decode
from .model import LoadedModel


def load_model(path: str | Path, *, compile_decode: bool = True, chunked_prefill: bool | None = None) -> LoadedModel:
    """Load weights and tokenizer with mlx-lm. Raises FileNotFoundError / ValueError with
    the path in the message on a missing or unsupported model. ``compile_decode``: use the
    compiled one-token forward (``compiled.py``) where it is bit-identical to eager.
    ``chunked_prefill``: prefill GatedDeltaNet layers in chunked form (``chunked_prefill.py``;
    None: on a GPU without Metal, i.e. CUDA, the one backend where it was measured faster)."""
    import mlx_lm

    path = Path(path).expanduser().resolve()
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"no model at {path}: config.json is missing")
    model, tokenizer = mlx_lm.load(str(path))
    config = json.loads((path / "config.json").read_text())
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
    if chunked_prefill is None:
        chunked_prefill = default_enabled()
    lm.chunked_prefill = bool(chunked_prefill) and lm.supports_mtp
    if compile_decode and lm.supports_mtp:
        reason = enable_compiled_decode(lm)
        lm.decode_path = "compiled" if reason is None else f"eager: {reason}"
    elif compile_decode:
        lm.decode_path = f"eager: no compiled step for model type {lm.model_type!r}"
    return lm
