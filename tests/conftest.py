"""Fixtures any test folder may share.

``bundled_daemon``: one real daemon on the bundled model with the default configuration,
started once per session (a start costs seconds; several modules need nothing else). Each
test gets it through a function fixture that, after the test, puts the governor back to
``auto`` and checks nothing of the test is still running, so a test cannot leave a pinned
depth or a live request to the next one. Tests use their own seat names.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))  # e2e_harness, for every folder


@pytest.fixture(scope="session")
def _bundled_daemon_session(tmp_path_factory):
    from daemon.paths import BUNDLED_MODEL
    from e2e_harness import start_daemon

    assert (BUNDLED_MODEL / "config.json").exists(), "the bundled model is part of the repository"
    d = start_daemon(tmp_path_factory.mktemp("bundled"), BUNDLED_MODEL)
    yield d
    code = d.stop()
    assert code == 0, d.log_path.read_text()[-3000:]


@pytest.fixture
def bundled_daemon(_bundled_daemon_session):
    yield _bundled_daemon_session
    from protocol.client import Client

    with Client(_bundled_daemon_session.endpoint, seat="fixture-reset", timeout_s=30) as c:
        assert c.governor("auto").ok
        deadline = time.monotonic() + 10
        while (status := c.status()).active + status.queued and time.monotonic() < deadline:
            time.sleep(0.05)
        assert status.active + status.queued == 0, f"a test left work on the shared daemon: {status.detail}"
