"""`councild service ...`: run councild as a per-user service under launchd or systemd.

Renders the templates in ``systemd-launchd/`` with the absolute paths of THIS installation
(the venv's interpreter, the config file, log and runtime folders) and installs them:

- Linux: a systemd user unit, ``~/.config/systemd/user/councild.service``
  (``$XDG_CONFIG_HOME/systemd/user`` when that is set).
- macOS: a launchd LaunchAgent, ``~/Library/LaunchAgents/com.councild.daemon.plist``.

Nothing is started unless ``--now`` is given; without it the exact commands are printed.
Installing twice writes the same bytes (and says "unchanged"); uninstall removes the file
and any folder install created that is empty again, so nothing is left behind.

HOME (``$HOME``) and the platform (``--platform``) are injectable so tests install into a
temporary home.

The package, in reading order: ``paths`` (every absolute path the file names, resolved
once), ``render`` (template + paths -> unit or plist text), ``steps`` (running systemctl /
launchctl), ``commands`` (install, uninstall, print, status); this file holds the command
line. ``templates/`` is the top-level systemd-launchd/ folder (a symlink in a checkout, a
copy in a wheel).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Mapping, Sequence, TextIO

from ..exits import EXIT_CONFIG, EXIT_FAILED, EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE
from .commands import cmd_install, cmd_print, cmd_status, cmd_uninstall
from .errors import ServiceError
from .paths import LABEL, SERVICE, UNIT_NAME, ServicePaths, kind_for, resolve_paths
from .render import render, template_dir, without_record
from .steps import Context

__all__ = [
    "EXIT_CONFIG", "EXIT_FAILED", "EXIT_OK", "EXIT_UNAVAILABLE", "EXIT_USAGE", "LABEL", "SERVICE", "UNIT_NAME",
    "ServiceError", "ServicePaths", "build_parser", "kind_for", "main", "render", "resolve_paths",
    "template_dir", "without_record",
]

_DESCRIPTION = """\
Run councild as a per-user background service that starts at login and restarts after a
crash (not after a clean stop, and under systemd not after a config error, exit 78).

  Linux   a systemd user unit   ~/.config/systemd/user/councild.service
  macOS   a launchd LaunchAgent ~/Library/LaunchAgents/com.councild.daemon.plist

The file runs THIS installation: `<this venv's python> -m daemon.cli serve --config PATH`,
with absolute paths. Nothing is started or stopped unless you pass --now; otherwise the
exact commands are printed for you to run.
"""

_EPILOG = """\
examples:
  councild service print                      show the unit/plist for this machine
  councild service install --config ~/.config/councild/config.toml --now
  councild service install --memory-high 24G --memory-max 28G    (systemd only)
  councild service status
  councild service uninstall --now

what --now runs:
  Linux  install:   systemctl --user daemon-reload [&& try-restart councild.service]
                    && systemctl --user enable --now councild.service
         uninstall: systemctl --user disable --now councild.service, then daemon-reload
  macOS  install:   launchctl enable gui/$UID/com.councild.daemon
                    && launchctl bootstrap gui/$UID ~/Library/LaunchAgents/com.councild.daemon.plist
                    (already loaded: bootout + bootstrap if the file changed, else kickstart)
         uninstall: launchctl bootout gui/$UID/com.councild.daemon

exit status: 0 done; 1 a service-manager command failed (or status: not installed);
2 bad flags; 69 --now but systemctl/launchctl is not on PATH; 78 --now but the config file
does not exist. Logs, exit codes of the daemon itself, troubleshooting: docs/OPERATIONS.md.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="councild service",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--platform",
        choices=["linux", "darwin"],
        default="darwin" if sys.platform == "darwin" else "linux" if sys.platform.startswith("linux") else sys.platform,
        help="which service manager to target: linux = systemd, darwin = launchd (default: this machine's)",
    )
    common.add_argument(
        "--user",
        action="store_true",
        default=True,
        help="per-user service (the default and only mode: no root, socket in your runtime folder)",
    )
    common.add_argument(
        "--config",
        metavar="PATH",
        help="config file the service starts with (default: $XDG_CONFIG_HOME/councild/config.toml, "
        "i.e. ~/.config/councild/config.toml); an empty file means all defaults",
    )
    common.add_argument(
        "--python",
        metavar="PATH",
        help="interpreter to run (default: the one running this command, i.e. this venv's)",
    )
    common.add_argument(
        "--runtime-dir",
        metavar="DIR",
        help="launchd only: folder for the ipc socket (default: $COUNCILD_RUNTIME_DIR, else "
        "$TMPDIR/councild-$UID, where clients look)",
    )
    common.add_argument(
        "--memory-high",
        metavar="SIZE",
        help="systemd only: MemoryHigh= for the service (e.g. 24G, 75%%): the kernel reclaims "
        "above it and the governor sheds speculation when it nears it",
    )
    common.add_argument(
        "--memory-max",
        metavar="SIZE",
        help="systemd only: MemoryMax= hard limit (OOM kill, then restart)",
    )
    common.add_argument(
        "--no-sandbox",
        action="store_true",
        help="systemd only: leave out ProtectSystem=strict/ReadWritePaths= (for kernels "
        "without unprivileged user namespaces, where the start fails with 226/NAMESPACE)",
    )
    sub = parser.add_subparsers(dest="command", metavar="{install,uninstall,print,status}", required=True)

    install = sub.add_parser(
        "install",
        parents=[common],
        help="write the unit/plist for this installation (start it with --now)",
        description="Write ~/.config/systemd/user/councild.service (Linux) or "
        "~/Library/LaunchAgents/com.councild.daemon.plist (macOS) with this installation's "
        "absolute paths; on macOS also create ~/Library/Logs/councild. Installing again "
        "with the same options changes nothing and says so. Without --now, prints the "
        "commands that start it.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    install.add_argument(
        "--now",
        action="store_true",
        help="also load and start it: systemctl --user daemon-reload && systemctl --user enable "
        "--now councild (Linux); launchctl bootstrap gui/$UID PLIST (macOS). Fails with 69 "
        "before writing anything if the tool is missing",
    )
    install.add_argument("--dry-run", action="store_true", help="say what would be written (with a diff) and change nothing")
    install.set_defaults(func=cmd_install)

    uninstall = sub.add_parser(
        "uninstall",
        parents=[common],
        help="remove the unit/plist (stop and disable it first with --now)",
        description="Remove the installed unit/plist, its enablement link, and the folders "
        "install created if they are empty again. Logs are kept. Without --now the service "
        "is not stopped: the command to do so is printed.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    uninstall.add_argument(
        "--now",
        action="store_true",
        help="first stop and disable it: systemctl --user disable --now councild (Linux); "
        "launchctl bootout gui/$UID/com.councild.daemon (macOS)",
    )
    uninstall.add_argument("--dry-run", action="store_true", help="say what would be removed and change nothing")
    uninstall.set_defaults(func=cmd_uninstall)

    printer = sub.add_parser(
        "print",
        parents=[common],
        help="write the rendered unit/plist to stdout (writes no file)",
        description="Render the unit (--platform linux) or plist (--platform darwin) with this "
        "installation's paths to stdout; nothing is written.",
    )
    printer.set_defaults(func=cmd_print)

    status = sub.add_parser(
        "status",
        parents=[common],
        help="is it installed, where, up to date, and what the service manager says",
        description="Report whether the unit/plist is installed, its path, whether it matches "
        "what install would write now, and (when the tool exists) `systemctl --user status "
        "councild` or `launchctl print gui/$UID/com.councild.daemon`. Exit 0 if installed, "
        "1 if not.",
    )
    status.set_defaults(func=cmd_status)
    return parser


def main(
    argv: Sequence[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """Entry point for `councild service ...` (argv excludes the word "service")."""
    ctx = Context(os.environ if env is None else env, stdout or sys.stdout, stderr or sys.stderr)
    parser = build_parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:  # --help (0) or a usage error (2)
        return int(exc.code or 0)
    try:
        return args.func(args, ctx)
    except ServiceError as exc:
        print(f"councild service: error: {exc}", file=ctx.err)
        return exc.code
    except BrokenPipeError:
        # `councild service print | head -3`: the reader left. Say nothing more, as cat would;
        # stdout goes to /dev/null so the flush at exit does not raise again.
        if ctx.out is sys.stdout:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILED
    except OSError as exc:
        print(f"councild service: error: {exc}", file=ctx.err)
        return EXIT_FAILED


