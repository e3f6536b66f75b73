"""The HTTP front's request-body decoder: msgspec's JSON decoder against the standard library's.

Both arms do the front's whole job on a body that is accepted (front/body.py): decode, then
the nesting check (MAX_DEPTH). Arm `msgspec` is front/body.py's decode_json as shipped; arm
`stdlib` is json.loads on the same bytes followed by the same nesting check (what the front
did before, through starlette's request.json(), plus the check). Bodies, each a real shape:

  chat_small   a one-turn chat request (~200 bytes)
  chat_tools   a chat with 8 tools (JSON Schemas) and 12 turns (~20 KB)
  prompt_1mb   a completion with a 1 MB ASCII prompt
  prompt_cjk   a completion with ~340 K CJK characters, escaped as \\uXXXX (~2 MB; Python's
               json.dumps default, as older clients send)
  tokens_100k  a completion whose prompt is 100,000 token ids

Arms alternate inside each round (the order reversed every round), each timing a batch of
decodes; per body: the median time a decode per arm over the rounds, its spread (min-max of
the rounds), and the ratio stdlib / msgspec. Two more arms time the decoders alone (no
nesting check), to show what the check costs.

    PYTHONPATH=$PWD .venv/bin/python bench/json_body_decode.py --rounds 7 \\
        --json bench/results/json_body_decode_cpu.json --md bench/results/json_body_decode_cpu.md
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import msgspec

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from front.body import MAX_DEPTH, _too_deep, decode_json  # noqa: E402


def stdlib_decode(raw: bytes):
    value = json.loads(raw)
    if _too_deep(value, MAX_DEPTH):
        raise ValueError("too deep")
    return value


# The two decoders alone (no nesting check), to show what the check costs.
ARMS = {"msgspec": decode_json, "stdlib": stdlib_decode, "msgspec_alone": msgspec.json.decode, "stdlib_alone": json.loads}


def bodies() -> dict[str, bytes]:
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city, by day.",
                                             "parameters": {"type": "object", "properties": {
                                                 "city": {"type": "string", "description": "the city"},
                                                 "days": {"type": "integer", "minimum": 1, "maximum": 14},
                                                 "units": {"type": "string", "enum": ["metric", "imperial"]},
                                                 "where": {"type": "object", "properties": {
                                                     "lat": {"type": "number"}, "lon": {"type": "number"}}}},
                                                 "required": ["city"]}}}
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"Turn {i}: " + "words and more words " * 60}
             for i in range(12)]
    cjk = "".join(chr(0x4E00 + (i * 7919) % 20000) for i in range(340_000))
    return {
        "chat_small": json.dumps({"model": "m", "messages": [{"role": "user", "content": "Name three rivers."}],
                                  "max_tokens": 64, "temperature": 0}).encode(),
        "chat_tools": json.dumps({"model": "m", "messages": turns,
                                  "tools": [{**tool, "function": {**tool["function"], "name": f"tool_{i}"}}
                                            for i in range(8)], "tool_choice": "auto", "max_tokens": 64}).encode(),
        "prompt_1mb": json.dumps({"model": "m", "prompt": "lorem ipsum dolor sit amet " * 38_837,
                                  "max_tokens": 16}).encode(),
        "prompt_cjk": json.dumps({"model": "m", "prompt": cjk, "max_tokens": 16}).encode(),
        "tokens_100k": json.dumps({"model": "m", "prompt": [(i * 31) % 150_000 for i in range(100_000)],
                                   "max_tokens": 16}).encode(),
    }


def time_batch(fn, raw: bytes, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn(raw)
    return (time.perf_counter() - t0) / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--budget-s", type=float, default=0.3, help="time a batch of decodes takes, about")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--md", type=Path)
    args = ap.parse_args()
    results = {}
    for name, raw in bodies().items():
        assert ARMS["msgspec"](raw) == ARMS["stdlib"](raw), name  # the same value from both
        one = time_batch(ARMS["stdlib"], raw, 1)
        n = max(1, int(args.budget_s / max(one, 1e-7)))
        per_round: dict[str, list[float]] = {arm: [] for arm in ARMS}
        for r in range(args.rounds):
            order = list(ARMS) if r % 2 == 0 else list(reversed(ARMS))
            for arm in order:
                per_round[arm].append(time_batch(ARMS[arm], raw, n))
        med = {arm: statistics.median(v) for arm, v in per_round.items()}
        results[name] = {"bytes": len(raw), "decodes_per_batch": n,
                         **{f"{arm}_us": round(med[arm] * 1e6, 2) for arm in ARMS},
                         **{f"{arm}_spread_us": [round(min(v) * 1e6, 2), round(max(v) * 1e6, 2)]
                            for arm, v in per_round.items()},
                         "stdlib_over_msgspec": round(med["stdlib"] / med["msgspec"], 2)}
        print(f"{name:12s} {len(raw):>9d} B  msgspec {med['msgspec'] * 1e6:10.1f} us  stdlib {med['stdlib'] * 1e6:10.1f} us"
              f"  stdlib/msgspec {med['stdlib'] / med['msgspec']:.2f}x   (decoders alone: msgspec "
              f"{med['msgspec_alone'] * 1e6:.1f} us, stdlib {med['stdlib_alone'] * 1e6:.1f} us)", flush=True)
    meta = {"argv": sys.argv, "python": sys.version.split()[0], "msgspec": msgspec.__version__,
            "machine": platform.machine(), "rounds": args.rounds}
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    if args.md:
        lines = ["| body | bytes | msgspec (us, median [min-max]) | stdlib (us) | stdlib / msgspec | decoders alone: msgspec / stdlib (us) |",
                 "|---|---|---|---|---|---|"]
        for name, r in results.items():
            lines.append(f"| {name} | {r['bytes']:,} | {r['msgspec_us']:,} [{r['msgspec_spread_us'][0]:,}-"
                         f"{r['msgspec_spread_us'][1]:,}] | {r['stdlib_us']:,} [{r['stdlib_spread_us'][0]:,}-"
                         f"{r['stdlib_spread_us'][1]:,}] | {r['stdlib_over_msgspec']}x | {r['msgspec_alone_us']:,} / "
                         f"{r['stdlib_alone_us']:,} |")
        args.md.write_text(f"# Request-body decode: msgspec vs the standard library\n\n`{' '.join(sys.argv)}` "
                           f"(Python {meta['python']}, msgspec {meta['msgspec']}, {meta['machine']}, {args.rounds} "
                           "rounds, arms alternating)\n\n" + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
