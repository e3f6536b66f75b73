"""Where a daemon's start goes: every start-up log event's offset from the process start,
for a start that must compile MLX's kernels (an empty PTX folder) and then one that finds
them (the same folder), then the first requests' latency (the first use of the shapes the
warm-up did not run). The goal "start to ready <= 30 s on a fresh GPU" is read from it.

    PYTHONPATH=$PWD python3 bench/start_timeline.py --json $OUT/start_timeline.json [--config 'warmup = "light"']

Each start is `councild serve` on the bundled model with its own cache folder (no cached
probe verdicts) and MLX_PTX_CACHE_DIR set to one folder shared by the starts of this run
(``--ptx``, emptied first)."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "e2e")]

from daemon.paths import BUNDLED_MODEL  # noqa: E402
from e2e_harness import start_daemon, wait_ready  # noqa: E402
from protocol.client import Client  # noqa: E402

PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main(argv):\n", "class Council:\n    def __init__(self):\n"]


def _ts(e: dict) -> float:
    return datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()


def one_start(label: str, ptx: Path, config: str) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="start-timeline-"))
    t0 = time.time()
    d = start_daemon(tmp, BUNDLED_MODEL, config=config, env={"MLX_PTX_CACHE_DIR": str(ptx)}, wait=False)
    try:
        wait_ready(d, 600)
        ready_s = time.time() - t0
        firsts = []
        with Client(d.endpoint, seat="timeline", timeout_s=300) as c:
            for i, p in enumerate(PROMPTS):  # serial, then fast, then four at once
                t = time.time()
                if i < 2:
                    c.complete(p * (3 + 17 * i), max_tokens=16, speculation="off" if i == 0 else "fast")
                else:
                    for s in [c.generate(p + f"# {j}\n" * (j + 1), max_tokens=16, speculation="fast") for j in range(4)]:
                        s.result()
                firsts.append(round(time.time() - t, 3))
        events = [(round(_ts(e) - t0, 3), e["event"], {k: v for k, v in e.items()
                                                        if k in ("seconds", "probe_ms", "verdict", "stages", "mode", "kernels")})
                  for e in d.events() if "timestamp" in e and not e["event"].startswith(("library", "model.load_progress"))]
    finally:
        d.stop()
    # The modules MLX compiled during this start (it writes each beside its source in the PTX
    # folder): when each was written, from the process start, and what it is.
    modules = sorted((round(f.stat().st_mtime - t0, 3), f.stem, f.stat().st_size) for f in ptx.glob("*.ptx")
                     if f.stat().st_mtime >= t0)  # fmt: skip
    print(f"\n{label}: ready in {ready_s:.1f} s; first requests (serial, fast, 4 at once) {firsts} s; "
          f"{len(modules)} modules compiled ({sum(1 for m in modules if m[0] <= ready_s)} before ready)")
    for off, name, extra in events:
        if off <= ready_s + 1:
            print(f"  {off:8.3f}  {name}  {json.dumps(extra) if extra else ''}")
    shutil.rmtree(tmp, ignore_errors=True)
    return {"label": label, "ready_s": round(ready_s, 2), "first_requests_s": firsts, "events": events,
            "compiled_modules": modules}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ptx", type=Path, default=Path(tempfile.gettempdir()) / "start-timeline-ptx")
    ap.add_argument("--config", default="", help="TOML for the daemon's config")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    shutil.rmtree(args.ptx, ignore_errors=True)
    runs = [one_start("compiling (empty PTX folder)", args.ptx, args.config),
            one_start("PTX found", args.ptx, args.config)]
    if args.json:
        import mlx.core as mx

        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"mlx": mx.__version__, "device": str(mx.default_device()),
                                         "config": args.config, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
