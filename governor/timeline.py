"""`councild governor timeline LOG_OR_TRACE -o FILE.html`: the governor's day as a picture.

Reads a daemon's JSON log or a governor trace (timeline_data.py), draws it (timeline_plot.py)
into one self-contained HTML file, and prints one line saying what it drew; a line that could
not be read, a cut-off last line or a log without governor decisions still gives a picture,
and one more line on stderr (``note: ...``) says what was missing. Needs the ``timeline``
extra (plotly).
"""

from __future__ import annotations

import argparse
import sys

from .config import config_option
from .timeline_data import Timeline, read_timeline

try:  # the optional extra: without it the command says which one to install
    from . import timeline_plot
except ImportError as exc:
    timeline_plot = None
    _missing = str(exc)


def _span(tl: Timeline) -> str:
    if tl.span is None:
        return "no time span"
    s = int(tl.span[1] - tl.span[0])
    return f"{s // 3600}h {s % 3600 // 60:02d}m {s % 60:02d}s" if s >= 3600 else f"{s // 60}m {s % 60:02d}s"


def write_picture(tl: Timeline, path: str, title: str = "") -> int:
    """Draw ``tl`` into ``path``; one line on stdout, the notes as one line on stderr."""
    if timeline_plot is None:
        print(f"councild governor timeline needs the timeline extra (pip install 'councild[timeline]'): {_missing}",
              file=sys.stderr)
        return 2
    if not path.endswith((".html", ".htm")):
        print(f"{path}: the picture is written as HTML (plotly, self-contained): name it .html", file=sys.stderr)
        return 2
    try:
        timeline_plot.write(tl, path, title)
    except OSError as e:
        print(f"cannot write {path}: {e}", file=sys.stderr)
        return 1
    counts = ", ".join(f"{lane.name}: {len(lane.decisions)} decisions" for lane in tl.lanes) or "no decisions"
    heads = {k: sum(1 for _, kind, _ in tl.head_events if kind == k) for k in ("loaded", "evicted")}
    print(f"wrote {path}: {counts}; head loaded {heads['loaded']}x, evicted {heads['evicted']}x; "
          f"{_span(tl)} of a {tl.source}")
    if tl.notes:
        print(f"note: {tl.note()}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="councild governor timeline", description=__doc__.split("\n\n")[0])
    ap.add_argument("source", metavar="LOG_OR_TRACE", help="a daemon's JSON log (--log-format json) or a governor trace")
    ap.add_argument("-o", "--output", required=True, metavar="FILE.html", help="where to write the picture")
    ap.add_argument("--title", default="", help="the picture's title (default: the governor)")
    ap.add_argument("--config", metavar="JSON", help="for a trace: replay with this governor config table instead of its own")
    args = ap.parse_args(argv)
    try:
        cfg = config_option(args.config)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    try:
        tl = read_timeline(args.source, cfg)
    except OSError as e:
        print(f"cannot read {args.source}: {e}", file=sys.stderr)
        return 1
    return write_picture(tl, args.output, args.title)


if __name__ == "__main__":
    sys.exit(main())
