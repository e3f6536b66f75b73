"""The quick tier is wired: the `quick` marker is registered, `make check` selects it with the
suite's own workers, CI still runs the whole suite, and the tier reaches every test folder
(tests/README.md, "Which tier a new test belongs to")."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

# The wiring checks are quick; the folder census collects the whole tree (~20 s): the full suite only.

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ["protocol", "governor", "front", "daemon", "e2e"]


def _make_n(target: str) -> str:
    """The pytest command line `make -n TARGET` would run (a stale .venv stamp adds the
    bootstrap lines before it; they are not run with -n)."""
    out = subprocess.run(["make", "-n", "-s", target], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if " -m pytest " in line]
    assert len(lines) == 1, out.stdout
    return lines[0]


@pytest.mark.quick
def test_the_quick_marker_is_registered():
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    names = [m.split(":")[0].strip() for m in ini["markers"]]
    assert "quick" in names and "slow" in names, names


@pytest.mark.quick
def test_make_check_runs_the_quick_tier_with_the_suites_workers_and_ci_runs_make_test():
    check, full = _make_n("check"), _make_n("test")
    assert '-m "quick and not slow"' in check, check
    assert check.replace(' -m "quick and not slow"', "") == full, (check, full)  # same PYTEST_ARGS
    assert "-n 2 --dist loadfile" in full, full
    assert " -m " not in full.replace("-m pytest", ""), full  # the whole suite: no marker of its own
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, re.M) and "make check" not in ci, ci


def test_the_quick_tier_reaches_every_test_folder():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "quick and not slow", "tests"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ids = [line for line in out.stdout.splitlines() if "::" in line]
    per_folder = {f: sum(1 for i in ids if i.startswith(f"tests/{f}/")) for f in FOLDERS}
    assert all(per_folder.values()), per_folder
    # a tier, not the suite: the quick tests are a minority of what `make test` collects
    m = re.search(r"(\d+)/(\d+) tests collected \((\d+) deselected\)", out.stdout)
    assert m, out.stdout[-500:]
    selected, total = int(m.group(1)), int(m.group(2))
    assert selected == len(ids) and 0 < selected < total, (selected, total)
