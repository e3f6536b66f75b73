"""`councild http` in front of a live daemon, driven by the official openai client, raw HTTP
(curl -N, httpx streaming) and Prometheus' own text parser."""

from __future__ import annotations

import asyncio
import random
import shutil
import subprocess
import time

import httpx
import openai
import pytest
from e2e_harness import start_daemon
from http_harness import sse_events, start_front, terminal_events
from prometheus_client.parser import text_string_to_metric_families

from protocol import Client

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)

SEATS = [f"s{i}" for i in range(8)]
KEYS = {"key-main": "http-test", "key-flood": "flood", **{f"key-{s}": s for s in SEATS}}
PROMPT = "def load(path):\n    with open(path) as f:"


@pytest.fixture(scope="module")
def stack(tmp_path_factory, e2e_model):
    tmp = tmp_path_factory.mktemp("http")
    d = start_daemon(tmp, e2e_model, config="heartbeat_timeout_s = 3.0\nheartbeat_interval_s = 0.5\n"
                                             "stats_interval_s = 1.0\n[scheduler]\nmax_queued_per_seat = 3\n")
    keys = "\n".join(f'"{k}" = "{v}"' for k, v in KEYS.items())
    front = start_front(tmp, d.endpoint, f"[http.api_keys]\n{keys}\n")
    yield d, front
    front.stop()
    assert d.stop() == 0, d.log_path.read_text()[-3000:]


@pytest.fixture
def oai(stack):
    _, front = stack
    return openai.OpenAI(base_url=front.url + "/v1", api_key="key-main", max_retries=0, timeout=120)


def _rid(response_id: str) -> str:
    return response_id.split("-", 1)[1]


def _wait_idle(d, timeout=60.0):
    deadline = time.monotonic() + timeout
    with Client(d.endpoint, seat="probe") as c:
        while True:
            st = c.status()
            if st.detail["in_flight"] == 0:
                return st
            assert time.monotonic() < deadline, st.detail
            time.sleep(0.2)


def test_chat_streaming_and_not_agree(oai):
    kw = dict(model="any", messages=[{"role": "user", "content": "Name three rivers."}], max_tokens=12, temperature=0)
    full = oai.chat.completions.create(**kw)
    assert full.object == "chat.completion" and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12 and full.usage.prompt_tokens > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12
    assert full.usage.prompt_tokens_details.cached_tokens == 0
    chunks = list(oai.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].choices == []


def test_completions_stop_strings_and_max_tokens(oai):
    full = oai.completions.create(model="any", prompt=PROMPT, max_tokens=16, temperature=0)
    text = full.choices[0].text
    assert full.object == "text_completion" and full.usage.completion_tokens == 16
    # A stop string taken from the middle of the unconstrained output: the answer ends before it.
    cut = next(i for i in range(len(text) // 2, len(text)) if text[i].strip())
    stop = text[cut:cut + 2]
    stopped = oai.completions.create(model="any", prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.index(stop)]
    streamed = oai.completions.create(model="any", prompt=PROMPT, max_tokens=16, temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == stopped.choices[0].text
    short = oai.completions.create(model="any", prompt=PROMPT, max_tokens=3, temperature=0)
    assert short.usage.completion_tokens == 3 and text.startswith(short.choices[0].text)


def test_seeds_reproduce_sampling(oai):
    # Serial decode: a sampled speculative request draws from the same distribution but
    # spends its random keys per cycle, so its exact sample depends on the depth the governor
    # picks at the time (docs/OPERATIONS.md, HTTP front).
    def sample(seed):
        r = oai.completions.create(model="any", prompt=PROMPT, max_tokens=10, temperature=1.0, seed=seed,
                                   extra_body={"speculation": "off"})
        return r.choices[0].text

    a, b = sample(7), sample(7)
    assert a == b
    assert any(sample(s) != a for s in (8, 9, 10))


def test_logprobs_and_sampling_options(oai):
    r = oai.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                    temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    for e in content:
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token and e.logprob <= 0.0
    legacy = oai.completions.create(model="any", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    lp = legacy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    # Penalties change a greedy answer.
    plain = oai.completions.create(model="any", prompt=PROMPT, max_tokens=12, temperature=0)
    pen = oai.completions.create(model="any", prompt=PROMPT, max_tokens=12, temperature=0, frequency_penalty=2.0,
                                 presence_penalty=1.0, extra_body={"repetition_penalty": 1.5, "min_p": 0.05})
    assert pen.choices[0].text != plain.choices[0].text


def test_logit_bias_bans_a_token(oai, stack):
    d, _ = stack
    # The first greedy token's id, from the ZeroMQ client's logprobs (the same daemon).
    with Client(d.endpoint, seat="probe") as c:
        first = c.generate(PROMPT, max_tokens=1, temperature=0, stream=False, logprobs=True).result().logprobs[0]
    r = oai.completions.create(model="any", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1)
    assert r.choices[0].logprobs.tokens[0] == first.token
    banned = oai.completions.create(model="any", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1,
                                    logit_bias={str(first.token_id): -100})
    assert banned.choices[0].logprobs.tokens[0] != first.token


def test_invalid_requests_are_400_in_openai_shape(oai, stack):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="any", messages=[{"role": "user", "content": "x"}], n=2)
    assert e.value.code == "unsupported_parameter" and e.value.param == "n"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="any", messages=[{"role": "user", "content": "x"}], temperature=-1)
    assert e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="any", messages=[{"role": "user", "content": "x"}],
                                    functions=[{"name": "f", "parameters": {}}])
    assert e.value.code == "unsupported_parameter" and e.value.param == "functions"
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="any", prompt=PROMPT, max_tokens=10**6)
    assert "max_tokens" in e.value.message
    _, front = stack
    r = httpx.post(front.url + "/v1/completions", content=b"{not json", headers={"Authorization": "Bearer key-main"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=front.url + "/v1", api_key="wrong", max_retries=0).models.list()
    r = httpx.get(front.url + "/v1/models", headers={"Authorization": "Bearer key-main", "X-Councild-Seat": "s0"})
    assert r.status_code == 403  # a key may not speak as another seat
    assert [m.id for m in oai.models.list().data] == ["model"]


def _stream_lines(url, key, body, max_chunks=None):
    """Read an SSE response's lines with httpx; stop (disconnect) after max_chunks data lines."""
    lines = []
    with httpx.Client(timeout=120) as h:
        with h.stream("POST", url, json=body, headers={"Authorization": f"Bearer {key}"}) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                lines.append(line)
                if max_chunks is not None and sum(1 for x in lines if x.startswith("data: ")) >= max_chunks:
                    break
    return lines


def test_overload_is_429_with_retry_after_and_disconnects_cancel(stack):
    d, front = stack
    url = front.url + "/v1/completions"
    long_body = {"model": "any", "prompt": PROMPT, "max_tokens": 4000, "temperature": 0, "stream": True}

    async def scenario():
        async with httpx.AsyncClient(timeout=120) as h:
            hdr = {"Authorization": "Bearer key-flood"}
            streams, ids = [], []
            for _ in range(3):  # the seat's whole allowance (max_queued_per_seat = 3)
                req = h.build_request("POST", url, json=long_body, headers=hdr)
                resp = await h.send(req, stream=True)
                assert resp.status_code == 200
                it = resp.aiter_lines()
                while True:
                    line = await it.__anext__()
                    if line.startswith("data: "):
                        ids.append(_rid(sse_events([line])[0]["id"]))
                        break
                streams.append((resp, it))  # keep the iterator: collecting it would close the response
            r = await h.post(url, json={**long_body, "stream": False}, headers=hdr)
            assert r.status_code == 429, r.text
            assert int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"]["code"] == "overloaded"
            for resp, it in streams:  # the client goes away mid-stream
                await it.aclose()
                await resp.aclose()
            return ids

    ids = asyncio.run(scenario())
    _wait_idle(d)
    ends = terminal_events(d.log_path)
    for rid in ids:
        assert [e.get("finish_reason") for e in ends[rid]] == ["cancelled"]
        assert ends[rid][0]["completion_tokens"] < 4000


def test_non_streaming_disconnect_cancels(stack):
    d, front = stack
    body = {"model": "any", "prompt": PROMPT, "max_tokens": 4000, "temperature": 0}
    before = set(terminal_events(d.log_path))
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(front.url + "/v1/completions", json=body, headers={"Authorization": "Bearer key-main"}, timeout=2.0)
    _wait_idle(d)
    new = {k: v for k, v in terminal_events(d.log_path).items() if k not in before}
    assert len(new) == 1
    (events,) = new.values()
    assert [e.get("finish_reason") for e in events] == ["cancelled"] and events[0]["completion_tokens"] < 4000


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_reads_the_sse_stream(stack):
    _, front = stack
    out = subprocess.run(
        ["curl", "-sN", front.url + "/v1/chat/completions", "-H", "Authorization: Bearer key-main",
         "-H", "Content-Type: application/json",
         "-d", '{"model":"any","messages":[{"role":"user","content":"hi"}],"max_tokens":5,"temperature":0,"stream":true}'],
        capture_output=True, text=True, timeout=120, check=True).stdout
    events = sse_events(out.splitlines())
    assert events[-1] == "[DONE]"
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert len({e["id"] for e in events[:-1]}) == 1


def _metrics(front) -> dict:
    text = httpx.get(front.url + "/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_move_after_a_request(stack, oai):
    _, front = stack
    before = _metrics(front)
    # A prompt of its own: an earlier test's exact snapshot at PROMPT's end would serve it
    # whole (reuse at any token), and this test reads the prefill counter move.
    oai.completions.create(model="any", prompt=PROMPT + "# metrics\n", max_tokens=7, temperature=0)

    def get(m, name, **labels):
        return m.get((name, tuple(sorted(labels.items()))), 0.0)

    # The daemon publishes its snapshot between decode cycles (at most 0.1 s behind); a
    # loaded machine can be much slower than that.
    deadline = time.monotonic() + 60
    while True:
        after = _metrics(front)
        if get(after, "councild_requests_total", seat="http-test", outcome="length") > \
                get(before, "councild_requests_total", seat="http-test", outcome="length"):
            break
        assert time.monotonic() < deadline, "councild_requests_total did not move"
        time.sleep(0.1)

    assert get(after, "councild_up") == 1.0
    assert get(after, "councild_tokens_total", seat="http-test") >= get(before, "councild_tokens_total", seat="http-test") + 7
    assert get(after, "councild_requests_total", seat="http-test", outcome="length") == \
        get(before, "councild_requests_total", seat="http-test", outcome="length") + 1
    assert get(after, "councild_ttft_seconds_count") == get(before, "councild_ttft_seconds_count") + 1
    assert get(after, "councild_inter_token_seconds_count") >= get(before, "councild_inter_token_seconds_count") + 6
    assert get(after, "councild_http_requests_total", route="completions", seat="http-test", status="200",
               outcome="length") == get(before, "councild_http_requests_total", route="completions", seat="http-test",
                                        status="200", outcome="length") + 1
    assert get(after, "councild_memory_active_bytes") > 0
    assert get(after, "councild_head_resident") == 1.0
    # The engine step: iterations ran, their decode phases forwarded the tokens.
    assert get(after, "councild_step_steps_total") >= get(before, "councild_step_steps_total") + 6
    assert get(after, "councild_step_decode_tokens_total") >= get(before, "councild_step_decode_tokens_total") + 6
    assert get(after, "councild_step_prefill_tokens_total") > get(before, "councild_step_prefill_tokens_total")
    assert get(after, "councild_step_token_budget") > 0
    assert get(after, "councild_step_budget_use_ratio_count") == get(after, "councild_step_steps_total")
    names = {k[0] for k in after}
    for name in ("councild_queue_depth", "councild_speculation_depth", "councild_drafted_tokens_total",
                 "councild_accepted_tokens_total", "councild_memory_cache_bytes", "councild_memory_available_bytes",
                 "councild_memory_pressure_level", "councild_in_flight_requests", "councild_prefill_queue_requests",
                 "councild_prefill_queue_tokens", "councild_seat_waiting", "councild_seat_prefill_left",
                 "councild_step_decode_gap_bound", "councild_prefill_piece_tokens", "councild_step_paced_total",
                 "councild_prefill_together_forwards_total", "councild_prefill_together_rows_total",
                 "councild_batch_cycles_total", "councild_batch_cycles_ahead_total"):
        assert name in names, name


def test_eight_streams_with_random_disconnects_lose_and_duplicate_nothing(stack):
    d, front = stack
    rng = random.Random(15)
    prompts = [f"{PROMPT} # {i}" for i in range(8)]
    leaving = set(rng.sample(range(8), 4))
    url = front.url + "/v1/completions"

    async def one(i, h):
        key = f"key-{SEATS[i]}"
        body = {"model": "any", "prompt": prompts[i], "temperature": 0, "stream": True,
                "max_tokens": 2000 if i in leaving else 20}
        events, rid = [], None
        async with h.stream("POST", url, json=body, headers={"Authorization": f"Bearer {key}"}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events += sse_events([line])
                    if rid is None and isinstance(events[-1], dict):
                        rid = _rid(events[-1]["id"])
                    if i in leaving and len(events) >= rng.randint(2, 6):
                        break  # disconnect mid-stream
        return i, rid, events

    async def run():
        async with httpx.AsyncClient(timeout=180) as h:
            return await asyncio.gather(*(one(i, h) for i in range(8)))

    results = asyncio.run(run())
    _wait_idle(d)
    ends = terminal_events(d.log_path)
    with Client(d.endpoint, seat="check") as c:
        for i, rid, events in results:
            assert len(ends[rid]) == 1, (i, ends[rid])  # exactly one terminal per request
            if i in leaving:
                assert ends[rid][0].get("finish_reason") == "cancelled"
                continue
            assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
            finishes = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"][0]["finish_reason"]]
            assert finishes == ["length"]
            text = "".join(e["choices"][0]["text"] for e in events[:-1])
            # Nothing lost or repeated: the stream is the whole answer, as a plain request gives it.
            assert text == c.complete(prompts[i], max_tokens=20, temperature=0).text


def test_the_grafana_dashboard_graphs_series_that_exist(stack):
    """Every series docs/grafana-councild.json queries is one /metrics serves (the prefix
    cache is on by default, so its series are served too)."""
    import json
    import re
    from pathlib import Path

    _, front = stack
    httpx.post(front.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2},
               headers={"Authorization": "Bearer key-main"})
    served = {k[0] for k in _metrics(front)}
    dash = json.loads((Path(__file__).resolve().parents[2] / "docs" / "grafana-councild.json").read_text())
    wanted = {n for p in dash["panels"] for t in p["targets"] for n in re.findall(r"\bcouncild_[a-z_]+\b", t["expr"])}
    assert len(wanted) > 15
    missing = sorted(n for n in wanted if n not in served)
    assert not missing, missing


def test_stats_log_event_and_wall_clock_status(stack, oai):
    import datetime
    import json

    d, _ = stack
    oai.completions.create(model="any", prompt=PROMPT, max_tokens=3, temperature=0)
    with Client(d.endpoint, seat="probe") as c:
        t = c.status().detail["time"]
    now = datetime.datetime.fromisoformat(t["now"])
    assert abs(now.timestamp() - time.time()) < 60 and t["started_at_unix"] <= t["now_unix"]
    deadline = time.monotonic() + 30
    while True:
        stats = [json.loads(x) for x in d.log_path.read_text().splitlines() if '"event": "stats"' in x]
        if stats and stats[-1]["tokens_total"] > 0:
            break
        assert time.monotonic() < deadline, "no stats event with tokens"
        time.sleep(0.5)
    ev = stats[-1]
    assert ev["requests"]["http-test"]["length"] >= 1 and ev["ttft_count"] >= 1
    assert {"memory", "depth", "head_resident", "tokens_per_s", "queued", "drafted", "accepted"} <= set(ev)
