"""Soak test of councild: a daemon and its HTTP front under mixed load, with the faults an
operator meets over a day, bounded in time, on loopback only.

    .venv/bin/python tools/soak.py --duration-s 1800 --json bench/results/soak_30min.json

Starts a daemon (the bundled model, which has an MTP head) on a private ipc socket and a
`councild http` front on a loopback port, then for --duration-s runs at once:
  - ZeroMQ seats (protocol.Client, one per thread): greedy requests whose answer is known
    from a quiet run, sampled ones, cancels mid-stream, deadlines, streamed and not;
  - HTTP clients (the openai client; raw SSE through httpx for streamed completions, so
    every event is counted): the same mix through /v1/completions and /v1/chat/completions,
    and clients that hang up mid-stream;
  - every prompt starts with one long shared preamble, so the prefix cache hits throughout;
and, on a timeline: SIGHUP reloads (a changed [scheduler], [governor] and stats interval),
memory-pressure waves (a helper process holds real memory until MemAvailable is below the
governor's critical threshold, as tests/e2e/test_governor_memory.py does: the governor sheds
admissions, drops prompt caches and evicts the head; after the release the head comes back),
one daemon restart (SIGKILL, then a new daemon on the same endpoint) and one front restart
(SIGTERM, then a new front on the same port).

Checks (any failure makes the exit code 1):
  - every request ended exactly one way, from the client's side (Done or a terminal error;
    for SSE: one finish chunk then [DONE], or one error event, nothing after); none hung;
  - in the daemon's logs, every accepted request has exactly one terminal event
    (request.done / request.error); the only exception is the daemon killed with SIGKILL,
    whose in-flight requests must each have ended in an error at their client;
  - no stream mixed another's tokens: every greedy request's tokens (or text) equal the
    quiet run's for the same prompt, or are a prefix of them when cancelled or cut;
  - memory returned to its baseline: MLX active memory of the idle daemon at the end, less
    the prefix cache it holds, equals the idle daemon's at the start (same model, same
    config), with the head resident in both;
  - the logs hold every event docs/OPERATIONS.md promises for what happened.

Prints a table; --json writes the report (with the command) under bench/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import httpx  # noqa: E402
import openai  # noqa: E402
import psutil  # noqa: E402

from contention import Helper, memavailable_bytes  # noqa: E402
from daemon.paths import BUNDLED_MODEL  # noqa: E402
from protocol.client import Client, CouncilError, DaemonUnavailable, Overloaded  # noqa: E402
from protocol.readiness import wait_until_answering  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20
WARN_BELOW_START = 1.0 * GiB
CRIT_BELOW_START = 1.5 * GiB
OVERSHOOT = 0.5 * GiB
MAX_HOLD_MB = 3072
# A shared preamble of a few hundred tokens: every prompt starts with it, so the prefix
# cache (snapshots at prefill-chunk boundaries) serves it after the first request.
PREAMBLE = "".join(f"# council rule {i}: every seat reads the plan, answers in turn and cites its source.\n"
                   for i in range(14))
TAILS = ["def fibonacci(n):\n", "class Council:\n    def __init__(self):\n", "import os\nimport sys\n\n",
         "# Summarise the plan in three steps\n", "def parse(line):\n    parts = line.split(",
         "The critic says: "]
GREEDY_MAX_TOKENS = (8, 24, 48)
CHAT_TAILS = ["List three rules.", "Which seat answers first?", "Say hi."]


def daemon_config(warn_at: int | None, crit_at: int | None, variant: int) -> str:
    """The daemon's file; ``variant`` toggles what each SIGHUP changes (all live keys)."""
    linux = "" if warn_at is None else (f"\n[governor.linux]\nmemavail_warn_bytes = {warn_at}\n"
                                        f"memavail_critical_bytes = {crit_at}\n")
    return f"""
log_level = "info"
heartbeat_interval_s = 0.5
heartbeat_timeout_s = 10.0
drain_deadline_s = 20.0
stats_interval_s = {10 + variant}
max_tokens = 512

[speculation]
mode = "exact"
depth = 1

[scheduler]
max_active = 4
max_queued = 64
max_queued_per_seat = 16
prefill_chunk = 64
starvation_bound_s = {30.0 + variant}

[prefix_cache]
max_bytes = 268435456

[governor]
tick_s = 0.1
restore_window_s = 3.0
min_reload_gap_s = 3.0
warn_evict_s = 120.0
warn_clear_s = {1.0 + 0.5 * variant}
shed_retry_after_s = 1.0
shed_release_s = 1.0
clear_cache_interval_s = 1.0
idle_evict_s = 3600.0
head_margin_bytes = 67108864
{linux}"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_events(path: Path) -> list[dict]:
    out = []
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    return out


class Procs:
    """The daemon and the front, each restartable; every incarnation logs to its own file."""

    def __init__(self, tmp: Path, model: Path):
        self.tmp, self.model = tmp, model
        self.runtime = tmp / "run"
        self.runtime.mkdir(mode=0o700)
        self.endpoint = f"ipc://{self.runtime / 'councild.sock'}"
        self.config = tmp / "councild.toml"
        self.port = free_port()
        self.front_config = tmp / "front.toml"
        self.front_config.write_text(f'endpoint = "{self.endpoint}"\n[http]\nport = {self.port}\n'
                                     'daemon_timeout_s = 30.0\n')
        self.url = f"http://127.0.0.1:{self.port}"
        self.daemons: list[dict] = []  # {"proc", "log", "killed"}
        self.fronts: list[dict] = []

    def start_daemon(self) -> dict:
        log = self.tmp / f"daemon-{len(self.daemons)}.log"
        cmd = [sys.executable, "-m", "daemon.cli", "serve", "--model", str(self.model), "--endpoint", self.endpoint,
               "--log-format", "json", "--config", str(self.config)]
        env = dict(os.environ, COUNCILD_RUNTIME_DIR=str(self.runtime), PYTHONUNBUFFERED="1")
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
        d = {"proc": proc, "log": log, "killed": False, "started": time.monotonic()}
        self.daemons.append(d)
        wait_until_answering(self.endpoint, proc, timeout_s=180, log_path=log)
        d["ready_s"] = round(time.monotonic() - d["started"], 2)
        return d

    @property
    def daemon(self) -> dict:
        return self.daemons[-1]

    def start_front(self) -> dict:
        log = self.tmp / f"front-{len(self.fronts)}.log"
        proc = subprocess.Popen([sys.executable, "-m", "daemon.cli", "http", "--config", str(self.front_config)],
                                cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=open(log, "w"),
                                stderr=subprocess.STDOUT)
        f = {"proc": proc, "log": log, "started": time.monotonic()}
        self.fronts.append(f)
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"front exited {proc.returncode}: {log.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"front not ready: {log.read_text()[-2000:]}")
            time.sleep(0.2)
        f["ready_s"] = round(time.monotonic() - f["started"], 2)
        return f

    def stop_front(self, timeout: float = 30.0) -> int:
        proc = self.fronts[-1]["proc"]
        if proc.poll() is None:
            proc.terminate()
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()

    def stop_daemon(self, timeout: float = 60.0) -> int:
        proc = self.daemon["proc"]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()


# ---------------------------------------------------------------------------- references


def greedy_specs() -> list[dict]:
    specs = []
    for i, tail in enumerate(TAILS):
        specs.append({"key": f"p{i}-{GREEDY_MAX_TOKENS[i % 3]}", "prompt": PREAMBLE + tail,
                      "max_tokens": GREEDY_MAX_TOKENS[i % 3]})
    for i, q in enumerate(CHAT_TAILS):
        specs.append({"key": f"c{i}", "messages": [{"role": "system", "content": PREAMBLE},
                                                   {"role": "user", "content": q}], "max_tokens": 24})
    return specs


def quiet_run(endpoint: str, specs: list[dict]) -> dict:
    """Each greedy spec's tokens and text from a quiet daemon, one request at a time."""
    refs = {}
    with Client(endpoint, seat="reference", timeout_s=60) as c:
        for spec in specs:
            kw = {"prompt": spec["prompt"]} if "prompt" in spec else {"messages": spec["messages"]}
            s = c.generate(**kw, max_tokens=spec["max_tokens"], temperature=0.0)
            list(s)
            refs[spec["key"]] = {"tokens": list(s.token_ids), "text": s.done.text,
                                 "finish": s.done.finish_reason}
    return refs


# ---------------------------------------------------------------------------- load


class Load:
    def __init__(self, procs: Procs, specs: list[dict], refs: dict, seed: int):
        self.procs, self.specs, self.refs = procs, specs, refs
        self.seed = seed
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.records: list[dict] = []
        self.open: dict[str, dict] = {}  # started, not ended (a hang shows here)

    def begin(self, rec: dict) -> dict:
        rec["t0"] = time.monotonic()
        with self.lock:
            self.open[rec["id"]] = rec
        return rec

    def end(self, rec: dict, outcome: str, **kw) -> None:
        rec.update(kw)
        rec["outcome"] = outcome
        rec["s"] = round(time.monotonic() - rec["t0"], 3)
        with self.lock:
            if self.open.pop(rec["id"], None) is None:
                rec["ended_twice"] = True
            self.records.append(rec)

    # ------------------------------------------------------------- greedy checks
    def check_tokens(self, rec: dict, key: str, tokens: list[int], complete: bool) -> None:
        ref = self.refs[key]["tokens"]
        rec["greedy"] = key
        rec["mismatch"] = (tokens != ref) if complete else (tokens != ref[:len(tokens)])
        if rec["mismatch"]:
            rec["got"], rec["want"], rec["complete"] = tokens, ref, complete

    def check_text(self, rec: dict, key: str, text: str, complete: bool) -> None:
        ref = self.refs[key]["text"]
        rec["greedy"] = key
        rec["mismatch"] = (text != ref) if complete else not ref.startswith(text)
        if rec["mismatch"]:
            rec["got"], rec["want"], rec["complete"] = text, ref, complete

    # ------------------------------------------------------------- ZeroMQ seats
    def zmq_worker(self, wid: int) -> None:
        rng = random.Random(self.seed * 1000 + wid)
        client = Client(self.procs.endpoint, seat=f"z{wid}", timeout_s=10)
        try:
            while not self.stop.is_set():
                self._zmq_one(client, rng, wid)
        finally:
            # Anything routed after its stream ended (a second terminal, a late chunk) is stray.
            late = [x for x in client.stray if getattr(x, "request_id", None) and
                    type(x).__name__ in ("Tokens", "Done", "Error") and getattr(x, "code", None) != "not_found"]
            with self.lock:
                self.stray_after_terminal = getattr(self, "stray_after_terminal", 0) + len(late)
            client.close()

    def _zmq_one(self, client: Client, rng: random.Random, wid: int) -> None:
        spec = rng.choice(self.specs)
        kw = {"prompt": spec["prompt"]} if "prompt" in spec else {"messages": spec["messages"]}
        r = rng.random()
        rid = f"z{wid}-{uuid.uuid4().hex[:12]}"
        rec = self.begin({"id": rid, "via": "zmq", "seat": f"z{wid}"})
        cancel_after = None
        if r < 0.5:
            rec["kind"] = "greedy"
            args = dict(kw, max_tokens=spec["max_tokens"], temperature=0.0, stream=rng.random() < 0.7)
        elif r < 0.65:
            rec["kind"] = "sampled"
            args = dict(kw, max_tokens=32, temperature=0.8, seed=rng.randrange(1 << 30))
        elif r < 0.85:
            rec["kind"] = "cancel"
            cancel_after = rng.choice([0, 1, 3, 6])
            args = dict(kw, max_tokens=spec["max_tokens"], temperature=0.0)
        else:
            rec["kind"] = "deadline"
            args = dict(kw, max_tokens=200, temperature=0.0, deadline_ms=rng.choice([200, 800, 2000]))
        rec["stream"] = args.get("stream", True)
        try:
            s = client.generate(**args, request_id=rid)
            n = 0
            for _ in s:
                n += 1
                if cancel_after is not None and n >= cancel_after and not s.cancel_requested:
                    s.cancel()
            done = s.done
            if rec["kind"] in ("greedy", "cancel") and rec["stream"]:
                self.check_tokens(rec, spec["key"], list(s.token_ids), done.finish_reason in ("length", "stop"))
            elif rec["kind"] == "greedy":  # not streamed: the Done's text is all there is
                self.check_text(rec, spec["key"], done.text, done.finish_reason in ("length", "stop"))
            elif rec["kind"] == "deadline":
                pass  # max_tokens differs from the reference's: nothing to compare
            self.end(rec, f"done:{done.finish_reason}", tokens=done.usage.completion_tokens,
                     accepted=s.accepted is not None)
        except DaemonUnavailable:
            self.end(rec, "unavailable", accepted=_accepted(locals()))
            time.sleep(0.5)
        except Overloaded as exc:
            self.end(rec, f"error:{exc.code}", accepted=False)
            time.sleep(min(2.0, exc.retry_after_s or 0.5))
        except CouncilError as exc:
            st = locals().get("s")
            if st is not None and rec["kind"] in ("greedy", "cancel") and rec["stream"]:
                self.check_tokens(rec, spec["key"], list(st.token_ids), complete=False)
            self.end(rec, f"error:{exc.code}", accepted=_accepted(locals()))

    # ------------------------------------------------------------- HTTP clients
    def http_worker(self, wid: int) -> None:
        rng = random.Random(self.seed * 2000 + wid)
        seat = f"h{wid}"
        oai = openai.OpenAI(base_url=self.procs.url + "/v1", api_key="unused", max_retries=0, timeout=120,
                            default_headers={"X-Councild-Seat": seat})
        with httpx.Client(timeout=120, headers={"X-Councild-Seat": seat}) as h:
            while not self.stop.is_set():
                self._http_one(oai, h, rng, wid)

    def _http_one(self, oai: openai.OpenAI, h: httpx.Client, rng: random.Random, wid: int) -> None:
        spec = rng.choice(self.specs)
        chat = "messages" in spec
        r = rng.random()
        rec = self.begin({"id": f"h{wid}-{uuid.uuid4().hex[:12]}", "via": "http", "seat": f"h{wid}", "chat": chat})
        body: dict = {"model": "soak", "max_tokens": spec["max_tokens"], "temperature": 0}
        body.update({"messages": spec["messages"]} if chat else {"prompt": spec["prompt"]})
        hang_up_after = None
        if r < 0.55:
            rec["kind"] = "greedy"
        elif r < 0.7:
            rec["kind"] = "sampled"
            body.update(temperature=0.8, seed=rng.randrange(1 << 30), max_tokens=32)
        elif r < 0.85:
            rec["kind"] = "hang_up"
            hang_up_after = rng.choice([1, 2, 4])
        else:
            rec["kind"] = "deadline"
            body.update(max_tokens=200, deadline_ms=rng.choice([200, 800, 2000]))
        stream = hang_up_after is not None or rng.random() < 0.6
        rec["stream"] = stream
        try:
            if stream and not chat:
                self._http_sse(h, body, rec, spec, hang_up_after)
            elif stream:
                self._http_chat_stream(oai, body, rec, spec, hang_up_after)
            else:
                self._http_plain(oai, body, rec, spec, chat)
        except (openai.APITimeoutError, httpx.TimeoutException) as exc:
            self.end(rec, "http_timeout", error=type(exc).__name__)  # a hang: counted as lost
        except openai.APIConnectionError as exc:
            self.end(rec, "http:connection", error=type(exc).__name__)
            time.sleep(0.5)
        except httpx.TransportError as exc:
            self.end(rec, "http:connection", error=type(exc).__name__)
            time.sleep(0.5)
        except openai.APIStatusError as exc:
            code = (exc.body or {}).get("code") if isinstance(exc.body, dict) else None
            self.end(rec, f"http:{exc.status_code}:{code}", retry_after=exc.response.headers.get("retry-after"))
            if exc.status_code in (429, 503):
                time.sleep(1.0)
        except openai.APIError as exc:  # an error event inside a stream
            self.end(rec, f"sse_error:{getattr(exc, 'code', None)}")

    def _http_plain(self, oai, body: dict, rec: dict, spec: dict, chat: bool) -> None:
        extra = {k: body.pop(k) for k in ("deadline_ms",) if k in body}
        if chat:
            resp = oai.chat.completions.create(**body, extra_body=extra or None)
            text, finish = resp.choices[0].message.content or "", resp.choices[0].finish_reason
        else:
            resp = oai.completions.create(**body, extra_body=extra or None)
            text, finish = resp.choices[0].text, resp.choices[0].finish_reason
        rec["rid"] = resp.id.split("-", 1)[1]
        if rec["kind"] == "greedy":
            self.check_text(rec, spec["key"], text, complete=finish in ("length", "stop"))
        self.end(rec, f"done:{finish}", tokens=resp.usage.completion_tokens)

    def _http_chat_stream(self, oai, body: dict, rec: dict, spec: dict, hang_up_after: int | None) -> None:
        extra = {k: body.pop(k) for k in ("deadline_ms",) if k in body}
        stream = oai.chat.completions.create(**body, stream=True, extra_body=extra or None)
        parts, finishes, n = [], [], 0
        for chunk in stream:
            rec.setdefault("rid", chunk.id.split("-", 1)[1])
            if chunk.choices:
                ch = chunk.choices[0]
                if ch.delta and ch.delta.content:
                    parts.append(ch.delta.content)
                    n += 1
                if ch.finish_reason:
                    finishes.append(ch.finish_reason)
            if hang_up_after is not None and n >= hang_up_after:
                stream.close()
                if rec["kind"] in ("greedy", "hang_up"):
                    self.check_text(rec, spec["key"], "".join(parts), complete=False)
                self.end(rec, "hung_up")
                return
        if len(finishes) != 1:
            rec["terminal_count"] = len(finishes)
        if rec["kind"] == "greedy":
            self.check_text(rec, spec["key"], "".join(parts), complete=finishes[-1:] in (["length"], ["stop"]))
        self.end(rec, f"done:{finishes[-1] if finishes else None}")

    def _http_sse(self, h: httpx.Client, body: dict, rec: dict, spec: dict, hang_up_after: int | None) -> None:
        """Streamed completions read as raw SSE: every event counted, nothing hidden."""
        body = dict(body, stream=True)
        with h.stream("POST", self.procs.url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                resp.read()
                try:
                    code = resp.json()["error"]["code"]
                except Exception:
                    code = None
                self.end(rec, f"http:{resp.status_code}:{code}", retry_after=resp.headers.get("retry-after"))
                if resp.status_code in (429, 503):
                    time.sleep(1.0)
                return
            parts, finishes, errors, done_marks, after_terminal, n = [], [], [], 0, 0, 0
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if finishes and done_marks or errors:
                    after_terminal += 1
                if data == "[DONE]":
                    done_marks += 1
                    continue
                ev = json.loads(data)
                if "error" in ev:
                    errors.append(ev["error"].get("code"))
                    continue
                rec.setdefault("rid", ev["id"].split("-", 1)[1])
                ch = ev["choices"][0]
                if ch.get("text"):
                    parts.append(ch["text"])
                    n += 1
                if ch.get("finish_reason"):
                    finishes.append(ch["finish_reason"])
                if hang_up_after is not None and n >= hang_up_after:
                    break
        if hang_up_after is not None and n >= hang_up_after and not finishes and not errors:
            self.check_text(rec, spec["key"], "".join(parts), complete=False)
            self.end(rec, "hung_up")
            return
        terminals = (1 if finishes and done_marks else 0) + len(errors)
        rec["terminal_count"] = terminals
        rec["after_terminal"] = after_terminal
        if len(finishes) > 1 or done_marks > 1:
            rec["terminal_count"] = max(terminals, 2)
        if rec["kind"] in ("greedy", "hang_up"):
            self.check_text(rec, spec["key"], "".join(parts),
                            complete=not errors and finishes in (["length"], ["stop"]))
        if errors:
            self.end(rec, f"sse_error:{errors[0]}")
        elif not finishes:
            self.end(rec, "sse_cut")  # the connection ended with neither: counted as lost below
        else:
            self.end(rec, f"done:{finishes[0]}")


def _accepted(scope: dict) -> bool | None:
    s = scope.get("s")
    return None if s is None else s.accepted is not None


# ---------------------------------------------------------------------------- the timeline


class Timeline:
    def __init__(self, procs: Procs, load: Load, duration_s: float, waves: int, mem: dict):
        self.procs, self.load, self.duration_s = procs, load, duration_s
        self.waves, self.mem = waves, mem
        self.events: list[dict] = []
        self.variant = 0
        self.t0 = time.monotonic()

    def at(self, frac: float) -> None:
        target = self.t0 + frac * self.duration_s
        while time.monotonic() < target and not self.load.stop.is_set():
            time.sleep(0.2)

    def note(self, what: str, **kw) -> dict:
        ev = {"t": round(time.monotonic() - self.t0, 2), "what": what, **kw}
        self.events.append(ev)
        print(f"[soak {ev['t']:8.1f} s] {what} {kw if kw else ''}", flush=True)
        return ev

    def plan(self) -> list[tuple[float, str]]:
        plan = [(f, "sighup") for f in (0.08, 0.3, 0.52, 0.72, 0.9)]
        plan += [(0.45, "daemon_restart"), (0.8, "front_restart")]
        wave_at = [0.15, 0.6, 0.95][: self.waves] if self.duration_s >= 900 else [0.15][: self.waves]
        plan += [(f, "wave") for f in wave_at]
        return sorted(plan)

    def run(self) -> None:
        for frac, what in self.plan():
            self.at(frac)
            if time.monotonic() - self.t0 > self.duration_s:
                break
            try:
                getattr(self, what)()
            except Exception as exc:  # recorded; the checks below decide
                self.note(f"{what}_failed", error=repr(exc))

    def sighup(self) -> None:
        self.variant = 1 - self.variant
        self.procs.config.write_text(daemon_config(self.mem.get("warn_at"), self.mem.get("crit_at"), self.variant))
        self.procs.daemon["proc"].send_signal(signal.SIGHUP)
        self.procs.daemon.setdefault("sighups", 0)
        self.procs.daemon["sighups"] += 1
        self.note("sighup", variant=self.variant)

    def daemon_restart(self) -> None:
        d = self.procs.daemon
        last_hup = max([e["t"] for e in self.events if e["what"] == "sighup"], default=-1e9)
        time.sleep(max(0.0, last_hup + 3.0 - (time.monotonic() - self.t0)))  # let a SIGHUP land first
        d["proc"].send_signal(signal.SIGKILL)
        d["proc"].wait()
        d["killed"] = True
        self.note("daemon_killed", pid=d["proc"].pid)
        t = time.monotonic()
        # What the front says while no daemon runs, probed as an operator would.
        health = []
        new = threading.Thread(target=self.procs.start_daemon)
        new.start()
        while new.is_alive():
            try:
                r = httpx.get(self.procs.url + "/health", timeout=5)
                health.append((round(time.monotonic() - t, 2), r.status_code, r.json().get("status")))
            except httpx.HTTPError as exc:
                health.append((round(time.monotonic() - t, 2), None, type(exc).__name__))
            time.sleep(0.5)
        new.join()
        self.note("daemon_started", ready_s=self.procs.daemon["ready_s"],
                  health_states=sorted({h[2] for h in health if h[2]}), health_samples=len(health))

    def front_restart(self) -> None:
        code = self.procs.stop_front()
        self.note("front_stopped", exit_code=code)
        f = self.procs.start_front()
        self.note("front_started", ready_s=f["ready_s"])

    def wave(self) -> None:
        if self.mem.get("crit_at") is None:
            self.note("wave_skipped", reason=self.mem.get("why"))
            return
        avail = memavailable_bytes()
        if avail < self.mem["crit_at"] + OVERSHOOT:
            self.note("wave_skipped", reason=f"MemAvailable already {avail >> 20} MiB (others hold memory)")
            return
        ev = self.note("wave_start", memavailable_mib=avail >> 20)
        helper = Helper(["hold", "--step-mb", "128", "--max-mb", str(MAX_HOLD_MB), "--step-pause-s", "0.02",
                         "--until-memavail-below", str(int(self.mem["crit_at"] - OVERSHOOT))])
        try:
            held = list(helper.lines(timeout_s=60))
            ev["held_mib"] = (held[-1].get("holding", 0) >> 20) if held else 0
            ev["evicted"] = self._wait_status(lambda d: not d["head_resident"], 30)
            ev["shedding_seen"] = bool(ev["evicted"] and ev["evicted"]["governor"].get("shedding"))
            time.sleep(5.0)  # hold the pressure while the load goes on
        finally:
            helper.stop()
        ev["evicted"] = bool(ev["evicted"])
        self.note("wave_released")
        # The governor reloads after restore_window_s of calm when it predicts a gain; a long
        # run gives it longer to show that it does.
        back = self._wait_status(lambda d: d["head_resident"], 45 if self.duration_s >= 900 else 15)
        ev["head_back_by"] = "governor" if back else None
        if not back:
            # The governor reloads only on a predicted gain (on a 2-core CPU the head may not
            # pay, bench/results/README_governor.md); the operator's pin brings it back.
            with Client(self.procs.endpoint, seat="operator", timeout_s=30) as c:
                ok = c.governor("pin_depth", 1).ok
                back = self._wait_status(lambda d: d["head_resident"], 60)
                c.governor("auto")
            ev["head_back_by"] = "operator_pin" if back and ok else None
        self.note("wave_end", evicted=ev["evicted"], head_back_by=ev["head_back_by"])

    def _wait_status(self, pred, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        with Client(self.procs.endpoint, seat="operator", timeout_s=30) as c:
            while time.monotonic() < deadline:
                try:
                    d = c.status().detail
                except CouncilError:
                    time.sleep(0.5)
                    continue
                if pred(d):
                    return d
                time.sleep(0.1)
        return None


# ---------------------------------------------------------------------------- memory


def idle_memory(endpoint: str, pid: int, timeout_s: float = 120.0) -> dict:
    """MLX active memory of an idle daemon with its head resident (waits for both)."""
    deadline = time.monotonic() + timeout_s
    with Client(endpoint, seat="operator", timeout_s=30) as c:
        while True:
            d = c.status().detail
            if not d["active_requests"] and d["in_flight"] == 0 and d["head_resident"] and d["memory"]:
                time.sleep(0.5)  # one more publish after the last request
                d = c.status().detail
                if not d["active_requests"] and d["head_resident"]:
                    break
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        pc = d["prefix_cache"]
        return {"active_bytes": d["memory"].get("active_bytes"), "prefix_cache_bytes": pc.get("bytes", 0),
                "prefix_cache_entries": pc.get("entries"), "head_resident": d["head_resident"],
                "active_less_cache": d["memory"].get("active_bytes", 0) - pc.get("bytes", 0),
                "rss_bytes": psutil.Process(pid).memory_info().rss, "prefix_cache": pc}


# ---------------------------------------------------------------------------- analysis


def documented_events() -> set[str]:
    text = (REPO / "docs" / "OPERATIONS.md").read_text()
    return set(re.findall(r"^\| `([a-z_]+\.[a-z_.]+)` \|", text, re.M))


def analyse(load: Load, procs: Procs, timeline: Timeline, base: dict, final: dict) -> dict:
    recs = load.records
    violations: list[str] = []
    outcomes = Counter(r["outcome"].split(":")[0] + (":" + r["outcome"].split(":")[1] if ":" in r["outcome"] else "")
                       for r in recs)
    hung = list(load.open.values())
    lost = len(hung) + sum(1 for r in recs if r["outcome"] in ("sse_cut", "http_timeout"))
    duplicated = sum(1 for r in recs if r.get("ended_twice") or r.get("terminal_count", 1) > 1
                     or r.get("after_terminal", 0) > 0) + getattr(load, "stray_after_terminal", 0)
    mixed = [r for r in recs if r.get("mismatch")]
    greedy_checked = sum(1 for r in recs if "greedy" in r)
    if hung:
        violations.append(f"{len(hung)} requests never ended: {[r['id'] for r in hung[:5]]}")
    if lost - len(hung):
        violations.append(f"{lost - len(hung)} HTTP requests timed out or ended with neither a finish nor an error")
    if duplicated:
        violations.append(f"{duplicated} requests ended more than once or got data after their terminal")
    if mixed:
        violations.append(f"{len(mixed)} greedy requests differ from the quiet run: "
                          f"{[(r['id'], r['greedy'], r['outcome']) for r in mixed[:5]]}")

    # The daemon's side: one terminal event per accepted request, per incarnation.
    client_outcome = {r.get("rid", r["id"]): r for r in recs}
    daemon_side = []
    events_seen: Counter = Counter()
    for i, d in enumerate(procs.daemons):
        evs = read_events(d["log"])
        events_seen.update(e["event"] for e in evs)
        accepted = {e["request_id"] for e in evs if e["event"] == "request.accepted"}
        terminals = Counter(e["request_id"] for e in evs if e["event"] in ("request.done", "request.error"))
        dup = [rid for rid, n in terminals.items() if n > 1]
        missing = sorted(accepted - set(terminals))
        killed_ok = [rid for rid in missing if d["killed"]]
        bad_missing = [rid for rid in missing if not d["killed"]]
        # A request the SIGKILL cut must have ended at its client with an error, never a Done.
        wrong = [rid for rid in killed_ok if rid in client_outcome and client_outcome[rid]["outcome"].startswith("done")]
        daemon_side.append({"incarnation": i, "killed": d["killed"], "accepted": len(accepted),
                            "terminal_events": sum(terminals.values()), "duplicate_terminals": len(dup),
                            "no_terminal": len(missing), "cut_by_sigkill": len(killed_ok),
                            "sighups": d.get("sighups", 0),
                            "config_reloaded": sum(1 for e in evs if e["event"] == "config.reloaded"),
                            "exit_code": d["proc"].returncode})
        if dup:
            violations.append(f"daemon {i}: {len(dup)} requests with more than one terminal event: {dup[:5]}")
        if bad_missing:
            violations.append(f"daemon {i}: {len(bad_missing)} accepted requests without a terminal event: {bad_missing[:5]}")
        if wrong:
            violations.append(f"daemon {i}: requests cut by SIGKILL reported done at their client: {wrong[:5]}")
        if daemon_side[-1]["config_reloaded"] != daemon_side[-1]["sighups"]:
            violations.append(f"daemon {i}: {daemon_side[-1]['sighups']} SIGHUPs but "
                              f"{daemon_side[-1]['config_reloaded']} config.reloaded events")
    front_events: Counter = Counter()
    for f in procs.fronts:
        for name in re.findall(r"\b(http\.[a-z_]+)\b", f["log"].read_text(errors="replace")):
            front_events[name] += 1

    # Events the docs promise for what this run did.
    expected = {"daemon.loading", "model.loaded", "daemon.start", "request.accepted", "request.done",
                "request.error", "config.reloaded", "daemon.draining", "daemon.stop", "head.loaded"}
    waves = [e for e in timeline.events if e["what"] == "wave_start"]
    if any(e.get("evicted") for e in waves):
        expected |= {"governor.decision", "head.evicted"}
    if any(e["what"] == "sighup" for e in timeline.events):
        expected.add("governor.reconfigured")  # every SIGHUP changes [governor].warn_clear_s
    if any(e.get("head_back_by") == "operator_pin" for e in waves):
        expected.add("governor.override")
    docs = documented_events()
    not_documented = sorted(e for e in expected if e not in docs)
    missing_events = sorted(e for e in expected if not events_seen.get(e))
    front_expected = {"http.start", "http.daemon_unreachable", "http.daemon_reachable"}
    missing_front = sorted(e for e in front_expected if not front_events.get(e))
    front_not_documented = sorted(e for e in front_expected if f"`{e}`" not in (REPO / "docs" / "OPERATIONS.md").read_text())
    if not_documented or front_not_documented:
        violations.append(f"events not in docs/OPERATIONS.md: {not_documented + front_not_documented}")
    if missing_events or missing_front:
        violations.append(f"promised events missing from the logs: {missing_events + missing_front}")

    # Memory back to its baseline (idle, head resident, prefix cache held aside).
    mem = {"baseline": base, "final": final}
    if base and final:
        delta = final["active_less_cache"] - base["active_less_cache"]
        mem["active_less_cache_delta_bytes"] = delta
        mem["rss_delta_mib"] = round((final["rss_bytes"] - base["rss_bytes"]) / MiB, 1)
        if not final["head_resident"]:
            violations.append("the head is not resident at the end")
        if abs(delta) > 16 * MiB:
            violations.append(f"MLX active memory (less the prefix cache) is {delta / MiB:+.1f} MiB off its baseline")

    accepted = sum(d["accepted"] for d in daemon_side)
    # A ZeroMQ client that gave up on a live daemon (10 s of silence: a starved box) is not a
    # lost request (it got its one terminal, an error) but is worth seeing.
    kill = next((e["t"] for e in timeline.events if e["what"] == "daemon_killed"), None)
    back = next((e["t"] for e in timeline.events if e["what"] == "daemon_started"), None)
    unavailable_live = sum(1 for r in recs if r["outcome"] == "unavailable" and kill is not None
                           and not (r["t0"] - timeline.t0 <= back + 1 and r["t0"] - timeline.t0 + r["s"] >= kill - 1))
    prefix_hits = sum(e.get("cached_tokens", 0) > 0 for d in procs.daemons for e in read_events(d["log"])
                      if e["event"] == "request.done")
    return {
        "violations": violations,
        "requests": len(recs), "by_via": dict(Counter(r["via"] for r in recs)),
        "by_kind": dict(Counter(f"{r['via']}:{r['kind']}" for r in recs)),
        "outcomes": dict(outcomes.most_common()),
        "accepted": accepted,
        "lost": lost, "duplicated": duplicated, "unavailable_while_daemon_up": unavailable_live, "mixed": len(mixed), "greedy_checked": greedy_checked,
        "prefix_cache_hit_requests": prefix_hits,
        "daemon_side": daemon_side, "events_seen": dict(events_seen), "front_events": dict(front_events),
        "expected_events": sorted(expected | front_expected), "memory": mem,
        "mixed_records": mixed[:20],
    }


def print_report(report: dict) -> None:
    s = report["summary"]
    print("\n== councild soak ==")
    print(f"duration {report['duration_s']} s, wall {report['wall_s']} s, {report['zmq_clients']} ZeroMQ seats + "
          f"{report['http_clients']} HTTP clients, seed {report['seed']}; box shared with other work")
    rows = [("requests", s["requests"]), ("  via zmq / http", f"{s['by_via'].get('zmq', 0)} / {s['by_via'].get('http', 0)}"),
            ("accepted (daemon logs)", s["accepted"]), ("lost", s["lost"]), ("duplicated", s["duplicated"]),
            ("mixed (greedy != quiet run)", s["mixed"]), ("greedy requests checked", s["greedy_checked"]),
            ("prefix-cache hit requests", s["prefix_cache_hit_requests"])]
    for d in s["daemon_side"]:
        rows.append((f"daemon {d['incarnation']}{' (SIGKILL)' if d['killed'] else ''}",
                     f"accepted {d['accepted']}, terminals {d['terminal_events']}, none {d['no_terminal']}, "
                     f"dup {d['duplicate_terminals']}, SIGHUP {d['sighups']}/{d['config_reloaded']} reloaded, "
                     f"exit {d['exit_code']}"))
    m = s["memory"]
    if m.get("baseline") and m.get("final"):
        rows.append(("MLX active less prefix cache", f"{m['baseline']['active_less_cache'] / MiB:.1f} -> "
                     f"{m['final']['active_less_cache'] / MiB:.1f} MiB (delta {m['active_less_cache_delta_bytes']} B)"))
        rows.append(("daemon RSS (fresh vs end)", f"{m['baseline']['rss_bytes'] / MiB:.0f} -> {m['final']['rss_bytes'] / MiB:.0f} MiB"))
    w = max(len(r[0]) for r in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    print("outcomes:", ", ".join(f"{k} {v}" for k, v in s["outcomes"].items()))
    print("timeline:", "; ".join(f"{e['t']:.0f}s {e['what']}" for e in report["timeline"]))
    print("violations:", s["violations"] or "none")


# ---------------------------------------------------------------------------- main


def run(args) -> dict:
    model = Path(args.model) if args.model else BUNDLED_MODEL
    tmp = Path(tempfile.mkdtemp(prefix="councild-soak-"))
    avail0 = memavailable_bytes()
    mem: dict = {"memavailable_start_mib": avail0 >> 20}
    if args.waves and avail0 >= CRIT_BELOW_START + OVERSHOOT + 3 * GiB:
        mem["warn_at"], mem["crit_at"] = int(avail0 - WARN_BELOW_START), int(avail0 - CRIT_BELOW_START)
    else:
        mem["why"] = "waves off" if not args.waves else f"only {avail0 >> 20} MiB available"
    procs = Procs(tmp, model)
    procs.config.write_text(daemon_config(mem.get("warn_at"), mem.get("crit_at"), 0))
    t_start = time.monotonic()
    load = timeline = None
    base = final = {}
    try:
        procs.start_daemon()
        procs.start_front()
        specs = greedy_specs()
        refs = quiet_run(procs.endpoint, specs)
        base = idle_memory(procs.endpoint, procs.daemon["proc"].pid)
        load = Load(procs, specs, refs, args.seed)
        timeline = Timeline(procs, load, args.duration_s, args.waves, mem)
        threads = [threading.Thread(target=load.zmq_worker, args=(i,), daemon=True) for i in range(args.zmq_clients)]
        threads += [threading.Thread(target=load.http_worker, args=(i,), daemon=True) for i in range(args.http_clients)]
        for t in threads:
            t.start()
        ctl = threading.Thread(target=timeline.run, daemon=True)
        ctl.start()
        while time.monotonic() - timeline.t0 < args.duration_s:
            time.sleep(0.5)
        load.stop.set()
        ctl.join(timeout=180)
        for t in threads:
            t.join(timeout=180)
        timeline.note("load_stopped", threads_alive=sum(t.is_alive() for t in threads))
        final = idle_memory(procs.endpoint, procs.daemon["proc"].pid)
    finally:
        procs.stop_front()
        procs.stop_daemon()
    summary = analyse(load, procs, timeline, base, final) if load is not None else {"violations": ["no load ran"]}
    report = {
        "command": "python tools/soak.py " + " ".join(args.argv), "duration_s": args.duration_s,
        "wall_s": round(time.monotonic() - t_start, 1), "seed": args.seed, "zmq_clients": args.zmq_clients,
        "http_clients": args.http_clients, "model": str(model), "memory_setup": mem,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "load_avg_end": os.getloadavg(),
                    "note": "a 2-core box shared with other engineers' tests and benchmarks: the soak checks "
                            "correctness, not speed"},
        "commit": args.commit or subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                                                text=True).stdout.strip(),
        "timeline": timeline.events if timeline else [], "summary": summary, "logs": str(tmp),
    }
    if not args.keep_logs and not summary["violations"]:
        shutil.rmtree(tmp, ignore_errors=True)
        report["logs"] = None
    return report


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration-s", type=float, default=180.0)
    ap.add_argument("--zmq-clients", type=int, default=3)
    ap.add_argument("--http-clients", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--waves", type=int, default=3, help="memory-pressure waves (0: none)")
    ap.add_argument("--model", help="model folder (default: the bundled model, which has an MTP head)")
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--keep-logs", action="store_true", help="keep the daemon and front logs even on success")
    ap.add_argument("--commit", help="the commit this tree was exported from (a run from `git archive`, so that "
                                     "edits to the working tree cannot reach the daemons it restarts)")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    args.argv = argv
    report = run(args)
    print_report(report)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1, default=str) + "\n")
    return 1 if report["summary"]["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
