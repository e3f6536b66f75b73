"""Held-out tool schemas and schema-answer schemas (none is the demo's weather tool), and a
small JSON Schema checker for what they use: shared by the e2e tests
(tests/e2e/test_http_tool_close.py) and bench/tool_close_bench.py, which measures how many
forced calls and schema answers close valid within their token budget."""

from __future__ import annotations

import re

S = {"type": "string"}
INT = {"type": "integer"}


def obj(props: dict, required: list[str] | None = None, extra: bool | None = None) -> dict:
    out = {"type": "object", "properties": props, "required": list(props) if required is None else required}
    if extra is not None:
        out["additionalProperties"] = extra
    return out


# name -> (description, parameters): paths, patterns, integers, booleans, enums, arrays,
# nested objects, several of them at once.
TOOLS: dict[str, tuple[str, dict]] = {
    "read_file": ("Read a file", obj({"path": S})),
    "write_file": ("Write a file", obj({"path": S, "content": S})),
    "list_dir": ("List a folder", obj({"path": S, "recursive": {"type": "boolean"}}, ["path"])),
    "grep": ("Search files for a pattern", obj({"pattern": S, "path": S, "ignore_case": {"type": "boolean"}},
                                              ["pattern"])),
    "run_shell": ("Run a shell command", obj({"command": S, "timeout_s": {"type": "integer", "minimum": 1,
                                                                             "maximum": 600}}, ["command"])),
    "http_get": ("Fetch a URL", obj({"url": {"type": "string", "pattern": "^https?://"}})),
    "set_volume": ("Set the volume", obj({"level": {"type": "integer", "minimum": 0, "maximum": 100}})),
    "toggle_light": ("Switch a light", obj({"room": {"enum": ["kitchen", "hall", "bedroom"]},
                                           "on": {"type": "boolean"}})),
    "send_email": ("Send an email", obj({"to": {"type": "array", "items": S, "minItems": 1, "maxItems": 3},
                                        "subject": S, "body": S}, ["to", "subject"])),
    "create_event": ("Add a calendar event", obj({"title": S, "date": {"type": "string", "pattern":
                                                                       "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                                                 "attendees": {"type": "array", "items": S, "maxItems": 4}},
                                                ["title", "date"])),
    "convert_units": ("Convert a quantity", obj({"value": {"type": "number"}, "from_unit": {"enum": ["m", "ft",
                                                                                                  "km", "mi"]},
                                                "to_unit": {"enum": ["m", "ft", "km", "mi"]}})),
    "git_commit": ("Commit staged changes", obj({"message": {"type": "string", "maxLength": 72},
                                                "amend": {"type": "boolean"}}, ["message"])),
    "resize_image": ("Resize an image", obj({"path": S, "size": obj({"width": {"type": "integer", "minimum": 1,
                                                                              "maximum": 4096},
                                                                     "height": {"type": "integer", "minimum": 1,
                                                                                "maximum": 4096}})})),
    "add_todo": ("Add a to-do item", obj({"text": S, "priority": {"enum": ["low", "medium", "high"]},
                                         "tags": {"type": "array", "items": S, "maxItems": 3}}, ["text"])),
    "query_db": ("Run a SQL query", obj({"sql": S, "limit": {"type": "integer", "minimum": 1, "maximum": 1000}},
                                        ["sql"])),
    "translate": ("Translate text", obj({"text": S, "target": {"type": "string", "pattern": "^[a-z]{2}$"}})),
    "move_file": ("Move a file", obj({"src": S, "dst": S, "overwrite": {"type": "boolean"}}, ["src", "dst"])),
    "set_timer": ("Start a timer", obj({"minutes": {"type": "integer", "minimum": 1, "maximum": 120},
                                       "label": S}, ["minutes"])),
    "search_web": ("Search the web", obj({"query": S, "max_results": {"type": "integer", "minimum": 1,
                                                                      "maximum": 10}}, ["query"])),
    "update_config": ("Change a setting", obj({"key": {"type": "string", "pattern": "^[a-z_.]+$"},
                                              "value": {"type": ["string", "integer", "boolean"]}})),
    "rate_item": ("Rate an item", obj({"item_id": {"type": "integer", "minimum": 0}, "stars": {"enum": [1, 2, 3, 4,
                                                                                                     5]}})),
    "deploy": ("Deploy a service", obj({"service": S, "env": {"enum": ["dev", "staging", "prod"]},
                                       "replicas": {"type": "integer", "minimum": 1, "maximum": 20},
                                       "dry_run": {"type": "boolean"}}, ["service", "env"])),
    "plot": ("Plot numbers", obj({"points": {"type": "array", "items": {"type": "number"}, "minItems": 1,
                                             "maxItems": 5}, "title": S}, ["points"])),
    "open_issue": ("Open a tracker issue", obj({"title": S, "labels": {"type": "array", "items": {
        "enum": ["bug", "feature", "docs"]}, "maxItems": 3}, "assignee": obj({"login": S})}, ["title"])),
}

# Strict json_schema answers with free strings.
ANSWERS: dict[str, dict] = {
    "person": obj({"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 150}}, extra=False),
    "summary": obj({"title": S, "points": {"type": "array", "items": S, "maxItems": 4}}, extra=False),
    "tags": obj({"tags": {"type": "array", "items": S}}, extra=False),
    "verdict": obj({"ok": {"type": "boolean"}, "reason": S}, extra=False),
    "address": obj({"street": S, "city": S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, extra=False),
    "task": obj({"title": S, "done": {"type": "boolean"}, "priority": {"enum": ["low", "high"]}}, extra=False),
    "review": obj({"score": {"type": "integer", "minimum": 1, "maximum": 5}, "comment": S}, extra=False),
    "contact": obj({"name": S, "emails": {"type": "array", "items": S, "maxItems": 2}}, extra=False),
    "step_list": obj({"steps": {"type": "array", "items": obj({"action": S}, extra=False), "maxItems": 3}},
                     extra=False),
    "error": obj({"code": {"type": "integer"}, "message": S}, extra=False),
    "book": obj({"title": S, "author": S, "year": {"type": "integer", "minimum": 1400, "maximum": 2100}},
                extra=False),
    "city": obj({"name": S, "country": S}, extra=False),
    "note": obj({"text": S}, extra=False),
    "pair": obj({"key": S, "value": S}, extra=False),
    "label": obj({"label": {"enum": ["spam", "ham"]}, "why": S}, extra=False),
    "recipe": obj({"dish": S, "ingredients": {"type": "array", "items": S, "maxItems": 5}}, extra=False),
    "answer": obj({"answer": S, "confidence": {"type": "number", "minimum": 0, "maximum": 1}}, extra=False),
    "user": obj({"login": S, "admin": {"type": "boolean"}, "profile": obj({"bio": S}, extra=False)}, extra=False),
    "route": obj({"from": S, "to": S, "stops": {"type": "array", "items": S, "maxItems": 3}}, extra=False),
    "commit": obj({"message": {"type": "string", "maxLength": 50}, "files": {"type": "array", "items": S,
                                                                            "maxItems": 3}}, extra=False),
}

ASK_TOOL = "Please use the {name} tool ({description}) now."
ASK_ANSWER = "Answer as JSON ({name})."


def openai_tool(name: str) -> dict:
    description, params = TOOLS[name]
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


def anthropic_tool(name: str) -> dict:
    description, params = TOOLS[name]
    return {"name": name, "description": description, "input_schema": params}


def _type_ok(value, t: str) -> bool:
    return {"string": isinstance(value, str), "boolean": isinstance(value, bool),
            "integer": isinstance(value, int) and not isinstance(value, bool),
            "number": isinstance(value, (int, float)) and not isinstance(value, bool),
            "array": isinstance(value, list), "object": isinstance(value, dict),
            "null": value is None}.get(t, False)


def errors(value, schema: dict, where: str = "$") -> list[str]:
    """Where ``value`` breaks ``schema`` (the JSON Schema subset the cases above use)."""
    out: list[str] = []
    t = schema.get("type")
    if t is not None and not any(_type_ok(value, x) for x in (t if isinstance(t, list) else [t])):
        return [f"{where}: {value!r} is not {t}"]
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{where}: {value!r} not in {schema['enum']}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            out.append(f"{where}: {value} < {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            out.append(f"{where}: {value} > {schema['maximum']}")
    if isinstance(value, str):
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            out.append(f"{where}: longer than {schema['maxLength']}")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            out.append(f"{where}: {value!r} does not match {schema['pattern']}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems", len(value)):
            out.append(f"{where}: {len(value)} items")
        for i, item in enumerate(value):
            out += errors(item, schema.get("items", {}), f"{where}[{i}]")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                out.append(f"{where}: {key!r} missing")
        for key, item in value.items():
            if key in props:
                out += errors(item, props[key], f"{where}.{key}")
            elif schema.get("additionalProperties") is False:
                out.append(f"{where}: {key!r} not allowed")
    return out
