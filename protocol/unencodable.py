"""Finding the value that cannot go on the wire: a string holding a lone UTF-16 surrogate,
or an integer msgpack has no room for.

Python strings may hold code points U+D800..U+DFFF on their own (a JSON text that escapes
half of an emoji, ``"\\udcff"``, decodes to one; so does ``bytes.decode(errors=
"surrogateescape")``), but UTF-8 cannot encode them, so msgpack cannot carry them. The codec
(encoding), the reference client (before sending) and the HTTP front (a request body) all
name the offending field with ``find_lone_surrogate``, so a caller learns where the bad text
is instead of meeting a UnicodeEncodeError from deep inside an encoder. Likewise
``find_huge_int`` names an integer outside msgpack's range (-2**63 .. 2**64-1), which a JSON
body may hold anywhere the protocol takes free-form values (a tool's JSON Schema).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import msgspec

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class LoneSurrogate:
    path: str  # where, as a field path: messages[0].content ("" for the top level)
    index: int  # the code point's position in the string
    code_point: int
    in_key: bool  # the surrogate is in an object key at ``path``, not in its value

    def describe(self) -> str:
        """``path: ...`` naming the field and the character."""
        where = self.path or "the body"
        thing = "an object key" if self.in_key else "the string"
        return (f"{where}: {thing} holds a lone UTF-16 surrogate (\\u{self.code_point:04x} at character "
                f"{self.index}), which is not valid Unicode; send whole characters")


def _bad_index(text: str) -> int | None:
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def _key_path(path: str, key: str) -> str:
    if _IDENTIFIER.match(key):
        return f"{path}.{key}" if path else key
    return f"{path}[{json.dumps(key)}]"


def _walk(value: Any):
    """(path, value, is_key) for every value and object key in ``value``, depth first, in
    order, without recursion (dicts, lists, tuples and msgspec Structs)."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, v = stack.pop()
        yield path, v, False
        if isinstance(v, dict):
            children = []
            for key, item in v.items():
                yield path, key, True
                children.append((_key_path(path, key) if isinstance(key, str) else f"{path}[{key!r}]", item))
            stack.extend(reversed(children))
        elif isinstance(v, (list, tuple)):
            stack.extend(reversed([(f"{path}[{i}]", item) for i, item in enumerate(v)]))
        elif isinstance(v, msgspec.Struct):
            stack.extend(reversed([(_key_path(path, name), getattr(v, name)) for name in v.__struct_fields__]))


def find_lone_surrogate(value: Any) -> LoneSurrogate | None:
    """The first string (value or object key) in ``value`` that UTF-8 cannot encode; None
    when every string is valid Unicode."""
    for path, v, is_key in _walk(value):
        if isinstance(v, str):
            i = _bad_index(v)
            if i is not None:
                return LoneSurrogate(path, i, ord(v[i]), in_key=is_key)
    return None


def find_huge_int(value: Any) -> str | None:
    """``path: ...`` naming the first integer (value or key) in ``value`` outside msgpack's
    range; None when there is none."""
    for path, v, is_key in _walk(value):
        if isinstance(v, int) and not isinstance(v, bool) and not -(1 << 63) <= v < (1 << 64):
            where = path or "the message"
            thing = "an object key" if is_key else "the integer"
            return f"{where}: {thing} {str(v)[:24]}{'...' if len(str(v)) > 24 else ''} is outside -2**63 .. 2**64-1"
    return None
