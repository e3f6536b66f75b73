"""docs/OPERATIONS.md's "Configuration keys" tables cannot drift from daemon/config.py and
governor/config.py: every key is listed, and every listed key exists."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec

from daemon.config import _ENV_KEYS, Config, SeatConfig
from governor.config import GovernorConfig
import pytest

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)

DOC = Path(__file__).resolve().parents[2] / "docs" / "OPERATIONS.md"


def keys(cls, prefix: str = "") -> list[str]:
    """Dotted key paths of a Struct tree: nested tables expanded, seat tables (SeatConfig) named once."""
    out = []
    for f in msgspec.inspect.type_info(cls).fields:
        path = prefix + f.name
        t = f.type
        if isinstance(t, msgspec.inspect.StructType) and t.cls is not SeatConfig:
            out += keys(t.cls, path + ".")  # a table: its keys are documented, not the table
        else:
            out.append(path)
    return out


def doc_section() -> str:
    return DOC.read_text().split("## Configuration keys", 1)[1].split("\n## ", 1)[0]


def documented_keys() -> set[str]:
    return set(re.findall(r"^\| `([a-z_.]+)` \|", doc_section(), re.M))


def test_every_daemon_key_is_documented():
    expected = set(keys(Config))
    assert {"drain_deadline_s", "scheduler.max_queued_per_seat", "speculation.mode"} <= expected
    missing = sorted(expected - documented_keys())
    assert not missing, f"add to the Configuration keys table of docs/OPERATIONS.md: {missing}"


def test_every_governor_key_is_documented():
    expected = {"governor." + k for k in keys(GovernorConfig)}
    assert "governor.linux.psi_some_warn" in expected
    missing = sorted(expected - documented_keys())
    assert not missing, f"add to the [governor] keys table of docs/OPERATIONS.md: {missing}"


def test_no_documented_key_is_stale():
    real = set(keys(Config)) | {"governor." + k for k in keys(GovernorConfig)}
    stale = sorted(documented_keys() - real)
    assert not stale, f"docs/OPERATIONS.md lists keys the config no longer has: {stale}"


def test_seat_fields_and_environment_variables_are_documented():
    section = doc_section()
    for field in msgspec.inspect.type_info(SeatConfig).fields:
        assert f"`{field.name}`" in section, field.name
    for var in _ENV_KEYS:
        assert f"`{var}`" in section, var
