"""Shared fixtures for the daemon tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def random_model_path(tmp_path_factory):
    """A small random-weight qwen3_5 checkpoint (+ sidecar MTP head), built once per session."""
    from daemon.engine.model.random_model import build_random_model

    return build_random_model(tmp_path_factory.mktemp("random-qwen35") / "model", seed=0)


@pytest.fixture(scope="module")
def lm(random_model_path):
    """The random checkpoint loaded, once per module that asks (a module may define its own)."""
    from daemon.engine.model.loading import load_model

    return load_model(random_model_path)


@pytest.fixture(scope="module")
def head(lm):
    """The random checkpoint's sidecar MTP head, loaded onto ``lm``."""
    from daemon.engine.model.mtp_head import load_mtp_head

    return load_mtp_head(lm)


@pytest.fixture(scope="module")
def tiny():
    """The bundled model (daemon/assets/tiny-qwen35: trained, so its head's drafts are
    accepted), loaded once per module that asks."""
    from daemon.engine.model.loading import load_model
    from daemon.paths import BUNDLED_MODEL

    return load_model(BUNDLED_MODEL)


@pytest.fixture(scope="module")
def tiny_head(tiny):
    """The bundled model's own MTP head, loaded onto ``tiny``."""
    from daemon.engine.model.mtp_head import load_mtp_head

    return load_mtp_head(tiny)


@pytest.fixture(scope="module")
def code_prompts(tiny):
    """Five short code prompts (one a single token) in the bundled model's tokens."""
    texts = ["def load(path):\n    with open(path) as f:", "import json\n\nclass Encoder:", "x",
             "for i in range(10):\n    print(", "# utilities\n\n\ndef add(a, b):\n    return a + b\n\n\ndef sub(a, b):"]
    return [tiny.tokenizer.encode(t) for t in texts]
