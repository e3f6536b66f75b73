"""docs/OPERATIONS.md documents every [http] key and every event the front logs."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec

from front.config import HttpConfig
import pytest

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)

REPO = Path(__file__).resolve().parents[2]
DOC = (REPO / "docs" / "OPERATIONS.md").read_text()


def _section(title: str) -> str:
    return DOC.split(title, 1)[1].split("\n#", 1)[0]


def test_every_http_key_is_documented():
    table = _section("### `[http]` keys")
    documented = set(re.findall(r"^\| `([a-z_]+)` \|", table, re.M))
    keys = {f.name for f in msgspec.inspect.type_info(HttpConfig).fields}
    assert {"daemon_probe_timeout_s", "unreachable_hold_s"} <= keys
    assert keys == documented, (sorted(keys - documented), sorted(documented - keys))


def test_every_front_log_event_is_documented():
    emitted = set()
    for path in (REPO / "front").glob("*.py"):
        emitted |= set(re.findall(r"""\.(?:info|warning|error|debug)\(\s*["'](http\.[a-z_]+)\b""", path.read_text()))
    assert {"http.start", "http.daemon_unreachable", "http.daemon_reachable"} <= emitted
    table = DOC.split("Front log events", 1)[1].split("\n\n###", 1)[0]
    documented = set(re.findall(r"^\| `(http\.[a-z_]+)` \|", table, re.M))
    assert emitted == documented, (sorted(emitted - documented), sorted(documented - emitted))
