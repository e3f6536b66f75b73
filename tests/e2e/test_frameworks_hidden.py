"""The daemon keeps PyTorch (and the other frameworks it never uses) out of its process, even
where one is installed: transformers imports an installed PyTorch on its own import, which cost
~14 s of every start on the H200 host (daemon/frameworks.py). A fake `torch` package on the path
records whether anything imported it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from e2e_harness import REPO, start_daemon, wait_ready
from daemon.paths import BUNDLED_MODEL
from protocol.client import Client


def fake_torch(tmp: Path) -> tuple[Path, Path]:
    """A `torch` package whose import leaves a marker file; returns (its folder, the marker)."""
    marker = tmp / "torch-was-imported"
    pkg = tmp / "fake_site" / "torch"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"open({str(marker)!r}, 'w').write('imported')\n__version__ = '2.9.0'\n")
    return pkg.parent, marker


def _transformers_sees_torch(site: Path, env_extra: dict) -> str:
    code = ("from daemon.cli import hide_unused_frameworks; hide_unused_frameworks(); "
            "from transformers.utils import is_torch_available; print(is_torch_available())")
    env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{REPO}", **env_extra)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          cwd=REPO).stdout.strip()


def test_transformers_does_not_see_an_installed_torch(tmp_path):
    site, marker = fake_torch(tmp_path)
    assert _transformers_sees_torch(site, {}) == "False"
    assert not marker.exists()
    # The operator's switch keeps it visible, and then transformers does import it (so the
    # fake is a real test of the hiding, not a package transformers would skip anyway).
    _transformers_sees_torch(site, {"COUNCILD_IMPORT_TORCH": "1"})
    assert marker.exists()


def test_a_serving_daemon_never_imports_torch(tmp_path):
    site, marker = fake_torch(tmp_path)
    d = start_daemon(tmp_path, BUNDLED_MODEL, env={"PYTHONPATH": f"{site}{os.pathsep}{REPO}"}, wait=False)
    try:
        wait_ready(d, 120)
        with Client(d.endpoint, seat="frameworks", timeout_s=120) as c:
            out = c.complete("def f(x):\n", max_tokens=4)
        assert out.usage.completion_tokens >= 1
    finally:
        d.stop()
    assert not marker.exists(), "the daemon imported torch"
