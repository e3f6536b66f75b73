"""The first council round after start-up against the later rounds, from council_http.py's
JSON files (issue 46's goal: first round >= 0.9x the later rounds' aggregate tok/s, TTFT p95
<= 1.5x steady), one row per file and arm, as a table and JSON.

    python3 bench/first_round_ratio.py bench/results/h100_2026-12-06g/call41/*.json --json out.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def rows(path: Path) -> list[dict]:
    data = json.loads(path.read_text())
    out = []
    for first in data.get("first_round", []):
        later = data["arms"].get(first["arm"])
        if not later:
            continue
        tok, p95 = later["tok_s"]["median"], later["ttft_p95"]["median"]
        out.append({"file": str(path), "arm": first["arm"], "first_tok_s": round(first["tok_s"], 1),
                    "later_tok_s": round(tok, 1), "tok_ratio": round(first["tok_s"] / tok, 2),
                    "first_ttft_p95_ms": round(first["ttft_p95"] * 1000), "later_ttft_p95_ms": round(p95 * 1000),
                    "ttft_p95_ratio": round(first["ttft_p95"] / p95, 2), "config": data["command"]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    table = [r for f in args.files for r in rows(f)]
    print("| file | arm | first round tok/s | later rounds tok/s (median) | ratio | first TTFT p95 ms | later p95 ms | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {Path(r['file']).parent.name}/{Path(r['file']).name} | {r['arm']} | {r['first_tok_s']} | {r['later_tok_s']} | "
              f"{r['tok_ratio']}x | {r['first_ttft_p95_ms']} | {r['later_ttft_p95_ms']} | {r['ttft_p95_ratio']}x |")
    if args.json:
        args.json.write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
