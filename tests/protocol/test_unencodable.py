"""Text that UTF-8 cannot encode (a lone UTF-16 surrogate) is refused by name before it is
sent: codec.encode raises UnencodableMessage naming the field, the client's request builder
an InvalidRequest (also a ValueError) with code invalid_request, never a UnicodeEncodeError."""

from __future__ import annotations

import pytest

from protocol import InvalidRequest, UnencodableMessage, encode
from protocol import messages as m
from protocol.client import _build_generate
from protocol.unencodable import find_lone_surrogate

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)

GENERATE_DEFAULTS = dict(max_tokens=2, temperature=0.0, top_p=1.0, top_k=0, seed=None, stop=None, priority=None,
                         deadline_ms=None, speculation=None, request_id="r1", stream=True, limits=None)


def test_find_names_the_path_the_index_and_the_code_point():
    assert find_lone_surrogate({"a": ["ok", "é🙂", {"b": "x\udcffy"}]}).describe().startswith(
        "a[2].b: the string holds a lone UTF-16 surrogate (\\udcff at character 1)")
    found = find_lone_surrogate({"p": {"we ird\ud800": 1}})
    assert (found.path, found.in_key, found.code_point, found.index) == ("p", True, 0xD800, 6)
    assert find_lone_surrogate({"not an identifier": "\ud83d"}).path == '["not an identifier"]'
    assert find_lone_surrogate(m.Generate(request_id="r", messages=[m.ChatMessage(role="user", content="\ude00")])) \
        .path == "messages[0].content"
    assert find_lone_surrogate({"a": ["\U0001f600", "日本", 1, None, 2.5]}) is None
    # In a Python str two surrogate code points stay two (only a JSON decoder pairs escapes).
    assert find_lone_surrogate("\ud83d\ude00").index == 0


def test_encode_names_the_field():
    with pytest.raises(UnencodableMessage) as exc:
        encode(m.Hello(seat="s", client="cli\udcff"))
    assert isinstance(exc.value, ValueError)
    assert str(exc.value).startswith("client: the string holds a lone UTF-16 surrogate (\\udcff at character 3)")


@pytest.mark.parametrize("field, args, options", [
    ("prompt", ("a\udcffb", None, None), {}),
    ("messages[1].content", (None, [{"role": "user", "content": "ok"}, {"role": "user", "content": "x\ud83d"}], None), {}),
    ("stop[0]", ("ok", None, None), {"stop": ["\udfff"]}),
    ("tools[0].parameters", ("ok", None, None), {"options": {"tools": [{"name": "f", "parameters": {"k\udcff": 1}}]}}),
])
def test_the_client_refuses_before_sending_with_the_field(field, args, options):
    kw = {**GENERATE_DEFAULTS, **options}
    with pytest.raises(InvalidRequest) as exc:
        _build_generate(*args, **kw)
    assert isinstance(exc.value, ValueError) and exc.value.code == "invalid_request"
    assert exc.value.message.startswith(f"{field}: ") and "lone UTF-16 surrogate" in exc.value.message, exc.value
    assert exc.value.request_id == "r1"


def test_whole_characters_go_through():
    msg, frame = _build_generate("🙂 \U0001f600 日本 \x00", None, None, **GENERATE_DEFAULTS)
    assert msg.prompt == "🙂 \U0001f600 日本 \x00" and frame


def test_an_integer_msgpack_cannot_hold_is_refused_naming_the_field():
    """A JSON body may hold 2**64 anywhere the protocol takes free-form values (a tool's JSON
    Schema): the encoder's OverflowError was a 500 at the HTTP front (its fuzzer found it)."""
    with pytest.raises(InvalidRequest) as exc:
        _build_generate(None, [{"role": "user", "content": "hi"}], None, **GENERATE_DEFAULTS, options={"tools": [
            {"name": "f", "parameters": {"type": "object", "properties": {"n": {"maximum": 2**64}}}}]})
    assert exc.value.message == ("tools[0].parameters.properties.n.maximum: the integer 18446744073709551616 is outside "
                                 "-2**63 .. 2**64-1"), exc.value.message
    with pytest.raises(UnencodableMessage, match=r"^\[0\]: an object key -9223372036854775809 is outside"):
        encode([{-(2**63) - 1: 1}])
    assert encode({"a": [2**64 - 1, -(2**63)]})  # the range's ends are fine
