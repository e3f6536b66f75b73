"""Fixtures: a real daemon process on a real ipc socket (see e2e_harness)."""

from __future__ import annotations

from pathlib import Path

import pytest
from e2e_harness import start_daemon


@pytest.fixture(scope="session")
def e2e_model(tmp_path_factory) -> Path:
    from daemon.engine.model.random_model import build_random_model

    return build_random_model(tmp_path_factory.mktemp("e2e-model") / "model", seed=0)


@pytest.fixture(scope="session")  # shared by test_skeleton and test_hostile: one start, not one per module
def daemon_proc(tmp_path_factory, e2e_model):
    tmp = tmp_path_factory.mktemp("daemon")
    d = start_daemon(tmp, e2e_model, config="heartbeat_timeout_s = 3.0\nheartbeat_interval_s = 0.5\nmax_frame_bytes = 65536\n")
    yield d
    code = d.stop()
    assert code == 0, d.log_path.read_text()[-3000:]
