"""A prompt of a token count the daemon never forwarded: its first token with and without the
``prefill_lengths`` start-up part (``warm_prefill_lengths``), two daemons side by side.

Why: on CUDA a forward of a token count never run before costs more than the same count again
(bench/probes/prefill_length_first_use.py: 1.71x on an H100), and nearly every request's last
prompt piece has a count of its own; a council benchmark whose later rounds repeat the first
round's prompt lengths hides it. Here every request has a length neither daemon served before.

Two daemons on the same model, ``warm_prefill_lengths = "on"`` and ``"off"`` (each its own
cache folder, so neither reads the other's verdicts), both waited for until their start-up
parts are done (status ``warming.pending`` empty). Then for each of ``--requests`` lengths,
drawn once and distinct (tokens ids drawn at random: no prefix-cache hit), one greedy request
of that many prompt tokens and ``--max-tokens`` out to each daemon, which first alternating
(ABAB), then the same length again with other tokens ("again": the floor). Reported per arm:
TTFT median and spread, new and again, and the per-length ratio off / on.

    PYTHONPATH=$PWD .venv/bin/python bench/new_length_ttft.py --requests 24 --json /tmp/nl.json --markdown /tmp/nl.md
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.council_workload import start, stop  # noqa: E402
from daemon.measure.bench_io import spread, write_results  # noqa: E402
from daemon.paths import BUNDLED_MODEL  # noqa: E402
from protocol.client import Client  # noqa: E402

ARMS = ("on", "off")


def wait_warmed(endpoint: str, timeout_s: float) -> float:
    """Seconds until the daemon's start-up parts are done (status warming.pending empty)."""
    t0 = time.monotonic()
    with Client(endpoint, seat="bench", timeout_s=60) as c:
        while True:
            pending = (c.status().detail.get("warming") or {}).get("pending") or []
            if not pending:
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                raise SystemExit(f"still warming after {timeout_s} s: {pending}")
            time.sleep(0.5)


def ttft(c: Client, tokens: list[int], max_tokens: int) -> float:
    t0 = time.perf_counter()
    stream = c.generate(prompt_tokens=tokens, max_tokens=max_tokens, temperature=0.0)
    first = None
    for _ in stream:
        first = first or time.perf_counter()
    assert stream.done.usage.prompt_tokens == len(tokens), (stream.done.usage.prompt_tokens, len(tokens))
    return (first or time.perf_counter()) - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(BUNDLED_MODEL))
    ap.add_argument("--requests", type=int, default=24, help="lengths, each new to both daemons")
    ap.add_argument("--min-tokens", type=int, default=20)
    ap.add_argument("--max-tokens-prompt", type=int, default=250,
                    help="longest prompt (keep it within one prefill chunk: the part warms 1..chunk)")
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=4000, help="token ids drawn from 10..this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warm-timeout", type=float, default=600)
    ap.add_argument("--config-extra", default="", help="TOML appended to both daemons' configs")
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    lengths = rng.sample(range(args.min_tokens, args.max_tokens_prompt + 1), args.requests)

    tmp = Path(tempfile.mkdtemp(prefix="new-length-"))
    procs, endpoints, warmed_s = {}, {}, {}
    try:
        for arm in ARMS:
            os.environ["COUNCILD_CACHE_DIR"] = str(tmp / f"cache-{arm}")
            procs[arm], endpoints[arm] = start(args.model, tmp, arm,
                                               f'warm_prefill_lengths = "{arm}"\n' + args.config_extra)
            warmed_s[arm] = wait_warmed(endpoints[arm], args.warm_timeout)
            print(f"{arm}: start-up parts done {warmed_s[arm]:.1f} s after ready", flush=True)
        rows = []
        with Client(endpoints["on"], seat="b", timeout_s=600) as con, \
                Client(endpoints["off"], seat="b", timeout_s=600) as coff:
            clients = {"on": con, "off": coff}
            for i, n in enumerate(lengths):
                order = ARMS if i % 2 == 0 else ARMS[::-1]
                row = {"tokens": n}
                for what in ("new", "again"):
                    prompt = [rng.randrange(10, args.vocab) for _ in range(n)]
                    for arm in order:
                        row[f"{arm}_{what}_s"] = ttft(clients[arm], prompt, args.max_tokens)
                rows.append(row)
                print(f"{n:4d} tokens: new on {row['on_new_s'] * 1e3:7.1f} ms off {row['off_new_s'] * 1e3:7.1f} ms | "
                      f"again on {row['on_again_s'] * 1e3:7.1f} off {row['off_again_s'] * 1e3:7.1f}", flush=True)
    finally:
        for p in procs.values():
            stop(p)

    def ms(key: str) -> dict:
        return {k: (round(v * 1e3, 2) if k != "n" else v) for k, v in spread([r[key] for r in rows]).items()}

    summary = {f"{arm}_{what}": ms(f"{arm}_{what}_s") for arm in ARMS for what in ("new", "again")}
    summary["off_over_on_new"] = statistics.median(r["off_new_s"] / r["on_new_s"] for r in rows)
    summary["off_over_on_again"] = statistics.median(r["off_again_s"] / r["on_again_s"] for r in rows)
    summary["new_over_again"] = {arm: statistics.median(r[f"{arm}_new_s"] / r[f"{arm}_again_s"] for r in rows)
                                 for arm in ARMS}
    md = ["| arm | TTFT new: median ms (range) | TTFT again: median ms (range) | new / again (median of pairs) |",
          "|---|---|---|---|"]
    for arm in ARMS:
        n, a = summary[f"{arm}_new"], summary[f"{arm}_again"]
        md.append(f"| warm_prefill_lengths = {arm} | {n['median']:.1f} ({n['min']:.1f}-{n['max']:.1f}) | "
                  f"{a['median']:.1f} ({a['min']:.1f}-{a['max']:.1f}) | {summary['new_over_again'][arm]:.2f}x |")
    md.append(f"\noff / on, new lengths (median of per-length ratios): **{summary['off_over_on_new']:.2f}x**; "
              f"again: {summary['off_over_on_again']:.2f}x; {len(rows)} lengths "
              f"{min(lengths)}-{max(lengths)} tokens, {args.max_tokens} token(s) out; start-up parts done "
              + ", ".join(f"{a} {s:.1f} s" for a, s in warmed_s.items()) + " after ready")
    text = "\n".join(md)
    print(text)
    write_results({"command": " ".join(sys.argv), "lengths": lengths, "rows": rows, "summary": summary,
                   "warmed_after_ready_s": warmed_s}, text, args.json, args.markdown)


if __name__ == "__main__":
    main()
