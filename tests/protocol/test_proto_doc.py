"""PROTOCOL.md cannot drift from messages.py: every message, tag, field, error code and
enumerated value defined there must be documented."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec.inspect as mi
import pytest

from proto_helpers import ALL_TYPES, all_structs
from protocol import messages as m

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)

DOC = (Path(m.__file__).parent / "PROTOCOL.md").read_text()


def _ticked(name: str) -> bool:
    return f"`{name}`" in DOC or f'`"{name}"`' in DOC


def _literals(t: mi.Type):
    if isinstance(t, mi.LiteralType):
        yield from t.values
    elif isinstance(t, mi.UnionType):
        for x in t.types:
            yield from _literals(x)
    elif isinstance(t, mi.ListType):
        yield from _literals(t.item_type)


STRUCTS = all_structs()


def test_version_is_documented():
    assert f"version {m.PROTOCOL_VERSION}" in DOC.splitlines()[0]


@pytest.mark.parametrize("cls", ALL_TYPES, ids=lambda c: c.__name__)
def test_every_message_has_a_section_with_its_tag(cls):
    tag = cls.__struct_config__.tag
    assert re.search(rf"^### `{cls.__name__}` \(type `{tag}`\)", DOC, re.M), f"no section for {cls.__name__}"


def _section(message: type) -> str:
    start = DOC.index(f"### `{message.__name__}`")
    end = DOC.find("\n### ", start + 1)
    return DOC[start:end if end > 0 else None]


def _structs_in(t: mi.Type):
    if isinstance(t, mi.StructType):
        yield t.cls.__name__
        for f in t.fields:  # structs nested in a nested struct live in the same section
            yield from _structs_in(f.type)
    elif isinstance(t, mi.UnionType):
        for x in t.types:
            yield from _structs_in(x)
    elif isinstance(t, mi.ListType):
        yield from _structs_in(t.item_type)


def _home(name: str) -> str:
    """The doc section that must describe a struct's fields: its own for a message, the
    section of the message that holds it for a nested struct."""
    for cls in ALL_TYPES:
        if cls.__name__ == name:
            return _section(cls)
    for cls in ALL_TYPES:
        if any(name in _structs_in(f.type) for f in mi.type_info(cls).fields):
            return _section(cls)
    raise AssertionError(f"{name} is not reachable from any message")


@pytest.mark.parametrize("name", sorted(STRUCTS), ids=str)
def test_every_field_is_documented_in_its_section(name):
    section = _home(name)
    fields = [f.name for f in STRUCTS[name].fields if f.name != "v"]
    missing = [f for f in fields if f"`{f}`" not in section]
    assert not missing, f"{name}: fields missing from its section of PROTOCOL.md: {missing}"
    assert f"`{name}`" in section


def test_nested_structs_have_their_own_table():
    for name, info in STRUCTS.items():
        if info.tag is None:  # a nested map, not a message
            assert f"`{name}`" in DOC, name


@pytest.mark.parametrize("code", m.ErrorCode.__args__)
def test_every_error_code_has_a_row(code):
    assert re.search(rf"^\| `{code}` \|", DOC, re.M), f"error code {code} has no row in the table"


def test_every_enumerated_value_is_documented():
    missing = sorted({v for info in STRUCTS.values() for f in info.fields for v in _literals(f.type) if not _ticked(v)})
    assert not missing, missing


def test_bounds_in_the_tables_match_the_types():
    # The numbers a client in another language needs most.
    for number in (m.MAX_PROMPT_CHARS, m.MAX_MESSAGES, m.MAX_STOP_STRINGS, m.MAX_TOKENS_CEILING):
        assert str(number) in DOC, number
