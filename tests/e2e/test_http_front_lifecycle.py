"""The HTTP front's view of a daemon's life: not there yet (503 unreachable), ready, draining
(503 with Retry-After), gone (503 unreachable); seats from X-Councild-Seat when no API keys are set."""

from __future__ import annotations

import signal
import time

import httpx
import openai
from e2e_harness import start_daemon
from http_harness import start_front

PROMPT = "def load(path):\n    with open(path) as f:"


def _health(front) -> tuple[int, dict]:
    r = httpx.get(front.url + "/health", timeout=10)
    return r.status_code, r.json()


def _wait_health(front, status: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        code, body = _health(front)
        if body["status"] == status:
            return body
        assert time.monotonic() < deadline, body
        time.sleep(0.2)


def test_loading_ready_draining_gone(tmp_path, e2e_model):
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    endpoint = f"ipc://{runtime / 'councild.sock'}"
    front = start_front(tmp_path, endpoint, "daemon_timeout_s = 2.0\ndefault_seat = \"web\"\n", wait_ready=False)
    d = None
    try:
        body = _wait_health(front, "unreachable", timeout=30)  # once the first probe has gone unanswered
        assert body["reason"]
        oai = openai.OpenAI(base_url=front.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        try:
            oai.completions.create(model="any", prompt=PROMPT, max_tokens=2)
            raise AssertionError("a request without a daemon must fail")
        except openai.APIStatusError as exc:
            assert exc.status_code == 503 and exc.code == "daemon_unavailable"

        d = start_daemon(tmp_path, e2e_model, config="heartbeat_timeout_s = 3.0\nheartbeat_interval_s = 0.5\n")
        assert _wait_health(front, "ready")["model"] == "model"
        r = oai.completions.with_raw_response.create(model="any", prompt=PROMPT, max_tokens=3, temperature=0,
                                                     extra_headers={"X-Councild-Seat": "alpha"})
        assert r.status_code == 200
        r = httpx.post(front.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2},
                       headers={"X-Councild-Seat": "no spaces allowed"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "X-Councild-Seat"
        oai.completions.create(model="any", prompt=PROMPT, max_tokens=2, temperature=0)  # default seat "web"
        deadline = time.monotonic() + 60  # the daemon's snapshot is at most 0.1 s behind, unless loaded
        while True:
            st = httpx.get(front.url + "/metrics").text
            if 'councild_tokens_total{seat="alpha"} 3.0' in st and 'councild_tokens_total{seat="web"} 2.0' in st:
                break
            assert time.monotonic() < deadline, st
            time.sleep(0.1)

        # A long stream keeps the daemon draining after SIGTERM: /health says so, new work is 503.
        with httpx.Client(timeout=120) as h:
            with h.stream("POST", front.url + "/v1/completions",
                          json={"prompt": PROMPT, "max_tokens": 4000, "temperature": 0, "stream": True}) as resp:
                lines = resp.iter_lines()
                next(line for line in lines if line.startswith("data: "))
                d.proc.send_signal(signal.SIGTERM)
                _wait_health(front, "draining")
                code, _ = _health(front)
                assert code == 503
                r = httpx.post(front.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=30)
                assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
                assert int(r.headers["Retry-After"]) >= 1
                lines.close()
        # The client left: its request is cancelled, the drain ends, the daemon exits cleanly.
        assert d.proc.wait(timeout=60) == 0
        assert _wait_health(front, "unreachable")["reason"]
        r = httpx.post(front.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=30)
        assert r.status_code == 503
    finally:
        front.stop()
        if d is not None:
            d.stop()
