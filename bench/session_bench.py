"""Sessions that last: an agent loop through the real daemon with the prefix
cache in RAM only, in RAM and on disk, and across a restart.

Workload: ``--seats`` seats share a system prompt of ~``--system-tokens`` tokens; each runs
``--turns`` turns, seat after seat (one request at a time, so TTFT is the prompt's work
alone); a turn sends the chat so far (``messages``: system, the seat's earlier user messages
and the daemon's replies) plus a new user message of ~``--message-tokens`` tokens, greedy,
``--max-tokens`` out, speculation off. ``--history strip`` sends each earlier reply back
rewritten (its first line dropped), as a template that strips past reasoning does.

Arms (a fresh daemon and cache folder each; interleaved, ``--rounds`` rounds):
- ``cold``: prefix cache off;
- ``ram``: RAM only (``prefix_cache.disk = false``), exact snapshots only (the default);
- ``disk``: RAM and disk, exact snapshots only;
- ``disk_restart``: as ``disk``, SIGTERM and a fresh daemon on the same cache folder
  before the last turn;
- ``fine_restart``: as ``disk_restart`` with ``prefix_cache.inexact_reuse = true``
  (continuations and prompt ends; inexact on this CPU, see OPERATIONS.md);
- ``fine_strip_restart``: as ``fine_restart`` with ``--history strip`` (only with
  ``--strip-arm``).

Reported per arm and turn: TTFT (the daemon's Done.timings.ttft_s) median and range over
seats and rounds, reused / prompt tokens; the ratio of the last turn's TTFT to ``cold``'s;
and, from ``prefix_cache.disk_hit`` log events, restore time per token against the cold
arm's prefill time per token (TTFT / prompt tokens on turn 1).

    .venv/bin/python bench/session_bench.py --json bench/results/session_cpu.json \\
        --md bench/results/session_cpu.md
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "e2e"))

from e2e_harness import start_daemon  # noqa: E402

from daemon.paths import BUNDLED_MODEL  # noqa: E402
from protocol.client import Client  # noqa: E402

WORDS = ("council seat answer context memory reason plan tool result budget prefix state "
         "snapshot token layer model daemon request stream queue turn").split()


def text(n_words: int, salt: int) -> str:
    return " ".join(WORDS[(i * 7 + salt * 13) % len(WORDS)] for i in range(n_words))


def config(arm: str, chunk: int) -> str:
    base = f"heartbeat_interval_s = 0.5\ngovernor_enabled = false\n[speculation]\nmode = \"off\"\n" \
           f"[scheduler]\nprefill_chunk = {chunk}\n[prefix_cache]\n"
    if arm == "cold":
        return base + "enabled = false\n"
    if arm == "ram":
        return base + "disk = false\n"
    if arm.startswith("fine"):
        return base + "inexact_reuse = true\n"
    return base


def strip(reply: str) -> str:
    """An earlier reply as a reasoning-stripping template re-renders it: its first line gone."""
    lines = reply.split("\n", 1)
    return lines[1] if len(lines) > 1 else reply[len(reply) // 2 :]


def run_arm(arm: str, args, tmp: Path) -> dict:
    restart = arm.endswith("_restart")
    history_mode = "strip" if "strip" in arm else "verbatim"
    system = text(int(args.system_tokens / 2.3), 0)
    chats = {s: [{"role": "system", "content": system}] for s in range(args.seats)}
    rows = []
    d = start_daemon(tmp, BUNDLED_MODEL, config=config(arm, args.chunk))
    logs = []
    try:
        for turn in range(args.turns):
            if restart and turn == args.turns - 1:
                assert d.stop() == 0
                logs.append(d.events())
                (tmp / "daemon.log").rename(tmp / f"daemon-{turn}.log")
                d = start_daemon(tmp, BUNDLED_MODEL, config=config(arm, args.chunk))
            for s in range(args.seats):
                chat = chats[s]
                chat.append({"role": "user", "content": text(int(args.message_tokens / 2.3), 100 * s + turn + 1)})
                with Client(d.endpoint, seat=f"seat-{s}", timeout_s=600) as c:
                    done = c.generate(messages=chat, max_tokens=args.max_tokens, speculation="off").result()
                reply = done.text
                chat.append({"role": "assistant", "content": reply})
                rows.append({"turn": turn + 1, "seat": s, "ttft_s": done.timings.ttft_s,
                             "prompt_tokens": done.usage.prompt_tokens, "cached_tokens": done.usage.cached_tokens,
                             "after_restart": restart and turn == args.turns - 1})
                if history_mode == "strip":
                    chat[-1] = {"role": "assistant", "content": strip(reply)}
    finally:
        d.stop()
        logs.append(d.events())
    hits = [e for events in logs for e in events if e["event"] == "prefix_cache.disk_hit"]
    return {"arm": arm, "rows": rows, "disk_hits": [{"tokens": e["tokens"], "ms": e["ms"], "bytes": e["bytes"]}
                                                    for e in hits]}


def summarize(results: list[dict], args) -> dict:
    by_arm: dict[str, list[dict]] = {}
    for r in results:
        by_arm.setdefault(r["arm"], []).append(r)
    out = {}
    for arm, runs in by_arm.items():
        turns = {}
        for t in range(1, args.turns + 1):
            rs = [row for run in runs for row in run["rows"] if row["turn"] == t]
            ttfts = [row["ttft_s"] for row in rs]
            turns[t] = {"ttft_median_s": statistics.median(ttfts), "ttft_min_s": min(ttfts), "ttft_max_s": max(ttfts),
                        "prompt_tokens": sum(row["prompt_tokens"] for row in rs),
                        "cached_tokens": sum(row["cached_tokens"] for row in rs)}
        hits = [h for run in runs for h in run["disk_hits"]]
        out[arm] = {"turns": turns, "disk_hits": len(hits),
                    "restore_ms_per_token": (statistics.median(h["ms"] / h["tokens"] for h in hits) if hits else None)}
    cold = out.get("cold")
    if cold:
        cold_rows = [row for run in by_arm["cold"] for row in run["rows"]]
        prefill_ms_per_token = statistics.median(1000 * r["ttft_s"] / r["prompt_tokens"] for r in cold_rows)
        last = args.turns
        for arm, s in out.items():
            s["last_turn_ttft_vs_cold"] = s["turns"][last]["ttft_median_s"] / cold["turns"][last]["ttft_median_s"]
            s["prefill_ms_per_token_cold"] = prefill_ms_per_token
            if s["restore_ms_per_token"]:
                s["restore_speedup_vs_prefill"] = prefill_ms_per_token / s["restore_ms_per_token"]
    return out


def markdown(summary: dict, args, cmd: str, wall: float) -> str:
    lines = [f"# Sessions that last: agent loop, {args.seats} seats x {args.turns} turns (bundled model, CPU)", "",
             f"`{cmd}`", "",
             f"{platform.machine()} {platform.system()}, {args.rounds} round(s), arms interleaved, {wall:.0f} s wall. "
             "The 2-core box was shared with other helpers' work: absolute times are noisy; compare arms.", "",
             "TTFT is the daemon's (Done.timings.ttft_s), median [min-max] over seats and rounds; reused is "
             "cached/prompt tokens over those requests. Restart arms restart before the last turn.", "",
             "| arm | " + " | ".join(f"turn {t} TTFT s (reused)" for t in range(1, args.turns + 1))
             + " | last turn vs cold | restore ms/token | prefill ms/token (cold) | restore speed-up |",
             "|---|" + "---|" * (args.turns + 4)]
    for arm, s in summary.items():
        cells = []
        for t in range(1, args.turns + 1):
            x = s["turns"][t]
            cells.append(f"{x['ttft_median_s']:.2f} [{x['ttft_min_s']:.2f}-{x['ttft_max_s']:.2f}] "
                         f"({x['cached_tokens']}/{x['prompt_tokens']})")
        rest = s.get("restore_ms_per_token")
        ratio = s.get("last_turn_ttft_vs_cold")
        cold_pt = s.get("prefill_ms_per_token_cold")
        cells += [f"{ratio:.2f}x" if ratio is not None else "-", f"{rest:.4f}" if rest else "-",
                  f"{cold_pt:.2f}" if cold_pt is not None else "-",
                  f"{s['restore_speedup_vs_prefill']:.0f}x" if rest else "-"]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seats", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system-tokens", type=int, default=400)
    ap.add_argument("--message-tokens", type=int, default=60)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--arms", default="cold,ram,disk,disk_restart,fine_restart")
    ap.add_argument("--strip-arm", action="store_true", help="add fine_strip_restart")
    ap.add_argument("--json")
    ap.add_argument("--md")
    args = ap.parse_args()
    arms = args.arms.split(",") + (["fine_strip_restart"] if args.strip_arm else [])
    cmd = "python bench/session_bench.py " + " ".join(sys.argv[1:])
    t0 = time.time()
    results = []
    for r in range(args.rounds):
        order = arms if r % 2 == 0 else arms[::-1]
        for arm in order:
            with tempfile.TemporaryDirectory(prefix=f"sessions-{arm}-") as tmp:
                t = time.time()
                res = run_arm(arm, args, Path(tmp))
                results.append(res)
                print(f"round {r + 1} {arm}: {time.time() - t:.0f} s", flush=True)
    wall = time.time() - t0
    summary = summarize(results, args)
    md = markdown(summary, args, cmd, wall)
    print(md)
    if args.json:
        Path(args.json).write_text(json.dumps({"command": cmd, "args": vars(args), "wall_s": wall,
                                               "summary": summary, "runs": results}, indent=1))
    if args.md:
        Path(args.md).write_text(md)


if __name__ == "__main__":
    main()
