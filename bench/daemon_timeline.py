"""One daemon log (JSON lines) on one clock: the start-up parts' ends, the governor's
decisions and each request's end, seconds from the log's first line.

    python bench/daemon_timeline.py DAEMON.log [--until SECONDS]

What it is for: reading why a fresh start's first council round ran slower than the next
(bench/first_round_ab.py keeps every run's daemon log under its work folder). Per request:
its seat, prompt tokens, tokens resumed from the prefix cache, prefill forwards, TTFT,
tokens per second, and its speculation's cycles and accepted drafts ("-" for serial).
"""

from __future__ import annotations

import argparse
import json
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log", type=Path)
    ap.add_argument("--until", type=float, help="stop at this many seconds from the first line")
    args = ap.parse_args()
    print("\n".join(lines(args.log, args.until)))


if __name__ == "__main__":
    main()
