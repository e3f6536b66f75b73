"""The codec: round trips of every message type, the fixed check order, and fuzzing."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proto_helpers import ALL_TYPES, CLIENT_TYPES, DAEMON_TYPES, message_strategy
from protocol import messages as m
from protocol.codec import ProtocolError, decode_client, decode_daemon, encode, peek_request_id

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def pack(obj) -> bytes:
    return msgspec.msgpack.encode(obj)


def code_of(frame: bytes, max_bytes: int | None = None) -> str:
    with pytest.raises(ProtocolError) as info:
        decode_client(frame) if max_bytes is None else decode_client(frame, max_bytes)
    return info.value.code


# ------------------------------------------------------------------ round trips


@pytest.mark.parametrize("cls", ALL_TYPES, ids=lambda c: c.__name__)
@FAST
@given(data=st.data())
def test_round_trip_every_message_type(cls, data):
    msg = data.draw(message_strategy(cls))
    frame = encode(msg)
    decode = decode_client if cls in CLIENT_TYPES else decode_daemon
    back = decode(frame)
    assert type(back) is cls
    assert back == msg
    assert msgspec.msgpack.decode(frame)["type"] == cls.__struct_config__.tag
    assert msgspec.msgpack.decode(frame)["v"] == m.PROTOCOL_VERSION


def test_every_type_has_a_distinct_tag_and_a_version():
    tags = [c.__struct_config__.tag for c in ALL_TYPES]
    assert len(set(tags)) == len(tags)
    for cls in ALL_TYPES:
        assert cls.__struct_config__.tag_field == "type"
        assert "v" in cls.__struct_fields__


def test_directions_do_not_mix():
    assert code_of(encode(m.Pong(nonce=1))) == "unknown_type"
    with pytest.raises(ProtocolError) as info:
        decode_daemon(encode(m.Ping(nonce=1)))
    assert info.value.code == "unknown_type"


def test_defaults_fill_in():
    msg = decode_client(pack({"type": "generate", "v": 1, "request_id": "r", "prompt": "hi"}))
    assert (msg.max_tokens, msg.temperature, msg.top_p, msg.top_k, msg.stream, msg.stop) == (256, 0.0, 1.0, 0, True, [])
    assert decode_client(pack({"type": "hello", "v": 1})).seat == "default"
    assert decode_client(pack({"type": "ping", "v": 1})).nonce == 0


# ------------------------------------------------------------------ fixed check order


def test_size_first_even_for_garbage():
    assert code_of(b"\xc1" * 101, max_bytes=100) == "frame_too_large"
    valid = encode(m.Generate(request_id="r", prompt="x" * 200))
    assert code_of(valid, max_bytes=100) == "frame_too_large"
    assert code_of(b"\xc1" * 100, max_bytes=100) == "bad_frame"  # at the limit: size passes


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xc1",  # a byte msgpack never uses
        b"\x92\x01\x02",  # an array, not a map
        pack(42),
        pack({"v": 1}),  # no type
        pack({"type": "ping"}),  # no v
        pack({"type": 7, "v": 1}),  # type not a string
        pack({"type": "ping", "v": "1"}),  # v not an int
        pack({"type": "ping", "v": 1})[:-1],  # truncated
        b"\x91" * 100_000 + b"\xc0",  # nested deeper than the decoder goes
    ],
)
def test_garbage_is_bad_frame(frame):
    assert code_of(frame) == "bad_frame"


def test_deep_nesting_inside_a_valid_envelope_is_bad_frame():
    head = pack({"type": "generate", "v": 1, "request_id": "a"})
    for field in (b"\xa6prompt", b"\xa2zz"):
        frame = b"\x84" + head[1:] + field + b"\x91" * 200_000 + b"\xc0"
        assert code_of(frame) == "bad_frame"


def test_version_before_type_and_schema():
    assert code_of(pack({"type": "ping", "v": 2})) == "unsupported_version"
    assert code_of(pack({"type": "no_such_type", "v": 0})) == "unsupported_version"
    assert code_of(pack({"type": "generate", "v": 2, "bogus": {"x": 1}})) == "unsupported_version"


def test_type_before_schema():
    assert code_of(pack({"type": "no_such_type", "v": 1})) == "unknown_type"
    assert code_of(pack({"type": "no_such_type", "v": 1, "request_id": 5})) == "unknown_type"


@pytest.mark.parametrize(
    "fields, path",
    [
        ({"request_id": "has space", "prompt": "x"}, "$.request_id"),
        ({"request_id": "", "prompt": "x"}, "$.request_id"),
        ({"request_id": "r", "prompt": "x", "max_tokens": 0}, "$.max_tokens"),
        ({"request_id": "r", "prompt": "x", "top_p": 0.0}, "$.top_p"),
        ({"request_id": "r", "prompt": "x", "temperature": -1.0}, "$.temperature"),
        ({"request_id": "r", "prompt": "x", "stop": [""]}, "$.stop[0]"),
        ({"request_id": "r", "prompt": "x", "priority": "urgent"}, "$.priority"),
        ({"request_id": "r", "prompt_tokens": [1, -1]}, "$.prompt_tokens[1]"),
        ({"request_id": "r", "messages": [{"role": "user", "content": "a"}, {"role": "god", "content": "b"}]},
         "$.messages[1].role"),
        ({"request_id": "r", "prompt": 5}, "$.prompt"),
        ({"prompt": "x"}, "request_id"),  # missing required field
        ({"request_id": "r", "prompt": "x", "surprise": 1}, "surprise"),  # unknown fields are refused
    ],
)
def test_bad_field_is_invalid_request_naming_the_field(fields, path):
    with pytest.raises(ProtocolError) as info:
        decode_client(pack({"type": "generate", "v": 1, **fields}))
    assert info.value.code == "invalid_request"
    assert path in info.value.message


def test_governor_and_hello_fields():
    assert code_of(pack({"type": "governor", "v": 1, "action": "pin_depth", "depth": 17})) == "invalid_request"
    assert code_of(pack({"type": "hello", "v": 1, "seat": "a/b"})) == "invalid_request"


def test_peek_request_id():
    assert peek_request_id(pack({"type": "generate", "v": 1, "request_id": "abc", "top_p": 9})) == "abc"
    assert peek_request_id(b"\xc1") is None
    assert peek_request_id(pack({"request_id": 5})) is None
    assert peek_request_id(pack({"request_id": "x" * 200})) is None
    assert peek_request_id(b"\x91" * 100_000 + b"\xc0") is None


# ------------------------------------------------------------------ fuzzing

_leaf = (
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats() | st.text(max_size=12)
    | st.binary(max_size=12)
)
_values = st.recursive(_leaf, lambda c: st.lists(c, max_size=4) | st.dictionaries(_leaf, c, max_size=4), max_leaves=12)
_tags = st.sampled_from([c.__struct_config__.tag for c in ALL_TYPES] + ["", "x"])
_field_names = st.sampled_from(sorted({f for c in ALL_TYPES for f in c.__struct_fields__} | {"role", "content", "zz"}))


def _decodes_or_protocol_error(frame: bytes) -> None:
    try:
        msg = decode_client(frame)
    except ProtocolError as exc:
        assert exc.code in m.ErrorCode.__args__
    else:
        assert type(msg) in CLIENT_TYPES


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DEEP = settings(max_examples=5000, deadline=None, suppress_health_check=list(HealthCheck))


@FUZZ
@given(st.binary(max_size=256))
def test_fuzz_random_bytes(frame):
    _decodes_or_protocol_error(frame)


@FUZZ
@given(_values)
def test_fuzz_random_msgpack_values(value):
    _decodes_or_protocol_error(pack(value))


@FUZZ
@given(_tags, st.sampled_from([1, 1, 1, 0, 2]), st.dictionaries(_field_names, _values, max_size=5))
def test_fuzz_envelopes_with_random_fields(tag, v, fields):
    _decodes_or_protocol_error(pack({**fields, "type": tag, "v": v}))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(CLIENT_TYPES).flatmap(message_strategy), st.data())
def test_fuzz_mutated_valid_messages(msg, data):
    raw = msgspec.to_builtins(msg)
    key = data.draw(st.sampled_from(sorted(raw)))
    raw[key] = data.draw(_values)
    frame = pack(raw)
    _decodes_or_protocol_error(frame)
    cut = data.draw(st.integers(0, len(frame)))
    _decodes_or_protocol_error(frame[:cut])



@st.composite
def _mutated(draw):
    raw = msgspec.to_builtins(draw(st.sampled_from(CLIENT_TYPES).flatmap(message_strategy)))
    raw[draw(st.sampled_from(sorted(raw)))] = draw(_values)
    frame = pack(raw)
    return frame[: draw(st.integers(0, len(frame)))]


_any_frame = st.one_of(
    st.binary(max_size=512),
    _values.map(pack),
    st.builds(lambda tag, v, fields: pack({**fields, "type": tag, "v": v}), _tags, st.sampled_from([1, 0, 2]),
              st.dictionaries(_field_names, _values, max_size=6)),
    _mutated(),
)


@pytest.mark.slow
@DEEP
@given(_any_frame)
def test_fuzz_deep(frame):
    """All the fuzzers above with many more examples: `pytest -m slow tests/protocol`."""
    _decodes_or_protocol_error(frame)


def test_a_generate_without_template_options_does_not_carry_the_field():
    """An older daemon (forbid unknown fields) must still accept a newer client's requests
    that do not use chat_template_kwargs, as for the sampling options."""
    from protocol.client import _build_generate

    msg, frame = _build_generate("hi", None, None, max_tokens=4, temperature=0.0, top_p=1.0, top_k=0, seed=None,
                                 stop=None, priority=None, deadline_ms=None, speculation=None, request_id=None,
                                 stream=True, limits=None)
    assert b"chat_template_kwargs" not in frame
    msg, frame = _build_generate(None, [{"role": "user", "content": "hi"}], None, max_tokens=4, temperature=0.0,
                                 top_p=1.0, top_k=0, seed=None, stop=None, priority=None, deadline_ms=None,
                                 speculation=None, request_id=None, stream=True, limits=None,
                                 chat_template_kwargs={"enable_thinking": False})
    assert b"chat_template_kwargs" in frame and b"enable_thinking" in frame


@pytest.mark.parametrize("params, says", [
    ({"type": "object", "properties": True}, "parameters.properties must be an object of schemas"),
    ({"type": "object", "properties": ["city"]}, "parameters.properties must be an object of schemas"),
    ({"type": "object", "properties": {}, "required": "city"}, "parameters.required must be a list of property names"),
    ({"type": "object", "properties": {}, "required": [{"a": 1}]}, "parameters.required must be a list"),
])
def test_tool_parameters_of_the_wrong_shape_are_invalid_at_the_tools_path(params, says):
    """The daemon's chat template and call parser walk properties and required as JSON Schema
    has them; the socket thread built the call parser before anything else looked, so a
    `properties: 1` ended as an internal error (the field fuzzer, tests/e2e/test_fuzz_fields.py)."""
    frame = encode({"type": "generate", "v": 1, "request_id": "r1", "messages": [{"role": "user", "content": "hi"}],
                    "tools": [{"name": "f", "parameters": params}]})
    with pytest.raises(ProtocolError) as exc:
        decode_client(frame)
    assert exc.value.code == "invalid_request" and says in exc.value.message
    assert exc.value.message.endswith("at `$.tools[0]`"), exc.value.message
    assert decode_client(encode({"type": "generate", "v": 1, "request_id": "r1", "prompt": "x", "tools": [
        {"name": "f", "parameters": {"type": "object", "properties": {"a": True}, "required": ["a"]}}]}))
