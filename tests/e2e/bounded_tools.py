"""Two function tools whose parameters are bounded (small integers, an enum), so that even the
random test model ends a call quickly under the grammar; in the chat completions shape and in
the Responses API's flat one, and the check a call's arguments must pass."""

from __future__ import annotations

import json

FORECAST_PARAMS = {"type": "object", "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 9},
                                                    "unit": {"enum": ["c", "f"]}}, "required": ["days", "unit"]}
ALARM_PARAMS = {"type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["hour"]}
RESPONSES_TOOLS = [{"type": "function", "name": "forecast", "description": "Weather forecast",
                    "parameters": FORECAST_PARAMS},
                   {"type": "function", "name": "alarm", "description": "Set an alarm", "parameters": ALARM_PARAMS}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in RESPONSES_TOOLS]


def check_args(name: str, arguments: str) -> None:
    """A call's arguments (JSON text) are what its tool's schema admits."""
    args = json.loads(arguments)
    if name == "forecast":
        assert set(args) == {"days", "unit"} and 1 <= args["days"] <= 9 and args["unit"] in ("c", "f")
    else:
        assert set(args) == {"hour"} and 0 <= args["hour"] <= 9
