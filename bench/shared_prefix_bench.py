"""Two seats, one long shared prefix: does the second prompt reuse the first one's prefill?

Against real daemons on the bundled model (default config, a fresh cache folder each):
seat A sends a cold prompt of ~``--prefix-tokens`` tokens, then seat B sends the same
prompt with another last line (it diverges in its last ~15 tokens), in each prompt form:

- ``text``: a raw prompt (``prompt=``; no message ends);
- ``tokens``: the same as token ids (``prompt_tokens=``);
- ``chat``: ``messages`` (a system message holding most of the context, then a user message
  whose last line differs: B diverges inside the last message).

Every round uses fresh prefixes (another salt), so no round reuses another's. Arms are code
trees (``--tree NAME=PATH``, e.g. the commit before a change in a temporary clone): each
arm's daemon runs that tree's code (``PYTHONPATH`` and working folder), the client is this
tree's. Arms alternate within each round (ABAB, BA...).

Reported per arm and form: the repeat's TTFT over the cold one's (Done.timings.ttft_s, the
daemon's; median and range over rounds), ``cached_tokens`` of the repeat, and the prefix
cache's bytes and snapshots per stored prompt (status ``prefix_cache`` before and after each
request: what the cold prompt and the repeat each added).

    .venv/bin/python bench/shared_prefix_bench.py --tree before=/tmp/before45 --tree after=. \\
        --json bench/results/shared_prefix_cpu.json --md bench/results/shared_prefix_cpu.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from daemon.paths import BUNDLED_MODEL  # noqa: E402
from protocol.client import Client  # noqa: E402
from protocol.readiness import wait_until_answering  # noqa: E402

WORDS = ("council seat answer context memory reason plan tool result budget prefix state "
         "snapshot token layer model daemon request stream queue turn").split()
FORMS = ("text", "tokens", "chat")


def context(n_lines: int, salt: int) -> str:
    """Shared context: numbered lines of words, different for every salt."""
    return "".join(f"{i + salt * 1000}. " + " ".join(WORDS[(i * 7 + j * 3 + salt * 13) % len(WORDS)] for j in range(8))
                   + "\n" for i in range(n_lines))


def last_line(member: str, extra_lines: int = 0, salt: int = 0) -> str:
    """The member's own part: ``extra_lines`` lines of its own (``--tail-lines``), then one line."""
    own = "".join(f"Member {member} note {i}: " + " ".join(WORDS[(i * 5 + j + salt + ord(member)) % len(WORDS)]
                                                           for j in range(4 + (salt + i) % 5)) + "\n"
                  for i in range(extra_lines))
    return own + f"Member {member}: give your own view on the plan above, in one line.\n"


class Daemon:
    def __init__(self, name: str, tree: Path, tmp: Path, model: Path):
        self.name, self.tree = name, tree
        tmp.mkdir(parents=True)
        runtime = tmp / "run"
        runtime.mkdir(mode=0o700)
        self.endpoint = f"ipc://{runtime / 'councild.sock'}"
        self.log_path = tmp / "daemon.log"
        env = dict(os.environ, PYTHONPATH=str(tree), COUNCILD_RUNTIME_DIR=str(runtime),
                   COUNCILD_CACHE_DIR=str(tmp / "cache"), PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "daemon.cli", "serve", "--model", str(model), "--endpoint", self.endpoint,
               "--log-format", "json"]
        self.proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT)
        wait_until_answering(self.endpoint, self.proc, timeout_s=300, log_path=self.log_path)

    def prefix_cache(self) -> dict:
        with Client(self.endpoint, seat="bench-obs", timeout_s=60) as c:
            return c.status().detail["prefix_cache"]

    def stop(self) -> int:
        self.proc.terminate()
        return self.proc.wait(timeout=120)


def ask(d: Daemon, seat: str, form: str, prompt, max_tokens: int) -> dict:
    before = d.prefix_cache()
    t0 = time.perf_counter()
    with Client(d.endpoint, seat=seat, timeout_s=600) as c:
        kw = {"text": {"prompt": prompt}, "tokens": {"prompt_tokens": prompt}, "chat": {"messages": prompt}}[form]
        s = c.generate(max_tokens=max_tokens, **kw)
        done = s.result()
        ids = list(s.token_ids)
    wall = time.perf_counter() - t0
    after = d.prefix_cache()
    return {"ttft_s": done.timings.ttft_s, "wall_s": wall, "prompt_tokens": done.usage.prompt_tokens,
            "cached_tokens": done.usage.cached_tokens, "tokens": ids,
            "added_bytes": after["bytes"] - before["bytes"], "added_entries": after["entries"] - before["entries"],
            "evicted": after["evicted"] - before["evicted"]}


def prompts(form: str, salt: int, lines: int, encode, tail_lines: int = 0) -> tuple:
    shared = context(lines, salt)
    if form == "chat":
        head, tail = shared[: len(shared) * 9 // 10], shared[len(shared) * 9 // 10:]
        return tuple([{"role": "system", "content": head},
                      {"role": "user", "content": tail + last_line(m, tail_lines, salt)}] for m in ("A", "B"))
    a, b = shared + last_line("A", tail_lines, salt), shared + last_line("B", tail_lines, salt)
    return (a, b) if form == "text" else (encode(a), encode(b))


def summarize(rows: list[dict]) -> dict:
    out = {}
    for arm in sorted({r["arm"] for r in rows}):
        out[arm] = {}
        for form in FORMS:
            rs = [r for r in rows if r["arm"] == arm and r["form"] == form]
            if not rs:
                continue
            ratios = [r["repeat"]["ttft_s"] / r["cold"]["ttft_s"] for r in rs]
            cold_bytes = [r["cold"]["added_bytes"] for r in rs]
            out[arm][form] = {
                "rounds": len(rs),
                "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                "cold_ttft_median_s": statistics.median(r["cold"]["ttft_s"] for r in rs),
                "repeat_ttft_median_s": statistics.median(r["repeat"]["ttft_s"] for r in rs),
                "prompt_tokens": statistics.median(r["repeat"]["prompt_tokens"] for r in rs),
                "repeat_cached_tokens": [r["repeat"]["cached_tokens"] for r in rs],
                "shared_tokens": [r["shared_tokens"] for r in rs],
                "bytes_per_cold_prompt_median": statistics.median(cold_bytes),
                "bytes_per_repeat_prompt_median": statistics.median(r["repeat"]["added_bytes"] for r in rs),
                "snapshots_per_cold_prompt": statistics.median(r["cold"]["added_entries"] for r in rs),
                "snapshots_per_repeat_prompt": statistics.median(r["repeat"]["added_entries"] for r in rs),
                "evicted": sum(r["cold"]["evicted"] + r["repeat"]["evicted"] for r in rs),
            }
    return out


def markdown(summary: dict, args, cmd: str, wall: float) -> str:
    lines = [f"# Shared-prefix reuse across seats ({time.strftime('%Y-%m-%d')})", "",
             f"`{cmd}`", "",
             f"Bundled model, default config, a fresh cache folder per daemon; {args.rounds} rounds, arms alternating; "
             f"~{args.lines}-line shared context. Seat A's cold prompt, then seat B's, which differs in its last line "
             f"(and the {args.tail_lines} lines of the member's own before it). "
             "TTFT is the daemon's (Done.timings.ttft_s); ratio = B's TTFT / A's, median [min-max] over rounds. "
             "Bytes: what each prompt added to the prefix cache's RAM tier (status `prefix_cache.bytes`), "
             f"median; snapshots likewise. Wall {wall:.0f} s.", "",
             "| arm | form | prompt tok | B cached tok (per round) | A TTFT s | B TTFT s | B/A ratio | A bytes (snapshots) | B bytes (snapshots) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for arm, forms in summary.items():
        for form, s in forms.items():
            lines.append(f"| {arm} | {form} | {s['prompt_tokens']:.0f} | {s['repeat_cached_tokens']} | "
                         f"{s['cold_ttft_median_s']:.2f} | {s['repeat_ttft_median_s']:.2f} | "
                         f"{s['ratio_median']:.3f} [{s['ratio_min']:.3f}-{s['ratio_max']:.3f}] | "
                         f"{s['bytes_per_cold_prompt_median'] / 1e6:.2f} MB ({s['snapshots_per_cold_prompt']:.0f}) | "
                         f"{s['bytes_per_repeat_prompt_median'] / 1e6:.2f} MB ({s['snapshots_per_repeat_prompt']:.0f}) |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", action="append", required=True, help="NAME=PATH: a code tree whose daemon is an arm")
    ap.add_argument("--model", default=str(BUNDLED_MODEL))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lines", type=int, default=108, help="shared context lines (~22 tokens each: ~2,400 tokens)")
    ap.add_argument("--tail-lines", type=int, default=0,
                    help="lines of the member's own before its last line (B diverges that much earlier)")
    ap.add_argument("--forms", default=",".join(FORMS))
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--json")
    ap.add_argument("--md")
    args = ap.parse_args()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(args.model) / "tokenizer.json"))
    encode = lambda s: tok.encode(s).ids  # noqa: E731
    forms = args.forms.split(",")
    t_start = time.perf_counter()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="shared-prefix-") as tmp:
        daemons = []
        for spec in args.tree:
            name, path = spec.split("=", 1)
            daemons.append(Daemon(name, Path(path).resolve(), Path(tmp) / name, Path(args.model)))
        try:
            for rnd in range(args.rounds):
                order = daemons if rnd % 2 == 0 else daemons[::-1]
                for i, form in enumerate(forms):
                    for d in order:
                        salt = 1 + rnd * len(forms) + i  # fresh per round and form, the same across arms
                        a, b = prompts(form, salt, args.lines, encode, args.tail_lines)
                        cold = ask(d, f"seat-a-{rnd}", form, a, args.max_tokens)
                        repeat = ask(d, f"seat-b-{rnd}", form, b, args.max_tokens)
                        ta, tb = (encode(a), encode(b)) if form == "text" else (a, b) if form == "tokens" else ([], [])
                        shared = next((k for k, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
                        rows.append({"arm": d.name, "round": rnd, "form": form, "cold": cold, "repeat": repeat,
                                     "shared_tokens": shared if form != "chat" else None})
                        print(f"round {rnd} {d.name:8s} {form:6s} prompt {repeat['prompt_tokens']} cold "
                              f"{cold['ttft_s']:.2f}s repeat {repeat['ttft_s']:.2f}s (cached {repeat['cached_tokens']}) "
                              f"ratio {repeat['ttft_s'] / cold['ttft_s']:.3f} bytes {cold['added_bytes']}/{repeat['added_bytes']}",
                              flush=True)
        finally:
            for d in daemons:
                d.stop()
    summary = summarize(rows)
    wall = time.perf_counter() - t_start
    cmd = "python bench/shared_prefix_bench.py " + " ".join(sys.argv[1:])
    md = markdown(summary, args, cmd, wall)
    print(md)
    if args.json:
        Path(args.json).write_text(json.dumps({"command": cmd, "args": vars(args), "summary": summary, "rows": rows,
                                               "wall_s": round(wall, 1), "platform": platform.platform()}, indent=1))
    if args.md:
        Path(args.md).write_text(md)


if __name__ == "__main__":
    main()
