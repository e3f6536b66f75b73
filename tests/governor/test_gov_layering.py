"""The layering rules: governor/ imports nothing from daemon/, and nothing of zmq or mlx."""

from __future__ import annotations

import ast
import pathlib

import governor
import pytest

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)

FORBIDDEN = {"daemon", "zmq", "mlx", "mlx_lm"}


def _imports(path: pathlib.Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_governor_imports_no_daemon_zmq_or_mlx():
    root = pathlib.Path(governor.__file__).parent
    files = sorted(root.rglob("*.py"))
    assert len(files) >= 10
    for f in files:
        bad = _imports(f) & FORBIDDEN
        assert not bad, f"{f.relative_to(root)} imports {bad}"
