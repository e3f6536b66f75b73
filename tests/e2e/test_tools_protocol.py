"""Tools and count_only over the ZeroMQ protocol itself (the reference Python client against
a live daemon): what council processes get without the HTTP front."""

from __future__ import annotations

import pytest

from protocol import Client
from protocol.client import InvalidRequest

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)

TOOLS = [{"name": "get_weather", "description": "weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
CHAT = [{"role": "user", "content": "Weather in Paris?"}]


def test_count_only_counts_without_decoding(daemon_proc):
    with Client(daemon_proc.endpoint, seat="counter") as c:
        assert {"tools", "count_only"} <= set(c.welcome.capabilities)
        stream = c.generate(messages=CHAT, max_tokens=1, count_only=True)
        done = stream.result()
        assert done.text == "" and done.usage.completion_tokens == 0 and stream.token_ids == []
        assert done.usage.prompt_tokens == stream.accepted.prompt_tokens > 0
        real = c.complete(messages=CHAT, max_tokens=2)
        assert real.usage.prompt_tokens == done.usage.prompt_tokens
        with_tools = c.generate(messages=CHAT, max_tokens=1, count_only=True, tools=TOOLS).result()
        assert with_tools.usage.prompt_tokens > done.usage.prompt_tokens + 20  # the template showed the tool


def test_tools_with_auto_and_a_tool_turn(daemon_proc):
    with Client(daemon_proc.endpoint, seat="tooler") as c:
        turn = CHAT + [{"role": "assistant", "content": "",
                        "tool_calls": [{"id": "call_9", "name": "get_weather", "arguments": '{"city": "Paris"}'}]},
                       {"role": "tool", "content": "sunny", "tool_call_id": "call_9", "name": "get_weather"}]
        done = c.complete(messages=turn, tools=TOOLS, tool_choice="auto", max_tokens=6)
        assert done.finish_reason in ("length", "stop", "tool_calls")
        assert (done.finish_reason == "tool_calls") == bool(done.tool_calls)


def test_tool_requests_the_daemon_refuses(daemon_proc):
    with Client(daemon_proc.endpoint, seat="tooler") as c:
        with pytest.raises(InvalidRequest, match="messages only"):
            c.complete(prompt="x", tools=TOOLS, max_tokens=2)
        with pytest.raises(InvalidRequest):  # a bad name never leaves the client
            c.generate(messages=CHAT, tools=[{"name": "has space"}], max_tokens=2)
