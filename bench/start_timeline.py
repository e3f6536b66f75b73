"""Where a daemon's start goes: every start-up log event's offset from the process start,
for a start that must compile MLX's kernels (an empty PTX folder) and then one that finds
them (the same folder), then the first requests' latency (the first use of the shapes the
warm-up did not run). The goal "start to ready <= 30 s on a fresh GPU" is read from it.

    PYTHONPATH=$PWD python3 bench/start_timeline.py --json $OUT/start_timeline.json [--config 'warmup = "light"']
    PYTHONPATH=$PWD python3 bench/start_timeline.py --prebuild-ab --json $OUT/start_prebuild.json

Each start is `councild serve` on the bundled model with its own cache folder (no cached
probe verdicts) and MLX_PTX_CACHE_DIR set to one folder shared by the starts of this run
(``--ptx``, emptied first). ``--prebuild-ab``: first a start into an empty folder of its own
with ``kernel_prebuild = "off"`` (MLX compiles each module at first use, one at a time), then
the default's (the workers compile them side by side, engine/jit/prebuild.py) and a start
finding them. A module the workers gave is listed with "prebuild" (their manifest says which),
one of the daemon's custom kernels with "custom" (engine/kernels/custom_kernel_cache.py).
``--custom-ab ROUNDS``: then ROUNDS pairs of starts finding MLX's modules, the first with
``custom_kernel_cache = false`` on a copy of the folder without the custom kernels' files
(MLX compiles them in the process, as before), the second reading them from the folder.

    PYTHONPATH=$PWD python3 bench/start_timeline.py --custom-ab 2 --json $OUT/start_custom.json

``--fresh-only``: only the start into the empty folder (bench/device/prebuild_ab_call.sh runs it
per tree, alternated)."""

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

from daemon.engine.jit.prebuild import read_manifest  # noqa: E402
from daemon.paths import BUNDLED_MODEL  # noqa: E402
from e2e_harness import start_daemon, wait_ready  # noqa: E402
from protocol.client import Client  # noqa: E402

PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main(argv):\n", "class Council:\n    def __init__(self):\n"]


def _ts(e: dict) -> float:
    return datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()


def one_start(label: str, ptx: Path, config: str) -> dict:
    ptx.mkdir(parents=True, exist_ok=True)
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
                                                        if k in ("seconds", "probe_ms", "verdict", "stages", "mode", "kernels", "state",
                                                                  "waited_s", "ran", "modules", "workers")})
                  for e in d.events() if "timestamp" in e and not e["event"].startswith(("library", "model.load_progress"))]
        prebuilt = [e for e in d.events() if e.get("event") == "kernels.prebuilt"]
    finally:
        d.stop()
    # The modules MLX compiled during this start (it writes each beside its source in the PTX
    # folder): when each was written, from the process start, and what it is.
    by_workers = {Path(m).stem for ms in read_manifest(ptx).values() for m in ms}
    modules = sorted((round(f.stat().st_mtime - t0, 3), f.stem, f.stat().st_size,
                      "prebuild" if f.stem in by_workers else "custom" if f.stem.startswith("custom_kernel_") else "daemon")
               for f in ptx.rglob("*.ptx")
                     if f.stat().st_mtime >= t0)  # fmt: skip
    own = [m for m in modules if m[3] == "daemon"]
    print(f"\n{label}: ready in {ready_s:.1f} s; first requests (serial, fast, 4 at once) {firsts} s; "
          f"{len(modules)} modules compiled ({sum(1 for m in modules if m[0] <= ready_s)} before ready), "
          f"{len(own)} by the daemon itself ({sum(1 for m in own if m[0] <= ready_s)} before ready), "
          f"{sum(1 for m in modules if m[3] == 'custom')} of its custom kernels written")
    for off, name, _size, who in own:
        print(f"  daemon compiled {name[:90]} at {off:.1f} s")
    if prebuilt:
        print(f"  prebuild: {json.dumps({k: v for k, v in prebuilt[0].items() if k not in ('timestamp', 'level', 'logger')})}")
    for off, name, extra in events:
        if off <= ready_s + 1:
            print(f"  {off:8.3f}  {name}  {json.dumps(extra) if extra else ''}")
    shutil.rmtree(tmp, ignore_errors=True)
    return {"label": label, "ready_s": round(ready_s, 2), "first_requests_s": firsts, "events": events,
            "compiled_modules": modules, "prebuild": prebuilt[0] if prebuilt else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ptx", type=Path, default=Path(tempfile.gettempdir()) / "start-timeline-ptx")
    ap.add_argument("--config", default="", help="TOML for the daemon's config")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--prebuild-ab", action="store_true", help="a start without the kernel prebuild first, into a folder of its own")
    ap.add_argument("--fresh-only", action="store_true", help="only the start into the empty PTX folder")
    ap.add_argument("--custom-ab", type=int, default=0, metavar="ROUNDS",
                    help="then ROUNDS pairs of starts with the PTX found: custom_kernel_cache = false, then true")
    args = ap.parse_args()
    shutil.rmtree(args.ptx, ignore_errors=True)
    runs = []
    if args.prebuild_ab:
        alone = args.ptx.with_name(args.ptx.name + "-no-prebuild")
        shutil.rmtree(alone, ignore_errors=True)
        runs.append(one_start("compiling, kernel_prebuild off (empty PTX folder)", alone,
                              'kernel_prebuild = "off"\n' + args.config))
    runs.append(one_start("compiling (empty PTX folder)", args.ptx, args.config))
    if not args.fresh_only:
        runs.append(one_start("PTX found", args.ptx, args.config))
    for _ in range(args.custom_ab):
        # MLX reads a custom kernel's file whoever wrote it: the "off" start gets a copy of the
        # folder without them (MLX's modules only), as a daemon before the cache found it.
        bare = args.ptx.with_name(args.ptx.name + "-no-custom")
        shutil.rmtree(bare, ignore_errors=True)
        shutil.copytree(args.ptx, bare, ignore=shutil.ignore_patterns("custom_kernel_*"))
        runs += [one_start("PTX found, custom_kernel_cache off (no custom files)", bare,
                           "custom_kernel_cache = false\n" + args.config),
                 one_start("PTX found, custom kernels read", args.ptx, args.config)]
    if args.json:
        import mlx.core as mx

        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"mlx": mx.__version__, "device": str(mx.default_device()),
                                         "config": args.config, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
