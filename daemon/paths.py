"""Per-user folders the daemon writes to, created on first use."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from protocol.paths import runtime_dir

PACKAGE_DIR = Path(__file__).resolve().parent
BUNDLED_MODEL = PACKAGE_DIR / "assets" / "tiny-qwen35"


def cache_dir() -> Path:
    base = os.environ.get("COUNCILD_CACHE_DIR")
    if base:
        path = Path(base)
    elif sys.platform == "darwin":
        path = Path.home() / "Library" / "Caches" / "councild"
    else:
        path = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "councild"
    path.mkdir(parents=True, exist_ok=True)
    return path


def ensure_runtime_dir() -> Path:
    """Create the runtime dir 0700 (and tighten it if it already exists): the ipc socket
    inside it is then reachable only by this user, whatever the socket file's own mode."""
    path = runtime_dir()
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


def resolve_model(explicit: str | None) -> str:
    """--model / config (a folder or a pulled org/name[@revision]), else the bundled model,
    else a cached random-weight model."""
    if explicit:
        # A folder, or a Hub repo id found in the Hugging Face cache (the daemon never
        # downloads; ModelRefError names `councild model pull`).
        from .models.refs import resolve_local

        return str(resolve_local(explicit))
    if (BUNDLED_MODEL / "config.json").exists():
        return str(BUNDLED_MODEL)
    from .engine.model.random_model import cached_random_model

    print("councild: the bundled model is not in this checkout; serving a random-weight qwen3_5 model",
          file=sys.stderr)
    return str(cached_random_model(cache_dir()))
