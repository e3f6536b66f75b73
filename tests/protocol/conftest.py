"""Fixtures for the protocol tests: a short ipc endpoint and a fake daemon factory."""

from __future__ import annotations

import pytest

from proto_helpers import FakeDaemon


@pytest.fixture
def endpoint(tmp_path) -> str:
    path = tmp_path / "d.sock"
    assert len(str(path)) < 100, "ipc paths must fit in sun_path"
    return f"ipc://{path}"


@pytest.fixture
def fake_daemon(endpoint):
    """Call with a handler and options; the fake is stopped after the test."""
    started: list[FakeDaemon] = []

    def start(handler=None, **kwargs) -> FakeDaemon:
        fake = FakeDaemon(endpoint, handler, **kwargs).start()
        started.append(fake)
        return fake

    yield start
    for fake in started:
        fake.stop()
