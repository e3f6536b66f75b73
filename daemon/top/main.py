"""`councild top`: the live view of a running daemon, or one plain frame.

    councild top                 # full screen, refreshed every second; q quits
    councild top --once          # one plain frame (also whenever stdout is not a terminal)

Reads only the status reply, over the same socket as `councild status`. The live screen
needs the ``top`` extra (textual); the plain frame needs only rich, which textual brings.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time

import msgspec

from protocol.client import Client, CouncilError

from ..exits import EXIT_FAILED, EXIT_USAGE
from .view import TopView

try:  # rich comes with the top extra (textual): without it, top says which extra to install
    from rich.console import Console

    from .panels import frame
except ImportError as exc:
    Console = None
    _missing = str(exc)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="councild top",
        description="A live view of a running daemon: seats, batch height and depth by height, the MTP head, "
                    "memory and pressure (with a short history), the engine step and the governor's latest "
                    "decisions. Keys: s sort seats, p pause, enter expand a seat or decision, escape close, q quit. "
                    "When stdout is not a terminal (or with --once) it prints one plain frame and exits "
                    "(exit 1 when no daemon answers).")
    ap.add_argument("--endpoint", help="daemon endpoint (default: $COUNCILD_ENDPOINT or the per-user ipc socket)")
    ap.add_argument("--once", action="store_true", help="print one plain frame and exit")
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    ap.add_argument("--timeout", type=float, default=2.0,
                    help="seconds to wait for a status reply before showing the daemon as unreachable (default 2)")
    return ap


def print_frame(endpoint: str | None, timeout: float) -> int:
    try:
        with Client(endpoint, seat="top", timeout_s=timeout, client_name="councild top") as client:
            reply = msgspec.to_builtins(client.status())
    except CouncilError as exc:
        print(f"councild: {exc}", file=sys.stderr)
        return EXIT_FAILED
    view = TopView()
    view.update(reply, time.monotonic())
    width = shutil.get_terminal_size((120, 40)).columns
    Console(width=width, highlight=False, soft_wrap=False).print(frame(view))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.interval <= 0 or args.timeout <= 0:
        print("councild top: --interval and --timeout must be positive", file=sys.stderr)
        return EXIT_USAGE
    # textual draws on stderr and reads stdin: all three must be the terminal for the live view.
    live = not args.once and all(s.isatty() for s in (sys.stdin, sys.stdout, sys.stderr))
    if Console is None:
        print(f"councild top needs the top extra (pip install 'councild[top]'): {_missing}", file=sys.stderr)
        return EXIT_USAGE
    try:
        if not live:
            return print_frame(args.endpoint, args.timeout)
        try:  # textual only for the live screen: a frame into a pipe does not pay its import
            from .app import TopApp
        except ImportError as exc:  # the top extra is not installed: say so, and show what we can
            print(f"councild top: the live view needs the top extra (pip install 'councild[top]'): {exc}; "
                  "one plain frame follows", file=sys.stderr)
            return print_frame(args.endpoint, args.timeout)
        client = Client(args.endpoint, seat="top", timeout_s=args.timeout, client_name="councild top")
        app = TopApp(client, interval=args.interval)
        app.run()
        # The poller closes its socket before the process goes (a wait in flight ends within --timeout).
        app.poller.stopping.set()
        app.poller.join(args.timeout + 1.0)
        return app.return_code or 0
    except ValueError as exc:  # a malformed endpoint (the client checks it before connecting)
        print(f"councild: {exc}", file=sys.stderr)
        return EXIT_USAGE
