"""The constraints the constrained-decoding tests run, one of each kind (a JSON schema,
bounded so that even a random model closes it quickly; any JSON object; a regex; a Lark
grammar), and the check that an output is what its constraint asked for. Shared by the
engine's tests (tests/daemon/test_constraint.py) and the served ones
(tests/e2e/test_constraint_served.py), so both hold the same grammars to the same check."""

from __future__ import annotations

import json
import re

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "color": {"enum": ["red", "green", "blue"]}},
          "required": ["name", "age", "color"], "additionalProperties": False}
REGEX = r"(def|class) [a-z_]+\(\)\n"
LARK = 'start: line line?\nline: "x = " NUM "\\n"\nNUM: /[0-9]{1,4}/'
# kind -> the constraint's value, in the order the tests parametrize them.
CASES = {"json_schema": json.dumps(SCHEMA), "json_object": "", "regex": REGEX, "lark": LARK}


def check_output(kind: str, text: str) -> None:
    """The output is what the constraint asked for, whole (the decode ended at the grammar's end)."""
    if kind == "json_schema":
        obj = json.loads(text)
        assert set(obj) == {"name", "age", "color"}, obj
        assert isinstance(obj["age"], int) and 0 <= obj["age"] <= 120
        assert obj["color"] in ("red", "green", "blue") and len(obj["name"]) <= 12
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert re.fullmatch(r"(x = [0-9]{1,4}\n){1,2}", text), text
