"""The four subcommands: install, uninstall, print, status."""

from __future__ import annotations

import argparse
import difflib
import os
import shlex
import subprocess
from pathlib import Path
from typing import Mapping

from ..exits import EXIT_CONFIG, EXIT_FAILED, EXIT_OK
from .errors import ServiceError
from .paths import LABEL, SERVICE, UNIT_NAME, ServicePaths, resolve_paths
from .render import read_record, render, without_record
from .steps import Context, Step, domain, launchd_loaded, require_tool, run_steps, tool_name


def _missing_ancestors(path: Path) -> list[Path]:
    """`path` and its ancestors that do not exist yet, outermost first."""
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    return list(reversed(missing))


def _write_atomic(path: Path, content: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(content)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


# -- subcommands -------------------------------------------------------------------------


def _paths_from_args(args: argparse.Namespace, env: Mapping[str, str]) -> ServicePaths:
    return resolve_paths(
        args.platform,
        env,
        config=args.config,
        python=args.python,
        runtime_dir=getattr(args, "runtime_dir", None),
        memory_high=getattr(args, "memory_high", None),
        memory_max=getattr(args, "memory_max", None),
        sandbox=not getattr(args, "no_sandbox", False),
    )


def _start_hint(paths: ServicePaths, changed: bool) -> list[str]:
    if paths.kind == "systemd":
        lines = [
            "To start it now and at every login:",
            f"  systemctl --user daemon-reload && systemctl --user enable --now {SERVICE}",
        ]
        if changed:
            lines.append(f"If it was already running, apply the new file: systemctl --user restart {SERVICE}")
        lines.append("To keep it running after you log out: loginctl enable-linger $USER")
    else:
        lines = [
            "To start it now and at every login:",
            f"  launchctl bootstrap {domain()} {shlex.quote(str(paths.unit_path))}",
        ]
        if changed:
            lines.append(
                f"If it was already loaded, reload it: launchctl bootout {domain()}/{LABEL} && "
                f"launchctl bootstrap {domain()} {shlex.quote(str(paths.unit_path))}"
            )
        lines.append(f"To restart it: launchctl kickstart -k {domain()}/{LABEL}")
    return lines


def _check_importable(ctx: Context, paths: ServicePaths) -> None:
    if not paths.python.exists():
        ctx.warn(f"{paths.python} does not exist: the service will fail to start (pass --python)")
        return
    probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('daemon') else 1)"
    try:
        proc = subprocess.run(
            [str(paths.python), "-c", probe], cwd=paths.working_dir, capture_output=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        ctx.warn(f"could not run {paths.python}: {exc}")
        return
    if proc.returncode != 0:
        ctx.warn(
            f"{paths.python} cannot import the `daemon` package from {paths.working_dir}: "
            "the service will fail to start. Install councild into that environment "
            "(pip install -e .) or pass --python."
        )


def cmd_install(args: argparse.Namespace, ctx: Context) -> int:
    paths = _paths_from_args(args, ctx.env)
    kind = paths.kind
    tool_path = require_tool(ctx, kind, "started") if args.now else None
    if args.now and not paths.config.exists():
        raise ServiceError(
            f"config file {paths.config} does not exist; the daemon would exit 78 (EX_CONFIG) "
            "at once. Create it (an empty file means all defaults) or pass --config PATH. "
            "Nothing was changed.",
            EXIT_CONFIG,
        )
    target = paths.unit_path
    existing = target.read_text() if target.exists() else None
    prior = read_record(existing) if existing is not None else []
    to_create: list[Path] = []
    for d in paths.dirs_for_install():
        for p in _missing_ancestors(d):
            if p not in to_create:
                to_create.append(p)
    record = list(dict.fromkeys([*prior, *(str(p) for p in to_create)]))
    content = render(kind, paths, record=record)
    changed = content != existing

    if args.dry_run:
        for d in to_create:
            ctx.say(f"would create {d}")
        if existing is None:
            ctx.say(f"would write {target} (new); `councild service print` shows it")
        elif changed:
            ctx.say(f"would rewrite {target}:")
            ctx.out.writelines(
                difflib.unified_diff(
                    existing.splitlines(True), content.splitlines(True), str(target), str(target) + " (new)"
                )
            )
        else:
            ctx.say(f"{target} unchanged")
        ctx.say("\n".join(_start_hint(paths, changed)) if not args.now else "would run the commands above with --now")
        return EXIT_OK

    for d in to_create:
        d.mkdir(mode=0o755, exist_ok=True)
    if changed:
        _write_atomic(target, content)
        ctx.say(f"{'wrote' if existing is None else 'updated'} {target}")
    else:
        ctx.say(f"{target} unchanged")
    ctx.say(f"  runs: {paths.python} -m daemon.cli serve --config {paths.config}")
    ctx.say(f"  once, before its first start: {paths.python} -m daemon.cli prepare --config {paths.config} "
            "(pays the first start's checks now: docs/OPERATIONS.md)")
    if kind == "launchd":
        ctx.say(f"  logs: {paths.log_dir}/councild.err.log (JSON lines), socket folder {paths.runtime_dir}")
    else:
        ctx.say(f"  logs: journalctl --user -u {SERVICE} -o cat   socket folder $XDG_RUNTIME_DIR/councild")
    if not paths.config.exists():
        ctx.warn(
            f"config file {paths.config} does not exist: the daemon will exit 78 (EX_CONFIG) "
            "until it does (an empty file means all defaults)"
        )
    _check_importable(ctx, paths)

    if not args.now:
        ctx.say("\n".join(_start_hint(paths, changed)))
        return EXIT_OK

    assert tool_path is not None
    if kind == "systemd":
        steps = [Step(["systemctl", "--user", "daemon-reload"])]
        if changed:
            # Restarts it only if it was running; enable --now starts it otherwise.
            steps.append(Step(["systemctl", "--user", "try-restart", UNIT_NAME]))
        steps.append(Step(["systemctl", "--user", "enable", "--now", UNIT_NAME]))
    else:
        loaded = launchd_loaded(ctx, tool_path)
        plist = str(target)
        if loaded and changed:
            steps = [
                Step(["launchctl", "bootout", f"{domain()}/{LABEL}"]),
                Step(["launchctl", "bootstrap", domain(), plist], retries=10),
            ]
        elif loaded:
            steps = [Step(["launchctl", "kickstart", f"{domain()}/{LABEL}"])]
        else:
            steps = [
                Step(["launchctl", "enable", f"{domain()}/{LABEL}"]),
                Step(["launchctl", "bootstrap", domain(), plist]),
            ]
    try:
        run_steps(ctx, tool_path, steps)
    except ServiceError as exc:
        raise ServiceError(f"{exc}. {target} is installed; start it by hand once that is fixed") from None
    ctx.say(f"{SERVICE} started; `councild service status` shows it")
    return EXIT_OK


def cmd_uninstall(args: argparse.Namespace, ctx: Context) -> int:
    paths = _paths_from_args(args, ctx.env)
    kind = paths.kind
    tool_path = require_tool(ctx, kind, "stopped") if args.now else None
    target = paths.unit_path
    wants_link = target.parent / "default.target.wants" / UNIT_NAME
    installed = target.exists()
    record = read_record(target.read_text()) if installed else []
    if not installed and not wants_link.is_symlink():
        ctx.say(f"not installed: {target} does not exist; nothing to remove")
        return EXIT_OK

    stop: list[Step] = []
    after: list[Step] = []
    if kind == "systemd":
        stop = [Step(["systemctl", "--user", "disable", "--now", UNIT_NAME])]
        after = [
            Step(["systemctl", "--user", "daemon-reload"]),
            Step(["systemctl", "--user", "reset-failed", UNIT_NAME], may_fail=True),
        ]
    else:
        stop = [Step(["launchctl", "bootout", f"{domain()}/{LABEL}"])]

    if args.dry_run:
        if args.now:
            for step in stop:
                ctx.say(f"would run: {step}")
        ctx.say(f"would remove {target}")
        for d in sorted(record, key=len, reverse=True):
            ctx.say(f"would remove {d} if empty")
        for step in after if args.now else []:
            ctx.say(f"would run: {step}")
        return EXIT_OK

    if args.now:
        assert tool_path is not None
        if kind == "launchd" and not launchd_loaded(ctx, tool_path):
            ctx.say(f"{LABEL} is not loaded in {domain()}; nothing to stop")
        else:
            try:
                run_steps(ctx, tool_path, stop)
            except ServiceError as exc:
                raise ServiceError(f"{exc}; {target} was left in place so you can retry") from None

    removed: list[Path] = []
    if installed:
        target.unlink()
        removed.append(target)
    # A dangling enablement symlink would be the only trace left; systemctl disable
    # removes it, but not when the unit was removed without --now.
    if wants_link.is_symlink():
        wants_link.unlink()
        removed.append(wants_link)
        try:
            wants_link.parent.rmdir()
            removed.append(wants_link.parent)
        except OSError:
            pass
    kept: list[Path] = []
    for d in sorted((Path(p) for p in record), key=lambda p: len(p.parts), reverse=True):
        try:
            d.rmdir()
            removed.append(d)
        except FileNotFoundError:
            pass
        except OSError:
            kept.append(d)
    for p in removed:
        ctx.say(f"removed {p}")
    for d in kept:
        ctx.say(f"kept {d} (not empty{': it holds the logs' if d == paths.log_dir else ''})")

    if args.now:
        assert tool_path is not None
        run_steps(ctx, tool_path, after)
        ctx.say(f"{SERVICE} stopped and uninstalled")
    else:
        ctx.say("If it is still running, stop it:")
        if kind == "systemd":
            ctx.say(f"  systemctl --user stop {SERVICE} && systemctl --user daemon-reload")
        else:
            ctx.say(f"  launchctl bootout {domain()}/{LABEL}")
    return EXIT_OK


def cmd_print(args: argparse.Namespace, ctx: Context) -> int:
    paths = _paths_from_args(args, ctx.env)
    ctx.out.write(render(paths.kind, paths))
    return EXIT_OK


def cmd_status(args: argparse.Namespace, ctx: Context) -> int:
    paths = _paths_from_args(args, ctx.env)
    kind = paths.kind
    target = paths.unit_path
    installed = target.exists()
    ctx.say(f"service manager: {kind} ({'user unit' if kind == 'systemd' else 'LaunchAgent'} {SERVICE if kind == 'systemd' else LABEL})")
    ctx.say(f"file: {target}")
    if installed:
        current = without_record(target.read_text())
        wanted = without_record(render(kind, paths))
        if current == wanted:
            ctx.say("installed: yes, matches this installation")
        else:
            ctx.say(
                "installed: yes, but differs from what `councild service install` would write "
                "now (interpreter, config or options changed): reinstall to update it"
            )
    else:
        ctx.say("installed: no (`councild service install` writes it)")
    tool_path = ctx.which(tool_name(kind))
    if not tool_path:
        ctx.say(f"{tool_name(kind)} not on PATH: cannot ask the service manager")
    else:
        if kind == "systemd":
            step = Step(["systemctl", "--user", "status", "--no-pager", "--lines=5", UNIT_NAME])
        else:
            step = Step(["launchctl", "print", f"{domain()}/{LABEL}"])
        proc = ctx.run(step, tool_path, quiet=True, timeout=30)
        ctx.say(f"$ {step}  (exit {proc.returncode})")
        text = (proc.stdout + proc.stderr).rstrip()
        if text:
            ctx.say(text)
    return EXIT_OK if installed else EXIT_FAILED
