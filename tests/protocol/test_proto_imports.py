"""`protocol` must import without mlx (a council process installs no GPU stack) and without
the daemon's or the governor's packages."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
import pytest

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)

REPO = Path(__file__).resolve().parents[2]

BLOCKED = ("mlx", "mlx_lm", "daemon", "governor", "torch", "transformers")

SCRIPT = textwrap.dedent(
    f"""
    import importlib.abc, sys

    BLOCKED = {BLOCKED!r}

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{{name}} is blocked in this test")
            return None

    sys.meta_path.insert(0, Block())
    try:
        import mlx  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("the blocker did not block mlx")

    import protocol
    import protocol.client
    from protocol import AsyncClient, Client, DaemonUnavailable, decode_client, encode, Generate

    leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    assert not leaked, leaked
    print("ok", len(protocol.__all__))
    """
)


def test_protocol_imports_without_mlx():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("ok")


def test_every_exported_name_exists():
    import protocol

    missing = [name for name in protocol.__all__ if not hasattr(protocol, name)]
    assert not missing
