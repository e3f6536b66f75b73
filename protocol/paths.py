"""Where the daemon listens by default: an ipc socket in a per-user 0700 directory.

Shared by the daemon and clients so both agree without configuration.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path


def runtime_dir() -> Path:
    """The per-user runtime directory ($COUNCILD_RUNTIME_DIR, else XDG_RUNTIME_DIR/councild on
    Linux, else a uid-named folder in the temp dir, which is where macOS keeps such things)."""
    override = os.environ.get("COUNCILD_RUNTIME_DIR")
    if override:
        return Path(override)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and sys.platform != "darwin":
        return Path(xdg) / "councild"
    return Path(tempfile.gettempdir()) / f"councild-{os.getuid()}"


def default_endpoint() -> str:
    return os.environ.get("COUNCILD_ENDPOINT") or f"ipc://{runtime_dir() / 'councild.sock'}"
