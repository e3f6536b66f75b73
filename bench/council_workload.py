"""A council's workload through the real daemon: prefix cache off vs on, and how a long
prompt's prefill treats the seats that are streaming.

Workload (per arm): ``--seats`` seats share one system prompt of ``--system-tokens``
tokens; each seat runs ``--turns`` turns, one after another, concurrently with the other
seats; a turn's request is the chat so far (system, then the seat's earlier user messages
and the daemon's replies) plus a new user message of ~``--message-tokens`` tokens, sent as
`messages` (the chat template), ``--max-tokens`` tokens out, greedy, speculation off (so
only the prompt handling differs). Reported per arm: TTFT p50/p95 (client side: send to
first token) overall, on turns 2+ and on the requests that hit the cache, aggregate tok/s
(completion tokens over the workload's wall time), each seat's share of the tokens and its
longest wait in the queue (server's queue_s), and cached tokens. Arms run interleaved
(off, on, off, on, ...), a fresh daemon each time, ``--rounds`` rounds.

Long prefill (per ``--long-chunks`` value, cache off): three seats stream; after
``--quiet-s`` seconds a fourth sends a ``--long-tokens``-token prompt. Reported: the three
streams' inter-token gap p95 while that prompt is prefilled (from its send to its first
token) against their gap p95 in the quiet window before it.

The issue's sizes (2,000-token system prompt, 5 turns, 64 tokens out, 8,000-token long
prompt) take many minutes per arm on a 2-core CPU at ~100-140 prefill tokens/s; the
defaults here are scaled down (see --help) and the results say which were used.

Versions (a before/after of the daemon itself): ``--trees before=/path/to/old/checkout,after=.`` runs each arm on each
tree's daemon (``python -m daemon.cli`` from that folder), interleaved round by round, and
also reports the first round's TTFT (a fresh daemon's first requests: what warm-up is for)
and its spread (first-come prefill serves the first arrival sooner). A tree given as
``name=path|key = value`` adds that line to its ``[scheduler]`` table (for a new key an old
tree would refuse). ``--workload-trees`` / ``--long-trees`` pick which trees run which part.

    .venv/bin/python bench/council_workload.py --json bench/results/council_workload_cpu.json \\
        --md bench/results/council_workload_cpu.md
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from daemon.measure.bench_io import spread, write_results  # noqa: E402
from daemon.paths import BUNDLED_MODEL  # noqa: E402
from protocol.client import Client  # noqa: E402
from protocol.readiness import wait_until_answering  # noqa: E402

SYSTEM_LINE = "def council_rule_{i}(motion, votes):\n    return sum(votes) > len(votes) // 2  # rule {i}\n"
USER_LINE = "seat {s} turn {t}: consider clause {k} of the motion.\n"


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def text_of_tokens(tok, line: str, n: int, **fmt) -> str:
    """Text of about n tokens: lines appended until the tokenizer counts n."""
    out, i = "", 0
    while len(tok.encode(out).ids) < n:
        out += line.format(i=i, k=i, **fmt)
        i += 1
    return out


def start(model: str, tmp: Path, name: str, config: str, repo: Path = REPO) -> tuple[subprocess.Popen, str]:
    runtime = tmp / name
    runtime.mkdir(mode=0o700)
    cfg = runtime / "councild.toml"
    cfg.write_text(config)
    endpoint = f"ipc://{runtime / 'councild.sock'}"
    log_path = runtime / "daemon.log"
    proc = subprocess.Popen([sys.executable, "-m", "daemon.cli", "serve", "--model", model, "--endpoint", endpoint,
                             "--config", str(cfg), "--log-format", "json"], cwd=repo,
                            stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                            env=dict(os.environ, COUNCILD_RUNTIME_DIR=str(runtime)))
    wait_until_answering(endpoint, proc, timeout_s=120, log_path=log_path)
    return proc, endpoint


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def workload(endpoint: str, args, tok) -> dict:
    system = text_of_tokens(tok, SYSTEM_LINE, args.system_tokens)
    records: list[dict] = []
    lock = threading.Lock()

    def seat(s: int) -> None:
        chat = [{"role": "system", "content": system}]
        with Client(endpoint, seat=f"seat{s}", timeout_s=600) as c:
            for t in range(args.turns):
                chat.append({"role": "user", "content": text_of_tokens(tok, USER_LINE, args.message_tokens, s=s, t=t)})
                t0 = time.monotonic()
                stream = c.generate(messages=chat, max_tokens=args.max_tokens, speculation="off")
                first = None
                for _ in stream:
                    if first is None:
                        first = time.monotonic()
                done = stream.done
                first = first or time.monotonic()
                chat.append({"role": "assistant", "content": done.text})
                with lock:
                    records.append({"seat": s, "turn": t, "ttft_s": first - t0, "queue_s": done.timings.queue_s,
                                    "prompt_tokens": done.usage.prompt_tokens,
                                    "cached_tokens": done.usage.cached_tokens,
                                    "completion_tokens": done.usage.completion_tokens})

    t0 = time.monotonic()
    threads = [threading.Thread(target=seat, args=(s,)) for s in range(args.seats)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.monotonic() - t0
    total = sum(r["completion_tokens"] for r in records)
    ttft = [r["ttft_s"] for r in records]
    later = [r["ttft_s"] for r in records if r["turn"] > 0]
    hits = [r["ttft_s"] for r in records if r["cached_tokens"] > 0]
    first = [r["ttft_s"] for r in records if r["turn"] == 0]
    seats = {}
    for s in range(args.seats):
        mine = [r for r in records if r["seat"] == s]
        seats[f"seat{s}"] = {"share": sum(r["completion_tokens"] for r in mine) / total if total else 0.0,
                             "longest_wait_s": max(r["queue_s"] for r in mine)}
    return {"wall_s": wall, "tokens": total, "tok_s": total / wall, "ttft_p50": pct(ttft, 0.5),
            "ttft_p95": pct(ttft, 0.95), "ttft_later_p50": pct(later, 0.5), "ttft_later_p95": pct(later, 0.95),
            "ttft_hit_p50": pct(hits, 0.5), "hits": len(hits),
            "ttft_first_round_p50": pct(first, 0.5), "ttft_first_round_min": min(first),
            "ttft_first_round_max": max(first),
            "cached_tokens": sum(r["cached_tokens"] for r in records),
            "prompt_tokens": sum(r["prompt_tokens"] for r in records), "seats": seats, "requests": records}


def long_prefill(endpoint: str, args, tok) -> dict:
    """Three streams; then a long prompt. Gap p95 of the streams, quiet vs during its prefill."""
    arrivals: dict[int, list[float]] = {i: [] for i in range(3)}
    stop_flag = threading.Event()

    def streamer(i: int) -> None:
        with Client(endpoint, seat=f"stream{i}", timeout_s=600) as c:
            s = c.generate(f"def stream_{i}(x):\n", max_tokens=4000, speculation="off")
            for _ in s:
                arrivals[i].append(time.monotonic())
                if stop_flag.is_set():
                    s.cancel()
                    break
            try:
                s.result()
            except Exception:
                pass

    threads = [threading.Thread(target=streamer, args=(i,)) for i in range(3)]
    for th in threads:
        th.start()
    while min(len(a) for a in arrivals.values()) < 5:
        time.sleep(0.05)
    quiet_from = time.monotonic()
    time.sleep(args.quiet_s)
    prompt = tok.encode(text_of_tokens(tok, SYSTEM_LINE, args.long_tokens)).ids[: args.long_tokens]
    with Client(endpoint, seat="long", timeout_s=600) as c:
        t_send = time.monotonic()
        s = c.generate(prompt_tokens=prompt, max_tokens=1, speculation="off")
        for _ in s:
            break
        t_first = time.monotonic()
        s.result()
    stop_flag.set()
    for th in threads:
        th.join(60)

    def gaps(lo: float, hi: float) -> list[float]:
        out = []
        for a in arrivals.values():
            inside = [t for t in a if lo <= t <= hi]
            out += [b - x for x, b in zip(inside, inside[1:])]
        return out

    quiet, during = gaps(quiet_from, t_send), gaps(t_send, t_first)
    q95, d95 = pct(quiet, 0.95), pct(during, 0.95)
    return {"prefill_s": t_first - t_send, "quiet_gap_p95_s": q95, "during_gap_p95_s": d95,
            "ratio": (d95 / q95) if q95 and d95 else None, "quiet_gaps": len(quiet), "during_gaps": len(during),
            "during_max_gap_s": max(during) if during else None}


def parse_trees(spec: str) -> dict[str, tuple[Path, str]]:
    """``name=path[|scheduler line]`` pairs, comma-separated."""
    out = {}
    for item in spec.split(","):
        name, _, rest = item.partition("=")
        path, _, extra = rest.partition("|")
        out[name.strip()] = ((REPO / path.strip()).resolve(), extra.strip())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(BUNDLED_MODEL))
    ap.add_argument("--seats", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3, help="issue: 5")
    ap.add_argument("--system-tokens", type=int, default=400, help="issue: 2000")
    ap.add_argument("--message-tokens", type=int, default=40, help="issue: ~100")
    ap.add_argument("--max-tokens", type=int, default=16, help="issue: 64")
    ap.add_argument("--chunk", type=int, default=128,
                    help="scheduler.prefill_chunk for the workload arms (128: the chunked GatedDeltaNet form)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--long-tokens", type=int, default=800, help="issue: 8000")
    ap.add_argument("--long-chunks", default="32,128")
    ap.add_argument("--quiet-s", type=float, default=3.0)
    ap.add_argument("--skip-long", action="store_true")
    ap.add_argument("--long-rounds", type=int, default=1, help="rounds of the long-prompt part, order alternating")
    ap.add_argument("--arms", default="off,on", help="prefix cache arms of the workload")
    ap.add_argument("--trees", default="this=.", help="name=path[|scheduler line],...: daemon versions to compare")
    ap.add_argument("--workload-trees", help="names of --trees that run the workload (default: all)")
    ap.add_argument("--long-trees", help="names of --trees that run the long-prompt part (default: all)")
    ap.add_argument("--json")
    ap.add_argument("--md")
    args = ap.parse_args()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(args.model) / "tokenizer.json"))
    trees = parse_trees(args.trees)
    work_trees = args.workload_trees.split(",") if args.workload_trees else list(trees)
    long_trees = args.long_trees.split(",") if args.long_trees else list(trees)
    arms = [(t, a) for t in work_trees for a in args.arms.split(",")]
    base = "heartbeat_interval_s = 1.0\nheartbeat_timeout_s = 60.0\n[scheduler]\nmax_active = 4\n"

    def config(tree: str, chunk: int, cache: bool) -> str:
        extra = trees[tree][1]
        return (base + (extra + "\n" if extra else "") + f"prefill_chunk = {chunk}\n[prefix_cache]\n"
                f"enabled = {'true' if cache else 'false'}\n")

    runs: dict[str, list[dict]] = {f"{t} cache {a}": [] for t, a in arms}
    longs = []
    with tempfile.TemporaryDirectory(prefix="council-workload-") as tmp:
        tmp = Path(tmp)
        for r in range(args.rounds):
            for tree, arm in (arms if r % 2 == 0 else arms[::-1]):  # ABAB, then BABA
                label = f"{tree} cache {arm}"
                proc, endpoint = start(args.model, tmp, f"{tree}-{arm}{r}", config(tree, args.chunk, arm == "on"),
                                       trees[tree][0])
                try:
                    res = workload(endpoint, args, tok)
                finally:
                    stop(proc)
                runs[label].append(res)
                print(f"round {r} {label}: {res['tok_s']:.2f} tok/s, first round TTFT p50 "
                      f"{res['ttft_first_round_p50']:.2f} s [{res['ttft_first_round_min']:.2f}-"
                      f"{res['ttft_first_round_max']:.2f}], later p50 {res['ttft_later_p50']:.2f} s, hits {res['hits']}"
                      f" (p50 {res['ttft_hit_p50'] or 0:.2f} s), cached {res['cached_tokens']}", flush=True)
        if not args.skip_long:
            order = [(c, t) for c in [int(x) for x in args.long_chunks.split(",")] for t in long_trees]
            for r in range(args.long_rounds):
                for chunk, tree in (order if r % 2 == 0 else order[::-1]):  # ABAB, then BABA
                    proc, endpoint = start(args.model, tmp, f"long-{tree}-{chunk}-{r}", config(tree, chunk, False),
                                           trees[tree][0])
                    try:
                        res = long_prefill(endpoint, args, tok)
                    finally:
                        stop(proc)
                    res["chunk"] = chunk
                    res["tree"] = tree
                    res["round"] = r
                    longs.append(res)
                    print(f"long prompt, {tree}, chunk {chunk}: prefill {res['prefill_s']:.1f} s, gap p95 quiet "
                          f"{res['quiet_gap_p95_s']:.3f} s, during {res['during_gap_p95_s']:.3f} s", flush=True)

    def med(label: str, key: str) -> dict:
        values = [x[key] for x in runs[label] if x[key] is not None]
        return spread(values) if values else {}

    keys = ("tok_s", "ttft_p50", "ttft_p95", "ttft_later_p50", "ttft_later_p95", "ttft_hit_p50", "ttft_first_round_p50",
            "ttft_first_round_min", "ttft_first_round_max", "cached_tokens", "prompt_tokens")
    summary = {label: {k: med(label, k) for k in keys} for label in runs}
    result = {"args": vars(args), "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
              "trees": {k: [str(p), e] for k, (p, e) in trees.items()},
              "note": "2-core CPU shared with other engineers' jobs: noisy, loaded", "runs": runs,
              "summary": summary, "long_prefill": longs}
    for tree in work_trees:
        off, on = runs.get(f"{tree} cache off"), runs.get(f"{tree} cache on")
        if off and on:
            result[f"{tree}: on_over_off_tok_s"] = spread([b["tok_s"] / a["tok_s"] for a, b in zip(off, on)])
            result[f"{tree}: on_over_off_ttft_later_p50"] = spread(
                [b["ttft_later_p50"] / a["ttft_later_p50"] for a, b in zip(off, on)])
    lines = [
        f"Council workload: {args.seats} seats, {args.turns} turns, system ~{args.system_tokens} tokens, "
        f"message ~{args.message_tokens}, {args.max_tokens} tokens out, prefill_chunk {args.chunk}, "
        f"{args.rounds} rounds, arms interleaved (median [min-max]). Machine: see the results README.",
        "",
        "| arm | tok/s | first round TTFT p50 s | first round TTFT min / max s | TTFT p50 s | TTFT p95 s | "
        "TTFT p50, turns 2+ | TTFT p50, hits | cached / prompt tokens |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(d: dict) -> str:
        return f"{d['median']:.2f} [{d['min']:.2f}-{d['max']:.2f}]" if d.get("n") else "-"

    for label in [k for k in runs if runs[k]]:  # (--rounds 0: the long-prompt part only)
        s = summary[label]
        lines.append(f"| {label} | {cell(s['tok_s'])} | {cell(s['ttft_first_round_p50'])} | "
                     f"{cell(s['ttft_first_round_min'])} / {cell(s['ttft_first_round_max'])} | "
                     f"{cell(s['ttft_p50'])} | {cell(s['ttft_p95'])} | "
                     f"{cell(s['ttft_later_p50'])} | {cell(s['ttft_hit_p50'])} | "
                     f"{s['cached_tokens']['median']:.0f} / {s['prompt_tokens']['median']:.0f} |")
    lines += ["", "| arm | seat | share | longest wait s |", "|---|---|---|---|"]
    for label in [k for k in runs if runs[k]]:
        for s in range(args.seats):
            k = f"seat{s}"
            lines.append(f"| {label} | {k} | {statistics.median(r['seats'][k]['share'] for r in runs[label]):.2f} | "
                         f"{max(r['seats'][k]['longest_wait_s'] for r in runs[label]):.2f} |")
    if longs:
        lines += ["", f"Long prompt ({args.long_tokens} tokens) while 3 seats stream:", "",
                  "| round | tree | prefill_chunk | prefill s | gap p95 quiet s | gap p95 during s | ratio | "
                  "max gap during s |",
                  "|---|---|---|---|---|---|---|---|"]
        for x in longs:
            lines.append(f"| {x['round']} | {x['tree']} | {x['chunk']} | {x['prefill_s']:.1f} | {x['quiet_gap_p95_s']:.3f} | "
                         f"{x['during_gap_p95_s'] or 0:.3f} | {x['ratio'] or 0:.1f} | {x['during_max_gap_s'] or 0:.3f} |")
        by: dict[tuple, list[dict]] = {}
        for x in longs:
            by.setdefault((x["tree"], x["chunk"]), []).append(x)
        lines += ["", "| tree | prefill_chunk | prefill s | gap p95 during s | ratio during / quiet |", "|---|---|---|---|---|"]
        for (tree, chunk), xs in by.items():
            ratios = [x["ratio"] for x in xs if x["ratio"]]
            lines.append(f"| {tree} | {chunk} | {cell(spread([x['prefill_s'] for x in xs]))} | "
                         f"{cell(spread([x['during_gap_p95_s'] for x in xs if x['during_gap_p95_s']]))} | "
                         f"{cell(spread(ratios)) if ratios else '-'} |")
        result["long_prefill_summary"] = {f"{t} chunk {c}": {
            "prefill_s": spread([x["prefill_s"] for x in xs]),
            "during_gap_p95_s": spread([x["during_gap_p95_s"] for x in xs if x["during_gap_p95_s"]])}
            for (t, c), xs in by.items()}
    md = "\n".join(lines)
    print(md)
    write_results(result, md, args.json, args.md)


if __name__ == "__main__":
    main()
