"""Prompts from different seats that share a long prefix share its prefill (a real daemon,
the bundled model, two seats): whatever the prompt's form (raw text, token ids, chat) and
wherever it diverges (its last line, a message's end, the middle of a message, a history
rewritten in the middle), the second prompt re-prefills less than one prefill chunk of
what it shares with the first, and decodes a cold run's tokens in exact mode
(engine/caches/prefix_cache.py ``boundaries``: the exact ends and the grid point before each)."""

from __future__ import annotations

import pytest
from e2e_harness import start_daemon

from daemon.paths import BUNDLED_MODEL
from protocol.client import Client

CHUNK = 32  # a small prefill chunk keeps the prompts short (a few chunks each)
CONFIG = f"""
heartbeat_interval_s = 0.5
governor_enabled = false
[speculation]
mode = "exact"
depth = 2
[scheduler]
prefill_chunk = {CHUNK}
[prefix_cache]
enabled = {{enabled}}
"""


def _daemon(tmp, enabled: bool, extra: str = ""):
    return start_daemon(tmp, BUNDLED_MODEL, config=extra + CONFIG.replace("{enabled}", "true" if enabled else "false"))


@pytest.fixture(scope="module")
def cached(tmp_path_factory):
    d = _daemon(tmp_path_factory.mktemp("shared-on"), True)
    yield d
    assert d.stop() == 0


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    d = _daemon(tmp_path_factory.mktemp("shared-off"), False)
    yield d
    assert d.stop() == 0


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(BUNDLED_MODEL))


def _lines(n: int, salt: str) -> str:
    words = "council seat plan budget memory state token layer queue turn answer".split()
    return "".join(f"{salt}{i}. " + " ".join(words[(i * 5 + j + len(salt)) % len(words)] for j in range(5)) + "\n"
                   for i in range(n))


def _ids(tok, form: str, prompt) -> list[int]:
    """The prompt's token ids as the daemon encodes them (model.encode_prompt)."""
    if form == "tokens":
        return list(prompt)
    if form == "chat":
        return list(tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False))
    return list(tok.encode(prompt))


def _chat_end(tok, messages: list[dict]) -> int:
    """Tokens of the chat rendered up to and including ``messages`` (a message's end)."""
    return len(tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=True, return_dict=False))


def _shared(a: list[int], b: list[int]) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _ask(endpoint: str, seat: str, form: str, prompt, speculation: str = "exact", max_tokens: int = 12):
    kw = {"text": {"prompt": prompt}, "tokens": {"prompt_tokens": prompt}, "chat": {"messages": prompt}}[form]
    with Client(endpoint, seat=seat, timeout_s=120) as c:
        s = c.generate(max_tokens=max_tokens, speculation=speculation, **kw)
        done = s.result()
        return list(s.token_ids), done


def _second_seat_reuses(cached, cold, tok, form: str, a, b, seats: str, speculation: str = "exact") -> tuple[int, int]:
    """Seat A sends ``a``, seat B sends ``b``: B's reuse, and the prefix the two share (in
    tokens). B re-prefills less than a chunk of it; in exact mode its tokens are a cold
    run's (another daemon, no prefix cache)."""
    ta, tb = _ids(tok, form, a), _ids(tok, form, b)
    _, done_a = _ask(cached.endpoint, f"{seats}-a", form, a, speculation)
    assert done_a.usage.cached_tokens == 0 and done_a.usage.prompt_tokens == len(ta)  # fresh, and encoded as here
    ids_b, done_b = _ask(cached.endpoint, f"{seats}-b", form, b, speculation)
    shared = _shared(ta, tb)
    assert done_b.usage.prompt_tokens == len(tb) and shared < len(tb) - 1
    got = done_b.usage.cached_tokens
    assert shared - CHUNK < got <= shared, (form, got, shared, len(ta), len(tb))
    if speculation == "exact":
        cold_ids, cold_done = _ask(cold.endpoint, f"{seats}-b", form, b, speculation)
        assert cold_done.usage.cached_tokens == 0 and ids_b == cold_ids
    return got, shared


@pytest.mark.parametrize("form", ["text", "tokens"])
def test_a_raw_prompt_that_differs_in_its_last_line_reuses_the_other_seats_prefill(cached, cold, tok, form):
    """Raw prompts have no message ends: B resumes at the grid point before A's end (A's
    exact end is a prefix of nothing but A's own continuation)."""
    context = _lines(8, f"raw-{form}-")
    a, b = context + "Member A: your view?\n", context + "Member B: your view?\n"
    if form == "tokens":
        a, b = tok.encode(a), tok.encode(b)
    got, shared = _second_seat_reuses(cached, cold, tok, form, a, b, f"last-{form}")
    n_a = len(_ids(tok, form, a))
    assert shared < n_a - 1 and got == (n_a - 1) // CHUNK * CHUNK > 0


def test_a_prompt_that_diverges_just_before_the_last_grid_point(cached, cold, tok):
    """B diverges a few tokens before A's last grid point (A's last line crosses it): the
    grid point a chunk earlier serves; B shares less than a chunk more than it reuses."""
    context = tok.encode(_lines(12, "straddle-"))[: 4 * CHUNK - 5]
    a = context + tok.encode("Member A: my own view, in a line long enough.\n")[:18]
    b = context + tok.encode("Member B: another view, also long enough here.\n")[:18]
    assert (len(a) - 1) // CHUNK * CHUNK == 4 * CHUNK and a[:-1] != b[:-1]  # A's last grid point: past 123
    got, shared = _second_seat_reuses(cached, cold, tok, "tokens", a, b, "straddle")
    assert shared < 4 * CHUNK and got == 3 * CHUNK


def test_in_fast_mode_too(cached, cold, tok):
    context = _lines(8, "fast-")
    a, b = context + "Member A: go.\n", context + "Member B: go.\n"
    _second_seat_reuses(cached, cold, tok, "text", a, b, "fast", speculation="fast")


def test_a_chat_that_differs_in_its_last_messages_last_line(cached, cold, tok):
    """Diverging inside the last message (after a grid point in it): the grid point before
    the prompt's end serves, not only the system message's end."""
    system = {"role": "system", "content": "You sit on the council. " * 4}
    ask = _lines(5, "chat-last-")
    a = [system, {"role": "user", "content": ask + "I am member A."}]
    b = [system, {"role": "user", "content": ask + "I am member B."}]
    got, _ = _second_seat_reuses(cached, cold, tok, "chat", a, b, "chat-last")
    assert got > _chat_end(tok, a[:1]) and got % CHUNK == 0


def test_a_chat_that_differs_after_a_message_end_resumes_at_that_end(cached, cold, tok):
    """Diverging right after a message (the rest of the chat shared): B resumes at that
    message's exact end, off the grid."""
    history = [{"role": "system", "content": "Council rules: " + _lines(2, "rules-")},
               {"role": "user", "content": _lines(3, "end-q-")},
               {"role": "assistant", "content": _lines(2, "end-r-")}]
    a = history + [{"role": "user", "content": "Seat A asks: and then?"}]
    b = history + [{"role": "user", "content": "What does seat B think?"}]
    got, _ = _second_seat_reuses(cached, cold, tok, "chat", a, b, "chat-end")
    end = _chat_end(tok, history)
    assert got == end and end % CHUNK


def test_a_history_rewritten_in_the_middle_of_a_long_message(cached, cold, tok):
    """B rewrites the last line of an earlier, long message (as a client that edits or
    re-renders a turn does): it resumes at the grid point before that message's end, not at
    the end of the message before it."""
    first = {"role": "system", "content": "Council rules, short."}
    long_q = _lines(6, "mid-q-")
    tail = [{"role": "assistant", "content": "Noted."}, {"role": "user", "content": "Now vote."}]
    a = [first, {"role": "user", "content": long_q + "Signed: seat A."}] + tail
    b = [first, {"role": "user", "content": long_q + "Signed: seat B."}] + tail
    got, _ = _second_seat_reuses(cached, cold, tok, "chat", a, b, "chat-mid")
    assert got > _chat_end(tok, [first]) and got % CHUNK == 0


def test_a_continued_turn_then_another_seat_diverging_in_its_last_line(cached, cold, tok):
    """Seat A's second turn resumes at its first turn's continuation and adds less than a
    chunk past it; seat B sends that second turn with another last line: B still re-prefills
    less than a chunk of what it shares (the grid point before A's second prompt's end, or
    the continuation where no grid point lies past it)."""
    turn1 = tok.encode(_lines(6, "cont-"))
    ids1, done1 = _ask(cached.endpoint, "cont-a", "tokens", turn1)
    assert done1.usage.cached_tokens == 0
    note = tok.encode("\nMember A: short.\n")
    assert len(note) < CHUNK
    turn2 = turn1 + ids1 + note
    ids2, done2 = _ask(cached.endpoint, "cont-a", "tokens", turn2)
    assert done2.usage.cached_tokens >= len(turn1) - 1  # its own continuation (or its prompt's end)
    other = turn1 + ids1 + tok.encode("\nMember B: longer, and different.\n")
    ids_b, done_b = _ask(cached.endpoint, "cont-b", "tokens", other)
    shared = _shared(turn2, other)
    assert shared - CHUNK < done_b.usage.cached_tokens <= shared
    assert ids_b == _ask(cold.endpoint, "cont-b", "tokens", other)[0]


@pytest.fixture(scope="module")
def grid_only(tmp_path_factory):
    """A backend whose off-grid splits change the numbers (debug_inexact_splits): exact
    requests reuse on the chunk grid only."""
    d = _daemon(tmp_path_factory.mktemp("shared-grid"), True, extra="debug_inexact_splits = true\n")
    yield d
    assert d.stop() == 0


@pytest.mark.parametrize("form", ["text", "chat"])
def test_where_splits_do_not_agree_the_grid_point_serves_the_other_seat(grid_only, cold, tok, form):
    context = _lines(8, f"grid-{form}-")
    if form == "text":
        a, b = context + "Member A: view?\n", context + "Member B: view?\n"
    else:
        a = [{"role": "system", "content": "Council."}, {"role": "user", "content": context + "I am A."}]
        b = [{"role": "system", "content": "Council."}, {"role": "user", "content": context + "I am B."}]
    got, _ = _second_seat_reuses(grid_only, cold, tok, form, a, b, f"grid-{form}")
    assert got % CHUNK == 0
