"""One probe arm in a fresh Python process: MLX reads its process switches (environment
variables) once, so a probe that compares settings runs each in its own child. The child is
the probe script itself with ``--child``; it prints one line ``RESULT <json>``."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_child(script: str, argv: list[str], env: dict) -> dict:
    """The child's result, or {"error", "returncode"} (and the reason printed) when it failed."""
    p = subprocess.run([sys.executable, script, "--child", *argv], env=env, capture_output=True, text=True, cwd=REPO)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode or not lines:
        tail = (p.stderr or p.stdout)[-2000:]
        print(f"child failed rc={p.returncode}\n{tail}", flush=True)
        return {"error": tail, "returncode": p.returncode}
    return json.loads(lines[-1][len("RESULT "):])


def parse_or_answer(ap: argparse.ArgumentParser, child: Callable[[argparse.Namespace], dict]) -> argparse.Namespace | None:
    """The probe's arguments, with ``--json`` and the hidden ``--child`` added; in the child,
    print ``child(args)``'s RESULT line and return None (the caller then returns)."""
    ap.add_argument("--json", type=Path)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return None
    return args
