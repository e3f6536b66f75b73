"""The engine: one loaded model and the code that runs it, imported by the daemon and never importing it.

Its wings, bottom to top (each imports only those below it; tests/daemon/test_layering.py
holds the order): kernels/ (the arithmetic of a forward), caches/ (where a request's state
is kept), model/ (a loaded checkpoint and its forwards), prefill/ (a prompt into the caches),
decoders/ (tokens out). pieces.py and types.py are the floor every wing may use."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

_ENGINE_DIR = Path(__file__).resolve().parent


@functools.cache
def source_hash() -> str:
    """A hash of every engine module's path and bytes: what a cached result computed by the engine
    (a probe's verdict, a prefix snapshot's states) must be keyed by, since a development tree
    changes the arithmetic (a kernel's summation order, a split) without changing its version."""
    h = hashlib.sha256()
    for f in sorted(_ENGINE_DIR.rglob("*.py")):  # every wing's modules, by their path in the engine
        h.update(f.relative_to(_ENGINE_DIR).as_posix().encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]
