"""Shared fixtures for the daemon tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def random_model_path(tmp_path_factory):
    """A small random-weight qwen3_5 checkpoint (+ sidecar MTP head), built once per session."""
    from daemon.engine.random_model import build_random_model

    return build_random_model(tmp_path_factory.mktemp("random-qwen35") / "model", seed=0)
