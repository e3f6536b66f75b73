"""bench/README.md indexes every script in bench/: a benchmark's row in its table, a helper
in the helpers list, an answered probe in the probes table under bench/probes/; and every
command the index gives names a script that is there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick  # reads files only

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _index() -> str:
    return (BENCH / "README.md").read_text()


def test_every_script_has_a_row_or_a_helper_line():
    text = _index()
    named = set(re.findall(r"`((?:probes/)?[\w.]+\.(?:py|sh|json))`", text))
    scripts = {p.name for p in BENCH.glob("*.py")} | {p.name for p in BENCH.glob("*.sh")}
    scripts |= {f"probes/{p.name}" for p in (BENCH / "probes").glob("*.py")}
    assert scripts - named == set(), f"scripts the index does not name: {sorted(scripts - named)}"


def test_every_probe_stands_in_the_probes_table():
    probes = _index().split("## Probes", 1)[1].split("\n## ", 1)[0]
    for p in (BENCH / "probes").glob("*.py"):
        assert f"`probes/{p.name}`" in probes, p.name


def test_every_command_names_a_script_that_is_there():
    for path in set(re.findall(r"bench/((?:probes/)?\w+\.(?:py|sh))", _index())) - {"X.py"}:  # the intro's placeholder
        assert (BENCH / path).exists(), path
