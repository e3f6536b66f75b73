"""`councild governor replay`: run the policy over a recorded or synthetic trace.

    councild governor replay TRACE.jsonl
    councild governor replay TRACE.jsonl --config '{"warn_evict_s": 10}' --timeline what-if.html
    python -m governor.replay_cli --synthetic critical

Prints the decision timeline as a table (replay.py). With ``--timeline FILE`` it also draws
the picture `councild governor timeline` draws for a trace, with the replay as a second lane
beside what the daemon did (the trace replayed with its own config and overrides), so "what
would auto have done" (``--without-overrides``) or "what would these thresholds have done"
(``--config``) is seen against what happened.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .config import GovernorConfig, config_option
from .replay import format_table, replay
from .timeline import write_picture
from .timeline_data import Timeline, read_timeline, trace_lane


def _without_overrides(lines: list[str]) -> list[str]:
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None  # replay names the bad line
        if not (isinstance(rec, dict) and rec.get("kind") == "override"):
            out.append(line)
    return out


def replay_timeline(lines: list[str], cfg: GovernorConfig | None = None, *, without_overrides: bool = False,
                    simulate_head: bool | None = None) -> Timeline:
    """The trace's timeline (what the daemon did) with the replay as a second lane."""
    timeline = read_timeline(lines)
    kept = _without_overrides(lines) if without_overrides else lines
    what = " ".join(w for w, on in (("with --config", cfg is not None), ("without overrides", without_overrides)) if on)
    recs = [{**r, "t": r["t"] - timeline.t0} for r in map(json.loads, filter(str.strip, kept))]
    timeline.lanes.append(trace_lane(recs, cfg, f"replayed {what}".strip(), simulate_head=simulate_head))
    return timeline


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="councild governor replay", description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("trace", nargs="?", help="a JSON-lines trace recorded by the governor")
    src.add_argument("--synthetic", metavar="NAME", help="generate a synthetic trace: quiet, busy, flapping, critical, council")
    ap.add_argument("--config", metavar="JSON", help="governor config table as JSON (default: the trace's own)")
    ap.add_argument("--all", action="store_true", help="one row per tick, not only ticks that acted")
    ap.add_argument("--simulate-head", action="store_true", default=None,
                    help="apply the replay's own loads/evictions (default: only with --config or --without-overrides)")
    ap.add_argument("--without-overrides", action="store_true",
                    help="leave out the operator's pins and forced loads/evictions: what auto would have done")
    ap.add_argument("--save", metavar="PATH", help="with --synthetic: also write the generated trace here")
    ap.add_argument("--timeline", metavar="FILE.html",
                    help="also draw the replay beside what the daemon did (the timeline extra: plotly)")
    args = ap.parse_args(argv)
    try:
        cfg = config_option(args.config)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    if args.synthetic:
        from .traces import SCENARIOS, generate  # the simulator is needed only for a synthetic trace

        if args.synthetic not in SCENARIOS:
            print(f"unknown scenario {args.synthetic!r}; choose from {', '.join(SCENARIOS)}", file=sys.stderr)
            return 2
        lines: Any = generate(args.synthetic)
        if args.save:
            with open(args.save, "w", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")
    else:
        try:
            with open(args.trace, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except OSError as e:
            print(f"cannot replay: {e}", file=sys.stderr)
            return 1
    simulate = args.simulate_head if args.simulate_head is not None else (True if args.without_overrides else None)
    kept = _without_overrides(lines) if args.without_overrides else list(lines)
    try:
        rows = replay(kept, cfg, all_ticks=args.all, simulate_head=simulate)
    except (OSError, ValueError) as e:
        print(f"cannot replay: {e}", file=sys.stderr)
        return 1
    print(format_table(rows))
    if args.timeline:
        what = " ".join(w for w, on in (("with --config", cfg is not None),
                                        ("without overrides", args.without_overrides)) if on)
        timeline = replay_timeline(lines, cfg, without_overrides=args.without_overrides, simulate_head=simulate)
        return write_picture(timeline, args.timeline, f"the governor replayed {what}".strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
