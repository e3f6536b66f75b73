"""Real contention for governor tests and benchmarks: processes that burn CPU or hold memory.

Run as a separate process (never in the daemon's or the test's own process), so the kernel
sees real load and real resident pages:

    python bench/contention.py burn --seconds 30            # one busy-looping process
    python bench/contention.py hold --step-mb 256 --max-mb 3072 \
        --until-memavail-below 12000000000 --step-pause-s 0.1

``hold`` allocates in steps and touches every page (so the memory is really resident, not
just reserved), printing one JSON line per step on stdout; it stops growing at ``--max-mb``
or once MemAvailable is below ``--until-memavail-below`` bytes, prints ``{"holding": ...}``,
then holds the memory until stdin closes, it gets SIGTERM/SIGINT, or ``--hold-s`` passes.
The parent kills it in a ``finally``; memory goes back to the kernel when it exits.

``Contention`` (used by bench/governor_bench.py) starts and stops such processes on a
schedule of named regimes.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def memavailable_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


# ---------------------------------------------------------------- process bodies


def _burn(seconds: float | None) -> None:
    end = None if seconds is None else time.monotonic() + seconds
    x = 0
    while end is None or time.monotonic() < end:
        for _ in range(100_000):  # pure-Python busy loop: one core at 100%
            x = (x * 1103515245 + 12345) & 0x7FFFFFFF


def _hold(step_mb: int, max_mb: int, until_below: int | None, step_pause_s: float, hold_s: float | None) -> None:
    chunks: list[bytearray] = []
    step = step_mb << 20
    held = 0

    def emit(**kw) -> None:
        print(json.dumps(kw), flush=True)

    while held + step <= (max_mb << 20):
        if until_below is not None and memavailable_bytes() < until_below:
            break
        buf = bytearray(step)
        # Touch one byte per page: the kernel backs every page (bytearray(n) is calloc'd and
        # may be lazily zero-mapped otherwise).
        mv = memoryview(buf)
        mv[::PAGE] = b"\x01" * len(range(0, step, PAGE))
        chunks.append(buf)
        held += step
        emit(step_mb=step_mb, held_bytes=held, memavailable=memavailable_bytes())
        if step_pause_s:
            time.sleep(step_pause_s)
    emit(holding=held, memavailable=memavailable_bytes())
    # Hold until stdin closes (the parent's "release"), a signal, or hold_s.
    end = None if hold_s is None else time.monotonic() + hold_s
    while end is None or time.monotonic() < end:
        try:
            r, _, _ = select.select([sys.stdin], [], [], 0.2)
        except (OSError, ValueError):
            r = []
        if r and not sys.stdin.buffer.read1(4096):
            break
    chunks.clear()
    emit(released=held)


# ---------------------------------------------------------------- parent side


class Helper:
    """One contention process; ``stop()`` is idempotent and always reaps it."""

    def __init__(self, args: list[str]):
        self.proc = subprocess.Popen([sys.executable, str(HERE), *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def lines(self, timeout_s: float):
        """JSON lines from the helper's stdout until it says it is holding (or dies)."""
        deadline = time.monotonic() + timeout_s
        out = self.proc.stdout
        while time.monotonic() < deadline:
            r, _, _ = select.select([out], [], [], 0.2)
            if not r:
                if self.proc.poll() is not None:
                    return
                continue
            line = out.readline()
            if not line:
                return
            rec = json.loads(line)
            yield rec
            if "holding" in rec:
                return

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # the polite release
            except OSError:
                pass
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass


def burn(seconds: float | None = None) -> Helper:
    return Helper(["burn"] + ([] if seconds is None else ["--seconds", str(seconds)]))


def hold(mb: int, step_mb: int = 128) -> Helper:
    """Hold ``mb`` MiB (touched) until stopped; waits until it is all resident."""
    h = Helper(["hold", "--step-mb", str(step_mb), "--max-mb", str(mb), "--step-pause-s", "0"])
    for _ in h.lines(timeout_s=60):
        pass
    return h


# Regimes: what runs beside the daemon. 2 cores on the benchmark machine: "busy" takes one
# of them outright and a second intermittently is left to "mixed".
REGIMES = {
    "quiet": {"burners": 0, "hold_mb": 0},
    "busy": {"burners": 2, "hold_mb": 0},
    "mixed": {"burners": 1, "hold_mb": 1024},
}


class Contention:
    """Start and stop the helpers of one regime (context manager)."""

    def __init__(self, regime: str):
        self.regime = regime
        self.spec = REGIMES[regime]
        self.helpers: list[Helper] = []

    def __enter__(self) -> "Contention":
        try:
            if self.spec["hold_mb"]:
                self.helpers.append(hold(self.spec["hold_mb"]))
            for _ in range(self.spec["burners"]):
                self.helpers.append(burn())
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for h in self.helpers:
            h.stop()
        self.helpers.clear()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("burn", help="busy-loop one core")
    b.add_argument("--seconds", type=float, default=None, help="stop after this long (default: until killed)")
    h = sub.add_parser("hold", help="allocate, touch and hold memory")
    h.add_argument("--step-mb", type=int, default=256, help="allocation step in MiB (default 256)")
    h.add_argument("--max-mb", type=int, default=1024, help="never hold more than this many MiB (default 1024)")
    h.add_argument("--until-memavail-below", type=int, default=None,
                   help="stop growing once MemAvailable (bytes) is below this")
    h.add_argument("--step-pause-s", type=float, default=0.05, help="pause between steps (default 0.05)")
    h.add_argument("--hold-s", type=float, default=None, help="release after this long (default: until stdin closes)")
    a = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if a.cmd == "burn":
        _burn(a.seconds)
    else:
        _hold(a.step_mb, a.max_mb, a.until_memavail_below, a.step_pause_s, a.hold_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
