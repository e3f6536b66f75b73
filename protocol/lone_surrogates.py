"""Finding the string that cannot go on the wire: one holding a lone UTF-16 surrogate.

Python strings may hold code points U+D800..U+DFFF on their own (a JSON text that escapes
half of an emoji, ``"\\udcff"``, decodes to one; so does ``bytes.decode(errors=
"surrogateescape")``), but UTF-8 cannot encode them, so msgpack cannot carry them. The codec
(encoding), the reference client (before sending) and the HTTP front (a request body) all
name the offending field with ``find_lone_surrogate``, so a caller learns where the bad text
is instead of meeting a UnicodeEncodeError from deep inside an encoder.
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


def find_lone_surrogate(value: Any) -> LoneSurrogate | None:
    """The first string (value or object key) in ``value`` that UTF-8 cannot encode, walking
    dicts, lists, tuples and msgspec Structs depth first without recursion; None when every
    string is valid Unicode."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            i = _bad_index(v)
            if i is not None:
                return LoneSurrogate(path, i, ord(v[i]), in_key=False)
        elif isinstance(v, dict):
            children = []
            for key, item in v.items():
                if isinstance(key, str):
                    i = _bad_index(key)
                    if i is not None:
                        return LoneSurrogate(path, i, ord(key[i]), in_key=True)
                    children.append((_key_path(path, key), item))
                else:
                    children.append((f"{path}[{key!r}]", item))
            stack.extend(reversed(children))
        elif isinstance(v, (list, tuple)):
            stack.extend(reversed([(f"{path}[{i}]", item) for i, item in enumerate(v)]))
        elif isinstance(v, msgspec.Struct):
            fields = [(_key_path(path, name), getattr(v, name)) for name in v.__struct_fields__]
            stack.extend(reversed(fields))
    return None
