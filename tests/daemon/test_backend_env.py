"""engine/jit/backend_env.py: the MLX process switches a daemon sets before its first
forward, so a new shape costs what was measured. What they do is measured on the H200
(bench/probes/attention_first_use.py); here: which variables are set, that an operator's own value
wins, and that the daemon logs them."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from daemon.engine.jit import backend_env as be

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)


def test_default_keeps_attention_off_cudnn_and_the_thrashing_error_off():
    env: dict = {}
    out = be.configure(False, Path("/var/cache/councild/mlx-ptx"), env)
    assert env == {be.CUDNN_SDPA: "0", be.THRASHING_CHECK: "0", be.PTX_CACHE_DIR: "/var/cache/councild/mlx-ptx"}
    assert out[be.CUDNN_SDPA] == ("0", "set") and be.SDPA_CACHE_SIZE not in out


def test_cudnn_on_sizes_the_plan_cache_and_still_never_raises():
    env: dict = {}
    be.configure(True, None, env)
    assert env == {be.CUDNN_SDPA: "1", be.THRASHING_CHECK: "0", be.SDPA_CACHE_SIZE: str(be.SDPA_PLANS_WITH_CUDNN)}


def test_an_operators_environment_wins_and_is_reported_as_theirs():
    env = {be.CUDNN_SDPA: "1", be.PTX_CACHE_DIR: "/fast/ptx"}
    out = be.configure(False, Path("/elsewhere"), env)
    assert env[be.CUDNN_SDPA] == "1" and env[be.PTX_CACHE_DIR] == "/fast/ptx"
    assert out[be.CUDNN_SDPA] == ("1", "operator") and out[be.PTX_CACHE_DIR] == ("/fast/ptx", "operator")
    assert out[be.THRASHING_CHECK] == ("0", "set")


def test_the_ptx_folder_is_per_mlx_version_unless_the_operator_names_one(tmp_path):
    # A module's name stays when a new MLX changes its code: a shared folder would serve it stale.
    assert be.ptx_cache_folder(tmp_path, {}) == tmp_path / "mlx-ptx" / mx.__version__
    assert be.ptx_cache_folder(tmp_path, {be.PTX_CACHE_DIR: "/fast/ptx"}) == Path("/fast/ptx")


def test_the_daemon_logs_what_it_set_before_the_model_loads(bundled_daemon):
    events = [e["event"] for e in bundled_daemon.events()]
    assert "engine.backend_env" in events and events.index("engine.backend_env") < events.index("model.loaded")
    (ev,) = [e for e in bundled_daemon.events() if e["event"] == "engine.backend_env"]
    assert ev[be.CUDNN_SDPA] in ("0 (set)", "0 (operator)", "1 (operator)")
    assert ev[be.THRASHING_CHECK].startswith("0") or ev[be.THRASHING_CHECK].endswith("(operator)")
    assert ev[be.PTX_CACHE_DIR].endswith(f"mlx-ptx/{mx.__version__} (set)") or ev[be.PTX_CACHE_DIR].endswith("(operator)")
