"""What every benchmark and gate shares: how a sample is summarised and where results go."""

from __future__ import annotations

import json
import statistics
from pathlib import Path


def spread(values: list[float]) -> dict:
    """Median, range, inter-quartile range and count: a ratio is only as good as its spread."""
    s = sorted(values)
    q = statistics.quantiles(s, n=4) if len(s) >= 2 else [s[0]] * 3
    return {"median": statistics.median(s), "min": s[0], "max": s[-1], "iqr": q[2] - q[0], "n": len(s)}


def write_results(result: dict, markdown: str, json_path: str | None, markdown_path: str | None) -> None:
    """Write the JSON and the markdown table where asked (folders created)."""
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=2, default=str))
    if markdown_path:
        Path(markdown_path).parent.mkdir(parents=True, exist_ok=True)
        Path(markdown_path).write_text(markdown + "\n")
