"""`councild prepare`: a first start's checks paid ahead of the first start, then exit.

A real `councild prepare` process on the bundled model with an empty cache folder runs every
start-up part before its "ready", keeps the verdicts and exits 0 without touching the daemon's
endpoint; a real `councild serve` on the same cache folder then finds every verdict (none is
probed again) and serves exact requests with them. A model that is not there is one line and
the config exit code, as for `serve`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from daemon.exits import EXIT_CONFIG
from daemon.paths import BUNDLED_MODEL
from protocol.client import Client

from e2e_harness import REPO, start_daemon


def _prepare(tmp, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, COUNCILD_CACHE_DIR=str(tmp / "cache"), COUNCILD_RUNTIME_DIR=str(tmp / "run"))
    (tmp / "run").mkdir(mode=0o700, exist_ok=True)
    return subprocess.run([sys.executable, "-m", "daemon.cli", "prepare", "--log-format", "json", *extra],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def _events(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_prepare_pays_the_checks_and_a_later_start_finds_every_verdict(tmp_path):
    done = _prepare(tmp_path, "--model", str(BUNDLED_MODEL))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "prepared" in done.stdout and str(tmp_path / "cache" / "probe-verdicts") in done.stdout
    events = _events(done.stderr)
    names = [e["event"] for e in events]
    # Every part ran before its "ready", then it drained with nothing in flight and stopped.
    assert names.index("engine.warmed") < names.index("daemon.start") < names.index("daemon.prepared") \
        < names.index("daemon.stop")
    probed = {e["part"]: e.get("verdict") for e in events if e["event"] == "engine.warm"}
    assert probed["splits"] == probed["verify"] == probed["batch"] == "probed", probed
    assert not (tmp_path / "run" / "councild.sock").exists()  # the daemon's endpoint was never bound
    assert "prefix_cache.disk_opened" not in names  # the serving daemon's disk tier is left alone

    d = start_daemon(tmp_path, BUNDLED_MODEL, env={"COUNCILD_CACHE_DIR": str(tmp_path / "cache")})
    try:
        warm = {e["part"]: e for e in d.events() if e["event"] == "engine.warm"}
        assert {warm[p]["verdict"] for p in ("splits", "verify", "batch")} == {"cached"}, warm
        assert warm["compiled_step"]["compile_check"] == "cached"
        with Client(d.endpoint, seat="prepared", timeout_s=60) as c:
            done = c.complete("def fibonacci(n):\n", max_tokens=8, speculation="exact")
        assert done.usage.completion_tokens == 8 and done.text
    finally:
        d.stop()


def test_prepare_of_a_missing_model_is_one_line_and_the_config_exit_code(tmp_path):
    done = _prepare(tmp_path, "--model", str(tmp_path / "nowhere"))
    assert done.returncode == EXIT_CONFIG
    assert done.stderr.strip().splitlines()[-1].startswith("councild: ")
    assert "prepared" not in done.stdout
