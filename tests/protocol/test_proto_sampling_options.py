"""Generate's sampling options (added within version 1) are encoded only when used, so a
daemon that predates them still accepts every request that does not use them."""

from __future__ import annotations

import msgspec
import pytest

from protocol import messages as m
from protocol.client import InvalidRequest, _build_generate

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)


def build(**options):
    return _build_generate("hi", None, None, max_tokens=5, temperature=0.0, top_p=1.0, top_k=0, seed=None, stop=None,
                           priority=None, deadline_ms=None, speculation=None, request_id="r1", stream=True, limits=None,
                           options=options)


def test_unused_options_are_not_on_the_wire():
    msg, frame = build(min_p=0.0, logprobs=False, logit_bias=None)  # all at their defaults
    keys = set(msgspec.msgpack.decode(frame))
    assert not keys & set(m.SAMPLING_DEFAULTS)
    assert msg.option("repetition_penalty") == 1.0 and msg.option("logit_bias") is None


def test_used_options_travel_and_are_validated():
    msg, frame = build(logit_bias={7: -100.0}, top_logprobs=3, logprobs=True)
    assert msgspec.msgpack.decode(frame)["logit_bias"] == {7: -100.0}
    assert msg.option("top_logprobs") == 3
    with pytest.raises(InvalidRequest, match="top_logprobs"):
        build(top_logprobs=21)
    with pytest.raises(InvalidRequest, match="logit_bias"):
        build(logit_bias={5: 101.0})
    with pytest.raises(TypeError):
        build(temperature_boost=2)
