"""`councild http`'s configuration and its place in the layering: it is a protocol client."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

import front
from front.config import HttpConfigError, load_http_config

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_front_imports_only_the_protocol():
    """Never the engine, the daemon, the governor or mlx: the daemon owns the model."""
    for path in pathlib.Path(front.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            for name in names:
                assert name.split(".")[0] not in ("daemon", "governor", "mlx", "mlx_lm"), (path.name, name)


def test_non_loopback_needs_api_keys(tmp_path):
    with pytest.raises(HttpConfigError, match="api_keys"):
        load_http_config(None, {"host": "0.0.0.0"})
    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text('endpoint = "ipc:///tmp/x.sock"\n[http]\nhost = "0.0.0.0"\napi_keys = { "k1" = "planner" }\n')
    cfg, endpoint = load_http_config(cfg_file)
    assert cfg.api_keys == {"k1": "planner"} and endpoint == "ipc:///tmp/x.sock"
    cfg_file.write_text('[http]\napi_keys = { "k1" = "bad seat!" }\n')
    with pytest.raises(HttpConfigError, match=r"\$\.http\.api_keys"):
        load_http_config(cfg_file)


def test_cli_refuses_a_public_bind_without_keys():
    r = subprocess.run([sys.executable, "-m", "daemon.cli", "http", "--host", "0.0.0.0", "--port", "1"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 78 and "api_keys" in r.stderr
