"""Keep deep-learning frameworks the daemon never uses out of its process.

mlx-lm's tokenizer comes from transformers, and ``import transformers`` imports PyTorch (and
through it sympy, scikit-learn, torch._dynamo, ...) whenever PyTorch is installed, whether or
not anything uses it: on the H200 host, with PyTorch installed beside MLX, that was ~14 of the
~17 s the serving imports took before the first log line, at every start
(bench/results/h200_2026-12-03b). The daemon tokenizes with the `tokenizers` library through
transformers and runs every tensor op on MLX, so it marks these packages absent before anything
imports transformers: a ``None`` in ``sys.modules`` makes ``importlib.util.find_spec`` answer
None and an ``import`` raise ImportError, which is how transformers learns a framework is not
installed. ``COUNCILD_IMPORT_TORCH=1`` leaves them visible (a model whose remote tokenizer code
needs PyTorch). Imports nothing: the CLI calls it before its first heavy import."""

from __future__ import annotations

import os
import sys

UNUSED_FRAMEWORKS = ("torch", "torchvision", "torchaudio", "tensorflow", "jax", "flax", "sklearn")
KEEP_ENV = "COUNCILD_IMPORT_TORCH"


def hide_unused_frameworks() -> tuple[str, ...]:
    """Mark the frameworks absent for this process, unless already imported or the operator
    asked to keep them; returns the names hidden."""
    if os.environ.get(KEEP_ENV, "").strip().lower() in ("1", "true", "yes"):
        return ()
    hidden = tuple(name for name in UNUSED_FRAMEWORKS if name not in sys.modules)
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]
    return hidden
