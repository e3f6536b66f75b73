"""Compare governor_eval.py runs: per profile, the worst council regime and every solo regime,
auto / oracle (median over the run's seeds), one column per run.

    python bench/governor_eval_compare.py before=bench/results/X.json after=bench/results/Y.json

Prints a markdown table per view (worst council regime; each solo regime; the least solo
regime). Reads only the JSON the replay wrote; runs nothing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def ratios(path: Path) -> dict[str, dict[str, float]]:
    data = json.loads(path.read_text())
    return {r["profile"]: {g: row["auto"] / row["oracle"] for g, row in r["per_regime"].items() if row["oracle"]}
            for r in data["results"]}  # fmt: skip


def table(runs: list[tuple[str, dict]], title: str, pick) -> list[str]:
    names = [n for n, _ in runs]
    lines = [f"| {title} | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for prof in runs[0][1]:
        cells = []
        for _, rs in runs:
            g, v = pick(rs[prof]) if prof in rs else ("-", float("nan"))
            cells.append(f"{v:.3f} ({g})" if g else f"{v:.3f}")
        lines.append(f"| {prof} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str]) -> int:
    runs = []
    for arg in argv:
        name, _, path = arg.partition("=")
        runs.append((name, ratios(Path(path))))
    council = lambda rs: min(((g, v) for g, v in rs.items() if g.startswith("council")), key=lambda t: t[1])  # noqa: E731
    solo = lambda rs: min(((g, v) for g, v in rs.items() if not g.startswith("council")), key=lambda t: t[1])  # noqa: E731
    out = table(runs, "worst council regime", council) + [""] + table(runs, "least solo regime", solo)
    regimes = [g for g in next(iter(runs[0][1].values())) if not g.startswith("council")]
    for g in regimes:
        out += [""] + table(runs, g, lambda rs, g=g: ("", rs[g]))
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
