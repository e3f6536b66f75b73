"""`make demo`: the daemon on the bundled model, serving a council of six processes.

It starts `councild serve` as a real child process on a private runtime directory, waits
until the daemon answers, runs the member processes (each its own seat, streaming at the
same time), prints what each said with its timings, prints the daemon's status, and stops
the daemon with SIGTERM the way a service manager would. Three members continue code; the
scout must call a tool (tool_choice "required": the daemon enforces it with a grammar and
parses the call) and the judge answers in a JSON Schema (a json_schema constraint). A
daemon without constrained decoding refuses those two, and the demo says so.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Same class, so the three stream side by side (time-sliced by weighted fair queueing);
# a member asking for "interactive" would go ahead of the others instead.
MEMBERS = [
    ("planner", "normal", "def fibonacci(n):\n"),
    ("coder", "normal", "class Stack:\n    def __init__(self):\n"),
    ("critic", "normal", "import os\n\n\ndef list_files(path):\n"),
    ("scout", "normal", "@tool"),
    ("librarian", "normal", "@files"),
    ("judge", "normal", "@schema"),
]
# The structured members' chats and what constrains them. Bounded arguments, so that even the
# tiny bundled model ends its call within the demo's max_tokens.
WEATHER = {"name": "get_weather", "description": "Weather forecast for a city",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                          "required": ["city", "days"]}}
# Free strings (a path, a pattern): the daemon's grammar bounds them (constraint.string_max_chars)
# and forbids the call format's own tags inside them, so the call closes.
READ_FILE = {"name": "read_file", "description": "Read a text file of the repository",
             "parameters": {"type": "object", "properties": {"path": {"type": "string"},
                                                             "max_lines": {"type": "integer", "minimum": 1}},
                            "required": ["path"]}}
SEARCH_CODE = {"name": "search_code", "description": "Search the repository for a regular expression",
               "parameters": {"type": "object", "properties": {"pattern": {"type": "string"},
                                                               "glob": {"type": "string"}},
                              "required": ["pattern"]}}
VERDICT = {"type": "object", "properties": {"verdict": {"enum": ["approve", "revise"]},
                                            "confidence": {"type": "integer", "minimum": 0, "maximum": 9}},
           "required": ["verdict", "confidence"], "additionalProperties": False}
STRUCTURED = {
    "@tool": ("What will the weather be in Paris for the next three days?",
              {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False}),
    "@files": ("Where is the Stack class defined? Look at the code.",
               {"tools": [READ_FILE, SEARCH_CODE], "tool_choice": "required", "parallel_tool_calls": False}),
    "@schema": ("Should the council adopt the Stack class? Give a verdict.",
                {"constraint": {"kind": "json_schema", "value": json.dumps(VERDICT)}}),
}


def member(endpoint: str, seat: str, priority: str, prompt: str, max_tokens: int) -> int:
    """One council process: stream a completion, report chunk arrival times as JSON lines."""
    from protocol.client import Client

    t0 = time.monotonic()
    with Client(endpoint, seat=seat, timeout_s=60.0) as client:
        if prompt in STRUCTURED:
            question, extra = STRUCTURED[prompt]
            if "constraint" not in client.welcome.capabilities:
                print(json.dumps({"seat": seat, "skipped": "this daemon does not enforce constraints"}), flush=True)
                return 0
            # A call's tags alone are ~40 of the tiny tokenizer's tokens: room for it whole.
            stream = client.generate(messages=[{"role": "user", "content": question}], max_tokens=max(max_tokens, 160),
                                     priority=priority, **extra)
        else:
            stream = client.generate(prompt, max_tokens=max_tokens, priority=priority)
        for chunk in stream:
            print(json.dumps({"seat": seat, "t": round(time.monotonic() - t0, 3), "chunk": chunk}), flush=True)
        done = stream.done
    print(json.dumps({"seat": seat, "t": round(time.monotonic() - t0, 3), "done": {
        "finish_reason": done.finish_reason, "tokens": done.usage.completion_tokens,
        "tool_calls": [[c.name, c.arguments] for c in done.tool_calls],
        "tokens_per_s": round(done.timings.tokens_per_s, 1), "ttft_s": round(done.timings.ttft_s, 3),
        "speculation": None if done.speculation is None else {
            "mode": done.speculation.mode, "drafted": done.speculation.drafted,
            "accepted": done.speculation.accepted}}}), flush=True)
    return 0


def wait_ready(endpoint: str, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    from protocol.readiness import DaemonNotReady, wait_until_answering

    try:
        wait_until_answering(endpoint, proc, timeout_s=timeout_s)
    except DaemonNotReady as exc:
        raise SystemExit(f"demo: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m daemon.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model folder (default: the bundled model)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--member", nargs=4, metavar=("ENDPOINT", "SEAT", "PRIORITY", "PROMPT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.member:
        return member(*args.member, max_tokens=args.max_tokens)

    runtime = Path(tempfile.mkdtemp(prefix="councild-demo-"))
    os.chmod(runtime, 0o700)
    endpoint = f"ipc://{runtime / 'councild.sock'}"
    env = dict(os.environ, COUNCILD_RUNTIME_DIR=str(runtime), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "daemon.cli", "serve", "--endpoint", endpoint, "--log-format", "json"]
    if args.model:
        cmd += ["--model", args.model]
    log_path = runtime / "daemon.log"
    print(f"demo: starting the daemon ({' '.join(cmd[2:])}); its JSON log goes to {log_path}")
    with open(log_path, "w") as log_file:
        daemon_proc = subprocess.Popen(cmd, env=env, stderr=log_file, stdout=log_file)
        try:
            wait_ready(endpoint, daemon_proc)
            print(f"demo: daemon ready on {endpoint}; {len(MEMBERS)} council members stream at once\n")
            rc = run_council(endpoint, args.max_tokens, env)
            show_status(endpoint)
        finally:
            daemon_proc.send_signal(signal.SIGTERM)
            try:
                code = daemon_proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                daemon_proc.kill()
                code = daemon_proc.wait()
    events = [json.loads(line)["event"] for line in log_path.read_text().splitlines() if line.startswith("{")]
    print(f"\ndemo: daemon stopped with exit code {code}; log events: "
          + ", ".join(f"{e} x{events.count(e)}" for e in dict.fromkeys(events)))
    return rc or (0 if code == 0 else 1)


def run_council(endpoint: str, max_tokens: int, env: dict) -> int:
    procs = {
        seat: subprocess.Popen(
            [sys.executable, "-m", "daemon.demo", "--max-tokens", str(max_tokens), "--member", endpoint, seat, prio, prompt],
            env=env, stdout=subprocess.PIPE, text=True)
        for seat, prio, prompt in MEMBERS
    }
    results = {}
    for seat, proc in procs.items():
        out, _ = proc.communicate(timeout=300)
        events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        results[seat] = (proc.returncode, events)
    failed = 0
    for seat, prio, prompt in MEMBERS:
        code, events = results[seat]
        chunks = [e for e in events if "chunk" in e]
        done = next((e["done"] for e in events if "done" in e), None)
        print(f"--- {seat} ({prio}) ---")
        skipped = next((e["skipped"] for e in events if "skipped" in e), None)
        if skipped:
            print(f"[{STRUCTURED[prompt][0]!r} skipped: {skipped}]\n")
            continue
        if prompt in STRUCTURED:
            print(f"user: {STRUCTURED[prompt][0]}")
            print("assistant: " + "".join(e["chunk"] for e in chunks))
            for name, arguments in (done or {}).get("tool_calls", []):
                print(f"tool call: {name}({arguments})")
        else:
            print(prompt + "".join(e["chunk"] for e in chunks))
        if done is None or code != 0:
            print(f"[{seat} failed with exit code {code}]")
            failed += 1
            continue
        streamed = (f" in {len(chunks)} chunks, streamed from {chunks[0]['t']:.2f} s to {chunks[-1]['t']:.2f} s"
                    if chunks else "")  # a call arrives whole, not as text chunks
        print(f"[{done['finish_reason']}: {done['tokens']} tokens{streamed}, {done['tokens_per_s']} tok/s, "
              f"ttft {done['ttft_s'] * 1000:.0f} ms"
              + (f", speculation {done['speculation']}" if done["speculation"] else "") + "]\n")
    return 1 if failed else 0


def show_status(endpoint: str) -> None:
    from daemon.cli import format_status
    from protocol.client import Client

    with Client(endpoint, seat="demo", timeout_s=5.0) as client:
        print("--- councild status ---")
        print(format_status(client.status()))


if __name__ == "__main__":
    sys.exit(main())
