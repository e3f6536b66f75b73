"""One daemon log (JSON lines) on one clock: the start-up parts' ends, the governor's
decisions and each request's end, seconds from the log's first line.

    python bench/daemon_timeline.py DAEMON.log [--until SECONDS] [--per-round N]

``--per-round N``: instead, a table a round of N requests (a council's seats x turns; arms
run one after another, so a round of each arm is a block): its requests' TTFT, prompt
tokens prefilled and forwards, and the medians of its slow iterations (``engine.slow_iteration``,
logged at ``log_slow_iteration_s``) that only prefilled a whole chunk and that only decoded:
round 0 against the rounds after it, shape for shape.

What it is for: reading why a fresh start's first council round ran slower than the next
(bench/first_round_ab.py keeps every run's daemon log under its work folder). Per request:
its seat, prompt tokens, tokens resumed from the prefix cache, prefill forwards, TTFT,
tokens per second, and its speculation's cycles and accepted drafts ("-" for serial).
"""

from __future__ import annotations

import argparse
import json
import statistics
from datetime import datetime
from pathlib import Path


def _seconds(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def lines(path: Path, until: float | None = None) -> list[str]:
    out, t0 = [], None
    for raw in path.read_text().splitlines():
        try:
            e = json.loads(raw)
        except ValueError:
            continue
        if "timestamp" not in e:
            continue
        t = _seconds(e["timestamp"])
        t0 = t if t0 is None else t0
        at = t - t0
        if until is not None and at > until:
            break
        ev = e.get("event", "")
        if ev == "engine.warm":
            out.append(f"{at:7.2f}  warm {e.get('part')}: switched in {e.get('switched_in')}, busy {e.get('busy_ms')} ms")
        elif ev == "governor.decision":
            out.append(f"{at:7.2f}  governor: {e.get('sentence', '')}")
        elif ev == "request.accepted":
            out.append(f"{at:7.2f}  accepted {e.get('seat')} ({e.get('prompt_tokens')} tokens)")
        elif ev == "request.done":
            spec = e.get("speculation") or {}
            cycles = "-" if not spec else f"{spec.get('mode')} {spec.get('cycles')} cycles, {spec.get('accepted')} accepted"
            out.append(f"{at:7.2f}  done {e.get('seat')}: {e.get('prompt_tokens')} tokens, resumed at "
                       f"{e.get('cached_tokens')}, {e.get('prefill_forwards')} forwards, TTFT {e.get('ttft_s')} s, "
                       f"{e.get('tokens_per_s')} tok/s, {cycles}")
        elif ev == "engine.slow_iteration":  # at log_slow_iteration_s: where a long iteration's time went
            phases = " ".join(f"{k} {v * 1000:.0f}" for k, v in (e.get("phases") or {}).items())
            out.append(f"{at:7.2f}  slow iteration {e.get('seconds', 0) * 1000:.0f} ms ({phases} ms): "
                       f"{e.get('decode')} rows {e.get('rows')} depth {e.get('depth')} positions {e.get('positions')}, "
                       f"prefilled {e.get('prefilled')}, started {e.get('started')}")
        elif ev == "prefix_cache.continuation":
            out.append(f"{at:7.2f}  continuation {e.get('seat')}: {e.get('tokens')} tokens, head {e.get('head')}, "
                       f"exact {e.get('exact')}")
    return out


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def rounds(path: Path, per_round: int) -> list[str]:
    """The ``--per-round`` table: a round is the requests from its first acceptance to the
    next round's; its slow iterations are those logged while it ran."""
    events = []
    for raw in path.read_text().splitlines():
        try:
            events.append(json.loads(raw))
        except ValueError:
            continue
    chunk = max((e.get("prefilled") or 0 for e in events if e.get("event") == "engine.slow_iteration"), default=0)
    accepted, rows = 0, []
    for e in events:
        ev = e.get("event")
        if ev == "request.accepted":
            accepted += 1
        r = max(0, accepted - 1) // per_round
        if ev not in ("request.done", "engine.slow_iteration") or (ev == "engine.slow_iteration" and not accepted):
            continue
        while len(rows) <= r:
            rows.append({"ttft": [], "prefilled": 0, "forwards": 0, "chunk_s": [], "decode_s": []})
        row = rows[r]
        if ev == "request.done":
            row["ttft"].append(e.get("ttft_s") or 0.0)
            row["prefilled"] += (e.get("prompt_tokens") or 0) - (e.get("cached_tokens") or 0)
            row["forwards"] += e.get("prefill_forwards") or 0
        elif not e.get("rows") and chunk and e.get("prefilled") == chunk:
            row["chunk_s"].append(e.get("seconds") or 0.0)
        elif e.get("rows") and not e.get("prefilled"):
            row["decode_s"].append(e.get("seconds") or 0.0)
    out = [f"| round | requests | TTFT p50 / p95 / max ms | prompt tokens prefilled | forwards | "
           f"slow {f'{chunk}-token' if chunk else 'whole-chunk'} prefills: n, median ms | slow decode-only: n, median ms |", "|---|---|---|---|---|---|---|"]
    for i, row in enumerate(rows):
        t = sorted(row["ttft"])
        p95 = t[min(len(t) - 1, int(len(t) * 0.95))] if t else None
        out.append(f"| {i} | {len(t)} | {_ms(_median(t))} / {_ms(p95)} / {_ms(t[-1] if t else None)} | {row['prefilled']} | "
                   f"{row['forwards']} | {len(row['chunk_s'])}, {_ms(_median(row['chunk_s']))} | "
                   f"{len(row['decode_s'])}, {_ms(_median(row['decode_s']))} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log", type=Path)
    ap.add_argument("--until", type=float, help="stop at this many seconds from the first line")
    ap.add_argument("--per-round", type=int, metavar="N",
                    help="a table a round of N requests (seats x turns) instead of the timeline")
    args = ap.parse_args()
    if args.per_round is not None and args.per_round < 1:
        ap.error("--per-round wants a positive number of requests")
    print("\n".join(rounds(args.log, args.per_round) if args.per_round else lines(args.log, args.until)))


if __name__ == "__main__":
    main()
