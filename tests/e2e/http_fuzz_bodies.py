"""Request bodies for the HTTP front's fuzzer (test_http_fuzz.py).

For each route a strategy builds a body from the route's own request fields (the ones
docs/OPERATIONS.md lists for it, with values the route accepts, max_tokens 1-2 so that a
body that generates costs a few milliseconds), then ``mutated`` applies zero to three
mutations: a value replaced by a hostile one (wrong type, extreme number, unusual or invalid
Unicode, deep nesting, a huge string), a field deleted, a field added (unknown, or another
route's), or the whole body broken (not an object, truncated, NaN literals, duplicate keys,
trailing bytes, over the size limit).

``encode`` writes a body as the bytes that go on the wire: ``Raw`` values are spliced in as
they are (invalid UTF-8, numbers JSON's encoders refuse to write, nesting deeper than they
recurse), and lone surrogates come out either as JSON escapes (``"\\udcff"``) or as the raw
bytes of their CESU-8 form, at random.
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass

from hypothesis import strategies as st

VOCAB = 512  # the random test model's (daemon/engine/model/random_model.py)


@dataclass(frozen=True)
class Raw:
    """Bytes written into the body's JSON text as they are."""

    data: bytes


# ------------------------------------------------------------------------------ valid parts

TEXT = st.one_of(st.sampled_from(["Hi", "Name three rivers.", "def f(x):", "Paris", "x = 1", "é", "日本語", "🙂", " "]),
                 st.text(min_size=1, max_size=16))
NAMES = st.sampled_from(["get_weather", "lookup", "f"])
SCHEMAS = st.sampled_from([
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}},
    {"type": "object", "properties": {"u": {"type": "string", "enum": ["metric", "imperial"]},
                                      "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2}}},
    {"type": "object", "properties": {"where": {"type": "object", "properties": {"lat": {"type": "number"}}}}},
    {"type": "object", "properties": {}},
])
SAMPLING = {  # councild's extras and the shared sampling options, valid values
    "temperature": st.sampled_from([0, 0.0, 0.7, 1, 2]),
    "top_p": st.sampled_from([1, 0.9, 0.5]),
    "seed": st.integers(0, 2**63 - 1),
    "top_k": st.integers(0, 8),
    "min_p": st.sampled_from([0.0, 0.05]),
    "repetition_penalty": st.sampled_from([1.0, 1.1]),
    "priority": st.sampled_from(["interactive", "normal", "background"]),
    "speculation": st.sampled_from(["off", "exact", "fast"]),
    "deadline_ms": st.integers(30_000, 600_000),
}


# Plain bodies most often: a forced tool call or a json_schema answer compiles a grammar
# (~1 s on this CPU), the costliest valid body by far.
KINDS = st.sampled_from(["plain"] * 6 + ["tools", "tools", "json"])


def optional(draw, body: dict, fields: dict, p_each: float = 0.3) -> None:
    """Each of ``fields`` into ``body`` with probability ``p_each`` (drawn, so it replays)."""
    for name, strategy in fields.items():
        if draw(st.integers(0, 99)) < p_each * 100:
            body[name] = draw(strategy)


@st.composite
def openai_tools(draw) -> list:
    names = draw(st.lists(NAMES, min_size=1, max_size=2, unique=True))
    return [{"type": "function", "function": {"name": n, "description": draw(st.sampled_from(["", "A tool."])),
                                              "parameters": draw(SCHEMAS)}} for n in names]


@st.composite
def chat_messages(draw) -> list:
    out = []
    if draw(st.booleans()):
        out.append({"role": draw(st.sampled_from(["system", "developer"])), "content": draw(TEXT)})
    if draw(st.booleans()):
        out += [{"role": "user", "content": draw(TEXT)},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": draw(TEXT)}]
    content = draw(st.one_of(TEXT, st.lists(TEXT.map(lambda t: {"type": "text", "text": t}), min_size=1, max_size=2)))
    out.append({"role": "user", "content": content})
    return out


@st.composite
def chat(draw) -> dict:
    body = {"model": "m", "messages": draw(chat_messages()),
            draw(st.sampled_from(["max_tokens", "max_completion_tokens"])): draw(st.integers(1, 2))}
    optional(draw, body, {**SAMPLING, "stream": st.booleans(), "stop": st.one_of(TEXT, st.lists(TEXT, max_size=2)),
                          "presence_penalty": st.sampled_from([0, 0.5, -1]), "frequency_penalty": st.sampled_from([0, 1]),
                          "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.integers(-100, 100),
                                                        max_size=2),
                          "user": TEXT, "metadata": st.dictionaries(st.sampled_from(["a", "b"]), TEXT, max_size=2),
                          "n": st.just(1), "chat_template_kwargs": st.fixed_dictionaries(
                              {"enable_thinking": st.booleans()}),
                          "string_max_chars": st.integers(0, 64)}, p_each=0.15)
    if draw(st.booleans()):
        body["logprobs"] = True
        body["top_logprobs"] = draw(st.integers(0, 3))
    if body.get("stream") and draw(st.booleans()):
        body["stream_options"] = {"include_usage": draw(st.booleans())}
    kind = draw(KINDS)
    if kind == "tools":
        body["tools"] = draw(openai_tools())
        name = body["tools"][0]["function"]["name"]
        body["tool_choice"] = draw(st.sampled_from(["auto", "none", "required",
                                                    {"type": "function", "function": {"name": name}}]))
        if draw(st.booleans()):
            body["parallel_tool_calls"] = draw(st.booleans())
    elif kind == "json":
        body["response_format"] = draw(st.sampled_from([{"type": "json_object"}, {"type": "text"}])
                                       | SCHEMAS.map(lambda s: {"type": "json_schema",
                                                                "json_schema": {"name": "a", "schema": s}}))
    return body


@st.composite
def completions(draw) -> dict:
    prompt = draw(st.one_of(TEXT, st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8),
                            TEXT.map(lambda t: [t])))
    body = {"model": "m", "prompt": prompt, "max_tokens": draw(st.integers(1, 2))}
    optional(draw, body, {**SAMPLING, "stream": st.booleans(), "stop": st.lists(TEXT, max_size=2),
                          "logprobs": st.integers(0, 3), "echo": st.just(False), "best_of": st.just(1),
                          "suffix": st.just(""), "user": TEXT}, p_each=0.15)
    return body


@st.composite
def anthropic_messages(draw) -> list:
    blocks = st.lists(TEXT.map(lambda t: {"type": "text", "text": t}), min_size=1, max_size=2)
    out = []
    if draw(st.booleans()):
        out += [{"role": "user", "content": draw(TEXT)},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                   "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                              "content": draw(st.one_of(TEXT, blocks))}]},
                {"role": "assistant", "content": draw(TEXT)}]
    out.append({"role": "user", "content": draw(st.one_of(TEXT, blocks))})
    return out


@st.composite
def _anthropic_common(draw) -> dict:
    body = {"model": "m", "messages": draw(anthropic_messages())}
    optional(draw, body, {"system": st.one_of(TEXT, st.lists(TEXT.map(lambda t: {"type": "text", "text": t}),
                                                                   min_size=1, max_size=2)),
                          "thinking": st.sampled_from([{"type": "enabled", "budget_tokens": 1024},
                                                       {"type": "disabled"}])})
    if draw(KINDS) != "plain":
        names = draw(st.lists(NAMES, min_size=1, max_size=2, unique=True))
        body["tools"] = [{"name": n, "description": "A tool.", "input_schema": draw(SCHEMAS)} for n in names]
        body["tool_choice"] = draw(st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "none"},
                                                    {"type": "tool", "name": names[0]},
                                                    {"type": "auto", "disable_parallel_tool_use": True}]))
    return body


@st.composite
def messages(draw) -> dict:
    body = draw(_anthropic_common())
    body["max_tokens"] = draw(st.integers(1, 2))
    optional(draw, body, {"temperature": st.sampled_from([0, 0.5, 1]), "top_p": st.sampled_from([1, 0.9]),
                          "top_k": st.integers(0, 8), "stop_sequences": st.lists(TEXT, max_size=2),
                          "stream": st.booleans(), "metadata": st.just({"user_id": "u1"}),
                          "priority": SAMPLING["priority"], "speculation": SAMPLING["speculation"],
                          "string_max_chars": st.integers(0, 64)}, p_each=0.2)
    return body


count_tokens = _anthropic_common


@st.composite
def responses(draw) -> dict:
    items = st.one_of(
        TEXT.map(lambda t: [{"role": "user", "content": t}]),
        TEXT.map(lambda t: [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": t}]}]),
        TEXT.map(lambda t: [{"role": "user", "content": "Weather?"},
                            {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                             "arguments": '{"city": "Paris"}'},
                            {"type": "function_call_output", "call_id": "call_1", "output": t}]))
    body = {"model": "m", "input": draw(st.one_of(TEXT, items)), "max_output_tokens": draw(st.integers(1, 2))}
    optional(draw, body, {**SAMPLING, "instructions": TEXT, "stream": st.booleans(), "store": st.just(False),
                          "include": st.just(["reasoning.encrypted_content"]), "truncation": st.just("disabled"),
                          "reasoning": st.sampled_from([{"effort": "none"}, {"effort": "low"}, {"effort": "high"}]),
                          "metadata": st.just({"k": "v"})}, p_each=0.15)
    kind = draw(KINDS)
    if kind == "tools":
        names = draw(st.lists(NAMES, min_size=1, max_size=2, unique=True))
        body["tools"] = [{"type": "function", "name": n, "parameters": draw(SCHEMAS)} for n in names]
        body["tool_choice"] = draw(st.sampled_from(["auto", "none", "required", {"type": "function", "name": names[0]}]))
    elif kind == "json":
        body["text"] = {"format": draw(st.sampled_from([{"type": "json_object"}, {"type": "text"}])
                                       | SCHEMAS.map(lambda s: {"type": "json_schema", "name": "a", "schema": s}))}
    return body


# The route's path, its valid bodies, and its error shape ("openai" or "anthropic").
ROUTES = {
    "chat": ("/v1/chat/completions", chat(), "openai"),
    "completions": ("/v1/completions", completions(), "openai"),
    "messages": ("/v1/messages", messages(), "anthropic"),
    "count_tokens": ("/v1/messages/count_tokens", count_tokens(), "anthropic"),
    "responses": ("/v1/responses", responses(), "openai"),
}
FIELD_NAMES = sorted({"messages", "prompt", "input", "max_tokens", "max_output_tokens", "system", "tools", "tool_choice",
                      "response_format", "text", "stop", "stop_sequences", "logprobs", "top_logprobs", "n", "echo",
                      "functions", "previous_response_id", "thinking", "instructions", *SAMPLING})

# ------------------------------------------------------------------------------ hostile values

EXTREME_NUMBERS = st.one_of(
    st.sampled_from([0, -1, 1, 2, 3, 2**31, 2**31 - 1, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30,
                     -(10**30), 1e308, -1e308, 5e-324, -0.0, 0.5, 1.5, 100.0, 1e-9, 10**200]),
    st.integers(), st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([Raw(b"1e400"), Raw(b"-1e400"), Raw(b"NaN"), Raw(b"Infinity"), Raw(b"-Infinity"),
                     Raw(b"9" * 5000), Raw(b"0." + b"1" * 5000), Raw(b"1E+2"), Raw(b"-0")]))
UNUSUAL_TEXT = st.one_of(
    st.sampled_from([
        "a\udcffb", "\ud83d", "\ude00\ud83d", "x\ud800", "\udfff", "\ud83d\ude00",  # lone and paired surrogates
        "\x00", "a\x00b", "\ufeff", "\u202e\u2066evil", "\u200d\u200b", "e\u0301\u0301\u0301", "\ufffe\uffff",
        "\U0010ffff", "\U0001f600" * 50, "<|im_end|>", "<|im_start|>assistant", "<tool_call>", "</think>",
        "{{ raise_exception('x') }}", "{% for %}", "\\", '"', "\r\n\t", "%s%n", "../../etc/passwd",
    ]),
    st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x10FFFF), max_size=20),  # surrogates included
    st.sampled_from([Raw(b'"\xff\xfe"'), Raw(b'"a\xc3"'), Raw(b'"\xed\xb3\xbf"'), Raw(b'"\xf4\x90\x80\x80"'),
                     Raw(b'"\xc0\xaf"'), Raw(b'"\\u00"'), Raw(b'"\\x41"'), Raw(b'"tab\there"')]),
)


@st.composite
def deep(draw):
    depth = draw(st.one_of(st.integers(2, 70), st.integers(60, 5000)))
    opener = draw(st.sampled_from([b"[", b'{"a":']))
    closer = b"]" if opener == b"[" else b"}"
    return Raw(opener * depth + b"1" + closer * depth)


@st.composite
def huge_text(draw, limit: int):
    size = draw(st.one_of(st.integers(1_000, 50_000), st.integers(limit - 64, limit + 4096)))
    return draw(st.sampled_from(["x", "é", "日", "\U0001f600", "word "])) * (size // 4 + 1)


def scalars():
    return st.one_of(st.none(), st.booleans(), EXTREME_NUMBERS, TEXT, UNUSUAL_TEXT)


@functools.lru_cache
def hostile(limit: int):
    small = st.recursive(scalars(), lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                            st.dictionaries(TEXT, inner, max_size=3)), max_leaves=6)
    return st.one_of(scalars(), small, deep(), huge_text(limit), st.just([]), st.just({}), st.just(""),
                     st.lists(st.integers(0, 10**6), min_size=1, max_size=300))


# ------------------------------------------------------------------------------ mutation


def _positions(value, out: list) -> list:
    """Every (container, key) holding a value, in a fixed order (hypothesis replays draws)."""
    stack = [value]
    while stack:
        v = stack.pop()
        keys = list(v) if isinstance(v, dict) else range(len(v)) if isinstance(v, list) else ()
        for k in keys:
            out.append((v, k))
            if isinstance(v[k], (dict, list)):
                stack.append(v[k])
    return out


def _containers(body) -> list:
    found = [body] if isinstance(body, (dict, list)) else []
    return found + [c[k] for c, k in _positions(body, []) if isinstance(c[k], (dict, list))]


@st.composite
def mutated(draw, route: str, limit: int):
    """(the bytes to send, a description, the body as a value when it is one)."""
    # Copies: strategies hand out shared objects (sampled_from, just), which must not change.
    body = copy.deepcopy(draw(ROUTES[route][1]))
    done = []
    for _ in range(draw(st.sampled_from([0, 1, 2, 2, 3, 3]))):  # most bodies end refused at validation
        op = draw(st.sampled_from(["replace", "replace", "replace", "delete", "extra", "wrap", "body"]))
        positions = _positions(body, []) if isinstance(body, (dict, list)) else []
        if op == "replace" and positions:
            parent, key = positions[draw(st.integers(0, len(positions) - 1))]
            parent[key] = copy.deepcopy(draw(hostile(limit)))
            done.append(f"replace {key!r}")
        elif op == "delete" and any(isinstance(p, dict) for p, _ in positions):
            dict_positions = [(p, k) for p, k in positions if isinstance(p, dict)]
            parent, key = dict_positions[draw(st.integers(0, len(dict_positions) - 1))]
            del parent[key]
            done.append(f"delete {key!r}")
        elif op == "extra":
            dicts = [c for c in _containers(body) if isinstance(c, dict)]
            if dicts:
                target = dicts[draw(st.integers(0, len(dicts) - 1))]
                name = draw(st.one_of(st.sampled_from(FIELD_NAMES), TEXT, UNUSUAL_TEXT.filter(lambda t: isinstance(t, str))))
                target[name] = copy.deepcopy(draw(st.one_of(scalars(), hostile(limit))))
                done.append(f"extra {name!r}")
        elif op == "wrap" and positions:
            parent, key = positions[draw(st.integers(0, len(positions) - 1))]
            parent[key] = [parent[key]] if draw(st.booleans()) else {"value": parent[key]}
            done.append(f"wrap {key!r}")
        elif op == "body":
            kind = draw(st.sampled_from(["not_object", "truncate", "nan", "duplicate", "trailing", "empty", "garbage",
                                         "too_large", "bom"]))
            return _broken(draw, body, kind, limit), f"body {kind}", None
    return encode(body, draw(st.booleans())), "; ".join(done) or "valid", body


def _broken(draw, body, kind: str, limit: int) -> bytes:
    data = encode(body, True)
    if kind == "not_object":
        return encode(draw(st.one_of(scalars(), st.lists(scalars(), max_size=3))), True)
    if kind == "truncate":
        return data[: draw(st.integers(0, max(0, len(data) - 1)))]
    if kind == "nan":
        return data[:-1] + b', "temperature": NaN}' if data.endswith(b"}") else b"NaN"
    if kind == "duplicate":
        return data[:-1] + b', "max_tokens": 1, "max_tokens": "x"}' if data.endswith(b"}") else data
    if kind == "trailing":
        return data + draw(st.sampled_from([b"x", b"{}", b"\x00", b" \n", b","]))
    if kind == "empty":
        return draw(st.sampled_from([b"", b" ", b"\n\n"]))
    if kind == "garbage":
        return draw(st.binary(max_size=64))
    if kind == "bom":
        return b"\xef\xbb\xbf" + data
    return data[:-1] + b', "pad": "' + b"p" * (limit + 1) + b'"}' if data.endswith(b"}") else b"[" + b"1," * limit + b"1]"


# ------------------------------------------------------------------------------ encoding


def encode(value, escape_non_ascii: bool) -> bytes:
    """``value`` as JSON bytes, ``Raw`` parts spliced in. With ``escape_non_ascii`` every
    non-ASCII character (a lone surrogate too) is a \\u escape; otherwise text is raw UTF-8
    and a lone surrogate is written as its (invalid) CESU-8 bytes."""
    raws: list[bytes] = []

    def swap(v):
        if isinstance(v, Raw):
            raws.append(v.data)
            return f"\x00RAW{len(raws) - 1}\x00"
        if isinstance(v, dict):
            return {k: swap(x) for k, x in v.items()}
        if isinstance(v, list):
            return [swap(x) for x in v]
        return v

    text = json.dumps(swap(value), ensure_ascii=escape_non_ascii)
    data = text.encode("utf-8", "surrogatepass")
    for i, raw in enumerate(raws):
        data = data.replace(json.dumps(f"\x00RAW{i}\x00", ensure_ascii=escape_non_ascii).encode(), raw, 1)
    return data
