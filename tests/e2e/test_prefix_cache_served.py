"""The prefix cache against a real daemon (random model with an MTP head, exact greedy):
a hit gives a cold run's tokens and a cold run's speculation acceptance, and says how many
prompt tokens it reused."""

from __future__ import annotations

import json

import pytest
from e2e_harness import start_daemon

from daemon.paths import BUNDLED_MODEL
from protocol.client import Client

CHUNK = 128  # where the chunked GatedDeltaNet form is on (CUDA), it runs from 128 tokens
CONFIG = f"""
heartbeat_interval_s = 0.5
governor_enabled = false
[speculation]
mode = "exact"
depth = 2
[scheduler]
prefill_chunk = {CHUNK}
# Prompts' tails share forwards whatever start-up measures they cost (auto: not on this CPU).
prefill_together = "on"
[prefix_cache]
enabled = {{enabled}}
"""


def _daemon(tmp, model, enabled: bool):
    return start_daemon(tmp, model, config=CONFIG.replace("{enabled}", "true" if enabled else "false"))


# The bundled model: trained, so its MTP head's drafts are accepted and a head history
# that was not restored would show in the acceptance (random weights accept nothing).
@pytest.fixture(scope="module")
def cached(tmp_path_factory):
    d = _daemon(tmp_path_factory.mktemp("pc-on"), BUNDLED_MODEL, True)
    yield d
    assert d.stop() == 0


@pytest.fixture(scope="module")
def cold(tmp_path_factory):
    d = _daemon(tmp_path_factory.mktemp("pc-off"), BUNDLED_MODEL, False)
    yield d
    assert d.stop() == 0


def _encode(text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(BUNDLED_MODEL / "tokenizer.json")).encode(text).ids


def _run(endpoint: str, seat: str, prompt: list[int], max_tokens: int = 40, speculation: str = "exact"):
    with Client(endpoint, seat=seat, timeout_s=120) as c:
        s = c.generate(prompt_tokens=prompt, max_tokens=max_tokens, speculation=speculation)
        done = s.result()
        return list(s.token_ids), done


def _spec(done):
    sp = done.speculation
    return None if sp is None else (sp.cycles, sp.drafted, sp.accepted, sp.accepted_by_position)


@pytest.mark.quick
def test_a_continued_turn_hits_and_matches_a_cold_run(cached, cold):
    """Reuse at any token (this CPU's splits agree, engine/caches/prefix_cache.py): turn 1's
    finished state (prompt + answer, off the chunk grid) is an exact snapshot, and the
    seat's next turn resumes from it with a cold run's tokens and acceptance."""
    turn1 = _encode("".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(40)))[:140]
    assert len(turn1) == 140  # just past one chunk: a prefill costs ~5 ms a token on this CPU
    ids1, done1 = _run(cached.endpoint, "seat-a", turn1)
    assert done1.usage.cached_tokens == 0
    ready = [e for e in cached.events() if e["event"] == "prefix_cache.ready"][-1]
    assert ready["splits_exact"] is True and ready["exact_reuse"].startswith("any token")
    cont = [e for e in cached.events() if e["event"] == "prefix_cache.continuation" and e["seat"] == "seat-a"]
    assert len(cont) == 1 and cont[0]["exact"] is True and cont[0]["head"] is True
    # The seat's next turn: its transcript (prompt + reply) plus a new message.
    turn2 = turn1 + ids1 + _encode("\n\nclass Council:\n    def __init__(self):\n")
    ids2, done2 = _run(cached.endpoint, "seat-a", turn2)
    if cont[0]["tokens"] <= len(turn1) + len(ids1):  # the continuation: prompt + answer
        want = cont[0]["tokens"]
    else:  # a speculative cycle committed past max_tokens: turn 1's prompt end serves
        want = len(turn1) - 1
    assert done2.usage.cached_tokens == want and want % CHUNK and want > len(turn1) - 2  # off the grid
    cold_ids, cold_done = _run(cold.endpoint, "seat-a", turn2)
    assert cold_done.usage.cached_tokens == 0
    assert ids2 == cold_ids  # token-identical in exact greedy mode
    # The head's history was restored with the state: acceptance is the cold run's, cycle
    # for cycle (same drafts, same accepts), not one that starts from an empty history.
    assert _spec(done2) is not None and _spec(done2)[2] > 0  # drafts were accepted
    assert _spec(done2) == _spec(cold_done)
    events = [e for e in cached.events() if e["event"] == "request.done" and e["seat"] == "seat-a"]
    assert [e["cached_tokens"] for e in events] == [0, want]


def test_another_seats_raw_prompt_that_differs_in_its_last_line_resumes_at_a_grid_point(cached, cold):
    """A raw prompt has no message ends and its exact end is a prefix of nothing else: the
    grid point before it is what another seat's prompt, the same but for its last line,
    resumes from (tests/e2e/test_prefix_cache_shared.py covers the other forms)."""
    context = "".join(f"seat_{i} = council.vote({i}, quorum={i % 3})\n" for i in range(13))
    a, b = context + "# member A: my view\n", context + "# member B: my view\n"
    ta, tb = _encode(a), _encode(b)
    shared = next(k for k, (x, y) in enumerate(zip(ta, tb)) if x != y)
    grid = (len(ta) - 1) // CHUNK * CHUNK
    assert 2 * CHUNK <= grid <= shared < len(ta) - 1  # a few tokens short: a grid point serves
    with Client(cached.endpoint, seat="raw-a", timeout_s=120) as c:
        done_a = c.generate(a, max_tokens=4, speculation="exact").result()
    assert done_a.usage.cached_tokens == 0 and done_a.usage.prompt_tokens == len(ta)
    with Client(cached.endpoint, seat="raw-b", timeout_s=120) as c:
        s = c.generate(b, max_tokens=12, speculation="exact")
        done_b = s.result()
    assert done_b.usage.cached_tokens == grid
    with Client(cold.endpoint, seat="raw-b", timeout_s=120) as c:
        s_cold = c.generate(b, max_tokens=12, speculation="exact")
        s_cold.result()
    assert list(s.token_ids) == list(s_cold.token_ids)


@pytest.mark.parametrize("mode", ["off", "exact"])
def test_an_exact_request_resumes_at_a_prompts_exact_end(cached, cold, mode):
    """A prompt's exact end (139 here, mid-chunk) is a snapshot; another prompt that starts
    with it (another seat: no continuation of its own) resumes there, serial or
    speculating, and decodes a cold run's tokens."""
    base = _encode("".join(f"class C{i}:\n    x = {i}\n\n" for i in range(60)))[:140]
    assert len(base) == 140
    _run(cached.endpoint, f"first-{mode}", base, max_tokens=4, speculation=mode)
    longer = base + _encode(f"\n# and now {mode}:\n") + base[:37]
    ids, done = _run(cached.endpoint, f"second-{mode}", longer, speculation=mode)
    assert done.usage.cached_tokens == len(base) - 1 == 139
    cold_ids, cold_done = _run(cold.endpoint, f"second-{mode}", longer, speculation=mode)
    assert cold_done.usage.cached_tokens == 0 and ids == cold_ids


@pytest.fixture(scope="module")
def grid_only(tmp_path_factory):
    """A daemon on a backend whose off-grid splits change the numbers (debug_inexact_splits)."""
    d = start_daemon(tmp_path_factory.mktemp("pc-grid"), BUNDLED_MODEL,
                     config="debug_inexact_splits = true\n" + CONFIG.replace("{enabled}", "true"))
    yield d
    assert d.stop() == 0


def test_where_splits_do_not_agree_exact_requests_refuse_off_grid_snapshots(grid_only, cold):
    """A fast turn stores its prompt's exact end and (kept) its continuation, both inexact
    there; the seat's next turn in exact mode passes them by for the grid snapshot below
    and decodes a cold run's tokens; status says reuse is on the grid."""
    turn1 = _encode("".join(f"def g{i}(y):\n    return y - {i}\n\n" for i in range(40)))[:140]
    with Client(grid_only.endpoint, seat="seat-g", timeout_s=120) as c:
        s = c.generate(prompt_tokens=turn1, max_tokens=24, speculation="fast", session="keep")
        s.result()
        ids1 = list(s.token_ids)
    cont = [e for e in grid_only.events() if e["event"] == "prefix_cache.continuation"]
    assert len(cont) == 1 and cont[0]["exact"] is False
    ready = [e for e in grid_only.events() if e["event"] == "prefix_cache.ready"][-1]
    assert ready["splits_exact"] is False and ready["forced_inexact"] is True
    turn2 = turn1 + ids1 + _encode("\n\nclass Council:\n    pass\n")
    ids2, done2 = _run(grid_only.endpoint, "seat-g", turn2)
    assert done2.usage.cached_tokens == CHUNK  # not 139, not the continuation
    assert ids2 == _run(cold.endpoint, "seat-g", turn2)[0]
    with Client(grid_only.endpoint, seat="obs", timeout_s=30) as c:
        pc = c.status().detail["prefix_cache"]
    assert pc["splits_exact"] is False and pc["exact_reuse"].startswith("chunk grid")
    # A fast request takes an inexact snapshot: the continuation, or the prompt's end where
    # a speculative cycle committed past max_tokens.
    _, done3 = _run(grid_only.endpoint, "seat-g", turn2, max_tokens=4, speculation="fast")
    fits = cont[0]["tokens"] <= len(turn1) + len(ids1)
    assert done3.usage.cached_tokens == (cont[0]["tokens"] if fits else len(turn1) - 1)


def test_other_seats_share_a_chat_system_prompt(cached, cold):
    system = "You are a council member. " * 40
    msgs = [[{"role": "system", "content": system}, {"role": "user", "content": f"Seat {i}: what now?"}]
            for i in range(3)]
    outs = []
    with Client(cached.endpoint, seat="chat", timeout_s=120) as c:
        hits_before = c.status().detail["prefix_cache"]["hits"]  # other tests' hits on this daemon
        for mm in msgs:
            s = c.generate(messages=mm, max_tokens=12, speculation="off")
            done = s.result()
            outs.append((list(s.token_ids), done))
    assert outs[0][1].usage.cached_tokens == 0
    # The second and third seats start from the snapshot inside the system message.
    assert outs[1][1].usage.cached_tokens >= CHUNK and outs[2][1].usage.cached_tokens == outs[1][1].usage.cached_tokens
    with Client(cold.endpoint, seat="chat", timeout_s=120) as c:
        for (ids, _), mm in zip(outs, msgs):
            s = c.generate(messages=mm, max_tokens=12, speculation="off")
            s.result()
            assert list(s.token_ids) == ids
    with Client(cached.endpoint, seat="obs", timeout_s=30) as c:
        pc = c.status().detail["prefix_cache"]
    assert pc["entries"] >= 2 and 0 < pc["bytes"] <= pc["max_bytes"] and pc["hits"] - hits_before >= 2, (pc, hits_before)


def test_a_restart_reads_the_split_probe_verdict_and_another_key_probes_again(tmp_path):
    """The chunk-split probe (splits_agree) is cached like the other start-up probes: a
    restart on the same stack, model and chunk reads the verdict back (``verdict`` cached,
    the same ``splits_exact``); another prefill chunk, or another decode path (part of the
    verdicts' key), probes again."""
    cache = {"COUNCILD_CACHE_DIR": str(tmp_path / "cache")}  # its own: no verdict from other tests
    chunk = 32  # the probe prefills 2 * chunk + 9 tokens twice: a small chunk keeps four starts cheap

    def ready_event(name: str, config: str) -> dict:
        (tmp_path / name).mkdir()
        d = start_daemon(tmp_path / name, BUNDLED_MODEL, env=cache, config="governor_enabled = false\n" + config)
        assert d.stop() == 0
        (ev,) = [e for e in d.events() if e["event"] == "prefix_cache.ready"]
        return ev

    first = ready_event("first", f"[scheduler]\nprefill_chunk = {chunk}\n")
    again = ready_event("again", f"[scheduler]\nprefill_chunk = {chunk}\n")
    other_chunk = ready_event("other-chunk", f"[scheduler]\nprefill_chunk = {chunk // 2}\n")
    eager = ready_event("eager", f"compile_decode = false\n[scheduler]\nprefill_chunk = {chunk}\n")
    assert first["verdict"] == "probed" and first["chunk"] == chunk
    assert again["verdict"] == "cached" and again["splits_exact"] == first["splits_exact"]
    assert other_chunk["verdict"] == "probed" and other_chunk["chunk"] == chunk // 2
    assert eager["verdict"] == "probed"
    stored = list((tmp_path / "cache" / "probe-verdicts").glob("*.json"))
    # One file per key: the compiled path's, the eager path's, and the compiled step's own
    # self-check (keyed without the decode path it decides); chunks are variants inside one.
    assert len(stored) == 3
    probes = [set(json.loads(p.read_text())["verdicts"]) for p in stored]
    assert sorted("compiled_step" in v for v in probes) == [False, False, True], probes
    assert all(v == {"compiled_step"} or "splits" in v for v in probes), probes


def test_prompts_sent_together_share_the_prefix_the_first_one_prefills(cached, cold):
    """A council's seats send their first turns at once: each looked the cache up on
    admission, before any had prefilled their shared system prompt. The first prefills it
    (a snapshot at the system message's end); the others look again before their own first
    chunk and start from there instead of prefilling it once more (decode_paths.refresh_prefill),
    their tails in forwards together, with a cold run's tokens."""
    import threading

    system = "".join(f"def shared{i}(z):\n    return z + {i}\n\n" for i in range(30))
    chats = {f"council-{i}": [{"role": "system", "content": system},
                              {"role": "user", "content": f"Seat {i} asks about item {i * 7}."}] for i in range(3)}
    got: dict = {}

    def ask_on(c, seat, out, together=None):
        if together is not None:
            together.wait(30)
        s = c.generate(messages=chats[seat], max_tokens=8, speculation="exact")
        done = s.result()
        out[seat] = (list(s.token_ids), done)

    def ask(endpoint, seat, out):
        with Client(endpoint, seat=seat, timeout_s=120) as c:
            ask_on(c, seat, out)

    # Connected first, then sent at one moment (a barrier): a thread that took its turn to
    # connect after the first prompt's snapshot existed would find it on admission (a hit,
    # not a second look).
    clients = {seat: Client(cached.endpoint, seat=seat, timeout_s=120) for seat in chats}
    barrier = threading.Barrier(len(chats))
    threads = [threading.Thread(target=ask_on, args=(clients[seat], seat, got, barrier)) for seat in chats]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    finally:
        for c in clients.values():
            c.close()
    cached_tokens = sorted(done.usage.cached_tokens for _, done in got.values())
    assert cached_tokens[0] == 0 and cached_tokens[1] > 200 and cached_tokens[1] == cached_tokens[2], cached_tokens
    relooked = [e for e in cached.events() if e["event"] == "prefix_cache.relooked" and e["seat"].startswith("council-")]
    assert len(relooked) == 2 and all(e["was"] == 0 and e["cached_tokens"] == cached_tokens[1] for e in relooked), relooked
    # Their tails (each within one chunk) went through forwards together (batched_prefill.py).
    with Client(cached.endpoint, seat="status") as c:
        together = c.status().detail["step"]["together"]
    assert together["enabled"] and together["exact_rows"] and together["forwards"] >= 1, together
    assert together["rows"] >= 2 * together["forwards"], together
    cold_got: dict = {}
    for seat in chats:
        ask(cold.endpoint, seat, cold_got)
        assert got[seat][0] == cold_got[seat][0], seat  # token-identical to a cold run
        assert cold_got[seat][1].usage.cached_tokens == 0
