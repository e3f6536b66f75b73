"""Constrained decoding through a real daemon on the bundled model, over its ZeroMQ socket:
every kind of constraint on every decode path (serial, exact speculation at depths 1 and 2,
fast, batched rows), refusals, and max_tokens inside a grammar."""

from __future__ import annotations

import json

import pytest

from daemon.paths import BUNDLED_MODEL
from protocol import encode, messages as m
from protocol.client import Client
from protocol.codec import decode_daemon

from constraint_cases import CASES, check_output
from e2e_harness import start_daemon

PROMPT = "def fibonacci(n):\n"


def check_prefix(kind: str, token_ids: list[int]) -> None:
    """The tokens are ones a fresh matcher of the same grammar takes, one by one: the output
    is a prefix of the grammar (what a request cut by max_tokens returns)."""
    import llguidance

    from daemon.engine.decoders.constraint import grammar_text

    tok = llguidance.LLTokenizer(str(BUNDLED_MODEL / "tokenizer.json"), eos_token=[0, 2])
    matcher = llguidance.LLMatcher(tok, grammar_text(kind, CASES[kind]), log_level=0)
    for t in token_ids:
        assert matcher.consume_token(t), (t, matcher.get_error())


def tokens_of(before: list) -> list[int]:
    return [t for msg in before if isinstance(msg, m.Tokens) for t in msg.token_ids]


def check_done(kind: str, text: str, before: list, done, sampled: bool) -> None:
    """Greedy requests end at the grammar's end; a sampled one may wander (a free JSON string)
    until max_tokens, and then its output must still be a prefix of the grammar."""
    assert isinstance(done, m.Done), done
    if sampled and done.finish_reason == "length":
        check_prefix(kind, tokens_of(before))
        return
    assert done.finish_reason == "stop", done
    check_output(kind, text)
    check_prefix(kind, tokens_of(before))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("constrained"), BUNDLED_MODEL)
    yield d
    assert d.stop() == 0


def request(rid: str, kind: str | None, prompt: str = PROMPT, **kw) -> m.Generate:
    constraint = m.Constraint(kind=kind, value=CASES[kind]) if kind else None
    return m.Generate(request_id=rid, prompt=prompt, max_tokens=kw.pop("max_tokens", 96), stream=True,
                      constraint=constraint, **kw)


def run_all(d, msgs: list[m.Generate]) -> dict[str, tuple[str, list, object]]:
    """Send every request at once on one connection; per request id: (streamed text, the
    messages before the terminal one, the terminal message)."""
    sock = d.raw_socket(timeout_ms=120000)
    try:
        for msg in msgs:
            sock.send(encode(msg))
        out = {msg.request_id: ["", [], None] for msg in msgs}
        while any(v[2] is None for v in out.values()):
            reply = decode_daemon(sock.recv())
            entry = out[reply.request_id]
            if isinstance(reply, (m.Done, m.Error)):
                entry[2] = reply
            else:
                entry[1].append(reply)
                if isinstance(reply, m.Tokens):
                    entry[0] += reply.text
        return {k: tuple(v) for k, v in out.items()}
    finally:
        sock.close()


def run_one(d, msg: m.Generate):
    return run_all(d, [msg])[msg.request_id]


@pytest.mark.parametrize("kind", list(CASES))
def test_every_path_matches_the_constraint_and_exact_is_serial(daemon, kind):
    with Client(daemon.endpoint, seat="gov", timeout_s=60) as c:
        ref = {}
        for temperature, seed in ((0.0, None), (0.8, 7)):
            text, before, done = run_one(daemon, request(f"{kind}-off-{temperature}", kind, speculation="off",
                                                         temperature=temperature, seed=seed))
            check_done(kind, text, before, done, temperature > 0)
            assert done.text == text
            ref[temperature] = text
            for depth in (1, 2):
                assert c.governor("pin_depth", depth).ok
                for mode in ("exact", "fast"):
                    text, before, done = run_one(daemon, request(f"{kind}-{mode}{depth}-{temperature}", kind,
                                                                 speculation=mode, temperature=temperature, seed=seed))
                    check_done(kind, text, before, done, temperature > 0)
                    if mode == "exact" and temperature == 0.0:
                        assert text == ref[0.0], (depth, text)
                    if temperature == 0.0:
                        assert done.speculation is not None and done.speculation.drafted > 0
        assert c.governor("auto").ok


@pytest.mark.parametrize("speculation", ["off", "exact"])
def test_four_concurrent_constrained_requests_batch(daemon, speculation):
    """Four constrained requests at once, each of a different kind, one sampled, as rows of
    the batch (speculation off: depth-0 rows; exact at depth 2: each row drafts under its
    grammar in the speculating batch): each matches its constraint, and the greedy ones give
    what they give alone, serially."""
    kinds = list(CASES)
    alone = {k: run_one(daemon, request(f"solo-{k}-{speculation}", k, speculation="off"))[0] for k in kinds}
    msgs = [request(f"batch-{k}-{speculation}", k, speculation=speculation) for k in kinds]
    msgs.append(request(f"batch-sampled-{speculation}", "json_schema", speculation=speculation, temperature=0.8,
                        seed=3))
    if speculation != "off":
        with Client(daemon.endpoint, seat="ops") as c:
            assert c.governor("pin_depth", 2).ok
    try:
        got = run_all(daemon, msgs)
    finally:
        if speculation != "off":
            with Client(daemon.endpoint, seat="ops") as c:
                assert c.governor("auto").ok
    for k in kinds:
        text, _, done = got[f"batch-{k}-{speculation}"]
        assert isinstance(done, m.Done) and done.finish_reason == "stop", done
        assert text == alone[k]
        check_output(k, text)
    text, before, done = got[f"batch-sampled-{speculation}"]
    check_done("json_schema", text, before, done, sampled=True)
    ids = {msg.request_id for msg in msgs}
    ended = [e for e in daemon.events() if e.get("event") == "request.done" and e["request_id"] in ids]
    assert len(ended) == 5 and sum(e["batched"] for e in ended) >= 4, ended  # they shared the batch
    if speculation != "off":
        assert sum(e["speculation"]["drafted"] for e in ended if e["batched"]) > 0  # batched rows drafted


def test_unsupported_schema_is_refused_and_the_daemon_keeps_serving(daemon):
    bad = m.Generate(request_id="bad-schema", prompt=PROMPT, max_tokens=32,
                     constraint=m.Constraint(kind="json_schema",
                                             value=json.dumps({"type": "object", "dependentSchemas": {"a": {}}})))
    text, before, err = run_one(daemon, bad)
    assert isinstance(err, m.Error) and err.code == "invalid_request", err
    assert "dependentSchemas" in err.message
    assert before == [] and text == ""  # no Accepted, no token: nothing unconstrained went out
    bad_regex = m.Generate(request_id="bad-regex", prompt=PROMPT, constraint=m.Constraint(kind="regex", value="("))
    _, _, err = run_one(daemon, bad_regex)
    assert isinstance(err, m.Error) and err.code == "invalid_request" and "regex" in err.message
    text, _, done = run_one(daemon, request("after-bad", "regex", speculation="exact"))
    assert isinstance(done, m.Done) and done.finish_reason == "stop"
    check_output("regex", text)


def test_max_tokens_inside_the_grammar_ends_with_length_and_a_prefix(daemon):
    whole, _, done = run_one(daemon, request("whole", "json_schema", speculation="off"))
    assert done.finish_reason == "stop" and done.usage.completion_tokens > 6
    for mode in ("off", "exact"):
        text, before, done = run_one(daemon, request(f"cut-{mode}", "json_schema", speculation=mode, max_tokens=5))
        assert done.finish_reason == "length" and done.usage.completion_tokens == 5
        assert whole.startswith(text) and text != whole
        check_prefix("json_schema", tokens_of(before))
