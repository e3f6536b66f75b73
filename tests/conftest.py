"""Fixtures any test folder may share.

``bundled_daemon``: one real daemon on the bundled model with the default configuration,
started once per session (a start costs seconds; several modules need nothing else). Each
test gets it through a function fixture that, after the test, puts the governor back to
``auto`` and checks nothing of the test is still running, so a test cannot leave a pinned
depth or a live request to the next one. Tests use their own seat names.
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "e2e"))  # e2e_harness, for every folder

# The files that take one worker longest (measured: `--durations=0` of a `make test` run,
# summed per file), longest first. Under `--dist loadfile` a file is handed out whole in
# collection order, so these go first: a long file handed out last would be the suite's
# tail, with the other workers idle. Every other file keeps its place after them.
LONGEST_FILES = [
    "tests/daemon/test_fidelity.py",
    "tests/e2e/test_prefix_cache_disk.py",
    "tests/distributed/test_group_faults.py",
    "tests/e2e/test_speculation_served.py",
    "tests/e2e/test_models_hub.py",
    "tests/daemon/test_constraint.py",
    "tests/daemon/test_batch_spec.py",
    "tests/daemon/test_speculative.py",
    "tests/e2e/test_constraint_served.py",
    "tests/e2e/test_faults.py",
    "tests/distributed/test_group_serving.py",
    "tests/e2e/test_lifecycle.py",
]


def pytest_collection_finish(session):
    # Collection imported mlx-lm, transformers and every test module: ~100k objects that live
    # to the end. Freeze them out of the cyclic collector's view, as the daemon freezes its
    # start-up objects: four in-process fidelity tests (~27 s) spent 0.87 s in the collector
    # before, 0.50 s after (gc.callbacks), most of the difference in the full collections.
    # Collect first: garbage frozen would never be freed.
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(items):
    first = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::")[0], len(first)))  # stable: order within a file kept


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
