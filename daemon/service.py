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
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence, TextIO
from urllib.parse import quote
from xml.sax.saxutils import escape as xml_escape

from .exits import EXIT_CONFIG, EXIT_FAILED, EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE

LABEL = "com.councild.daemon"
UNIT_NAME = "councild.service"
SERVICE = "councild"

# Exit statuses (daemon/exits.py): 1 a service-manager command failed or `status` found
# nothing installed; 69 --now without systemctl/launchctl; 78 --now without the config file.

RETRY_DELAY_S = 1.0

_SOURCE_ROOT = Path(__file__).resolve().parent.parent
_RECORD_KEY = "councild-install-record:"
_MEMORY_RE = re.compile(r"^(infinity|\d+(\.\d+)?[KMGTPE]?|\d+(\.\d+)?%)$")


class ServiceError(Exception):
    """A refusal with a message for the user and the exit status to leave with."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


def template_dir() -> Path:
    override = os.environ.get("COUNCILD_TEMPLATE_DIR")
    return Path(override) if override else _SOURCE_ROOT / "systemd-launchd"


def kind_for(platform: str) -> str:
    if platform == "darwin":
        return "launchd"
    if platform.startswith("linux"):
        return "systemd"
    raise ServiceError(f"unsupported platform {platform!r}: pass --platform linux or --platform darwin", EXIT_USAGE)


@dataclass(frozen=True)
class ServicePaths:
    """Everything a rendered unit or plist depends on, all absolute."""

    platform: str  # "linux" | "darwin"
    home: Path
    python: Path  # the venv's interpreter, symlink kept (resolving it would leave the venv)
    config: Path
    working_dir: Path
    log_dir: Path  # launchd: where stdout/stderr go; systemd: the journal (this is LogsDirectory)
    runtime_dir: str  # launchd: pinned absolute folder; systemd: "%t/councild"
    hf_home: Path
    path_env: str
    docs: Path | None = None
    config_home: Path | None = None  # $XDG_CONFIG_HOME (systemd looks there for user units)
    memory_high: str | None = None
    memory_max: str | None = None
    sandbox: bool = True

    @property
    def kind(self) -> str:
        return kind_for(self.platform)

    @property
    def unit_dir(self) -> Path:
        return self.unit_path.parent

    @property
    def unit_path(self) -> Path:
        if self.kind == "launchd":
            return self.home / "Library" / "LaunchAgents" / f"{LABEL}.plist"
        return (self.config_home or self.home / ".config") / "systemd" / "user" / UNIT_NAME

    def dirs_for_install(self) -> list[Path]:
        """Folders that must exist for the service to start (launchd does not create the
        log folder before opening StandardOutPath)."""
        dirs = [self.unit_dir]
        if self.kind == "launchd":
            dirs.append(self.log_dir)
        return dirs


def _expand(value: str, home: Path) -> Path:
    if value == "~" or value.startswith("~/"):
        value = str(home) + value[1:]
    return Path(os.path.abspath(value))


def _default_working_dir(home: Path) -> Path:
    # `-m daemon.cli` finds the package through the working directory when it is run from
    # a source checkout that is not pip-installed; an installed package does not care.
    if _SOURCE_ROOT.name in ("site-packages", "dist-packages"):
        return home
    return _SOURCE_ROOT


def resolve_paths(
    platform: str,
    env: Mapping[str, str],
    *,
    config: str | None = None,
    python: str | None = None,
    runtime_dir: str | None = None,
    memory_high: str | None = None,
    memory_max: str | None = None,
    sandbox: bool = True,
) -> ServicePaths:
    kind = kind_for(platform)
    platform = "darwin" if kind == "launchd" else "linux"
    home = Path(env.get("HOME") or Path.home())
    xdg_config = env.get("XDG_CONFIG_HOME") or str(home / ".config")
    xdg_cache = env.get("XDG_CACHE_HOME") or str(home / ".cache")
    xdg_state = env.get("XDG_STATE_HOME") or str(home / ".local" / "state")

    py = _expand(python, home) if python else Path(os.path.abspath(sys.executable))
    cfg = _expand(config, home) if config else Path(xdg_config) / "councild" / "config.toml"
    hf_home = _expand(env["HF_HOME"], home) if env.get("HF_HOME") else Path(xdg_cache) / "huggingface"
    docs = _SOURCE_ROOT / "docs" / "OPERATIONS.md"

    for flag, value in (("--memory-high", memory_high), ("--memory-max", memory_max)):
        if value is None:
            continue
        if kind == "launchd":
            raise ServiceError(
                f"{flag} applies to systemd only: launchd has no memory limit for agents "
                "(the governor follows the system's memory pressure instead)",
                EXIT_USAGE,
            )
        if not _MEMORY_RE.match(value):
            raise ServiceError(
                f"{flag} {value!r}: expected bytes with an optional K/M/G/T suffix (24G), "
                "a percentage of RAM (75%), or 'infinity'",
                EXIT_USAGE,
            )

    if kind == "launchd":
        if runtime_dir:
            rt = str(_expand(runtime_dir, home))
        elif env.get("COUNCILD_RUNTIME_DIR"):
            rt = str(_expand(env["COUNCILD_RUNTIME_DIR"], home))
        else:
            # What protocol.paths.runtime_dir() computes in the user's shell: clients and
            # the daemon must agree, and launchd gives agents a different TMPDIR.
            tmp = next((env[k] for k in ("TMPDIR", "TEMP", "TMP") if env.get(k)), "/tmp")
            rt = str(Path(os.path.abspath(tmp)) / f"councild-{os.getuid()}")
        log_dir = home / "Library" / "Logs" / "councild"
        path_env = ":".join(
            [str(py.parent), "/opt/homebrew/bin", "/usr/local/bin", "/usr/bin", "/bin", "/usr/sbin", "/sbin"]
        )
    else:
        if runtime_dir:
            raise ServiceError(
                "--runtime-dir applies to launchd only: under systemd the socket lives in "
                "$XDG_RUNTIME_DIR/councild, which systemd creates (RuntimeDirectory=)",
                EXIT_USAGE,
            )
        rt = "%t/councild"
        log_dir = Path(xdg_state) / "log" / "councild"
        path_env = ":".join([str(py.parent), "/usr/local/bin", "/usr/bin", "/bin"])

    paths = ServicePaths(
        platform=platform,
        home=home,
        python=py,
        config=cfg,
        working_dir=_default_working_dir(home),
        log_dir=log_dir,
        runtime_dir=rt,
        hf_home=hf_home,
        path_env=path_env,
        docs=docs if docs.exists() else None,
        config_home=Path(xdg_config),
        memory_high=memory_high,
        memory_max=memory_max,
        sandbox=sandbox,
    )
    return paths


# -- rendering ---------------------------------------------------------------------------


def _check_value(value: str) -> str:
    if "\n" in value or "\r" in value or "\0" in value:
        raise ServiceError(f"refusing a path with a newline or NUL in it: {value!r}", EXIT_USAGE)
    return value


def _sd_word(value: str) -> str:
    """One word of an ExecStart=/ReadWritePaths= line: % and $ escaped, quoted if needed."""
    value = _check_value(value).replace("%", "%%").replace("$", "$$")
    if re.search(r"[\s\"'\\;]", value):
        value = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return value


def _sd_setting(value: str) -> str:
    """A whole-line value (WorkingDirectory=): only specifiers need escaping."""
    return _check_value(value).replace("%", "%%")


def _sd_env(key: str, value: str) -> str:
    assignment = f"{key}={_check_value(value).replace('%', '%%')}"
    if re.search(r"[\s\"\\]", assignment):
        assignment = '"' + assignment.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return assignment


def _header(kind: str, record: Sequence[str] | None) -> str:
    note = "Generated by `councild service install`; edit the template and reinstall instead."
    if record is None:
        note = "Rendered by `councild service print`; `councild service install` writes this."
        rec = ""
    else:
        payload = json.dumps({"created_dirs": list(record)}, separators=(", ", ": "))
        rec = f"{_RECORD_KEY} {payload}"
    if kind == "launchd":
        lines = [f"<!-- {note} -->"]
        if rec:
            # "--" may not appear inside an XML comment; JSON reads the escape back.
            lines.append("<!-- " + rec.replace("--", "-\\u002d") + " -->")
    else:
        lines = [f"# {note}"] + ([f"# {rec}"] if rec else [])
    return "\n".join(lines)


def render(kind: str, paths: ServicePaths, *, record: Sequence[str] | None = None) -> str:
    """The unit ("systemd") or plist ("launchd") for `paths`.

    `record` lists folders an install created (kept in the installed file so uninstall
    can remove exactly those); None renders what `print` shows.
    """
    if kind not in ("systemd", "launchd"):
        raise ValueError(f"kind must be 'systemd' or 'launchd', not {kind!r}")
    if kind == "launchd":
        text = (template_dir() / "councild.plist.in").read_text()
        values = {
            "LABEL": LABEL,
            "PYTHON": str(paths.python),
            "CONFIG": str(paths.config),
            "WORKING_DIR": str(paths.working_dir),
            "LOG_DIR": str(paths.log_dir),
            "PATH": paths.path_env,
            "RUNTIME_DIR": paths.runtime_dir,
            "HF_HOME": str(paths.hf_home),
        }
        values = {k: xml_escape(_check_value(v)) for k, v in values.items()}
        values["HEADER"] = _header(kind, record)
    else:
        text = (template_dir() / "councild.service.in").read_text()
        if not paths.sandbox:
            text = re.sub(
                r"^# @SANDBOX-BEGIN@.*?^# @SANDBOX-END@\n",
                "# Sandboxing (ProtectSystem=strict, ReadWritePaths=) left out: installed with --no-sandbox.\n",
                text,
                flags=re.S | re.M,
            )
        else:
            text = re.sub(r"^# @SANDBOX-BEGIN@ ", "# ", text, flags=re.M)
            text = re.sub(r"^# @SANDBOX-END@\n", "", text, flags=re.M)
        values = {
            "HEADER": _header(kind, record),
            "DOCUMENTATION": (
                f"Documentation=file://{quote(str(paths.docs))}"
                if paths.docs
                else "# Documentation: docs/OPERATIONS.md in the councild source"
            ),
            "PYTHON": _sd_word(str(paths.python)),
            "CONFIG": _sd_word(str(paths.config)),
            "WORKING_DIR": _sd_setting(str(paths.working_dir)),
            "HF_HOME": _sd_setting(str(paths.hf_home)),
            "MEMORY_HIGH": f"MemoryHigh={paths.memory_high}" if paths.memory_high else "#MemoryHigh=24G",
            "MEMORY_MAX": f"MemoryMax={paths.memory_max}" if paths.memory_max else "#MemoryMax=28G",
        }
        # Whole assignments where quoting may be needed.
        text = text.replace("Environment=HF_HOME=@HF_HOME@", "Environment=" + _sd_env("HF_HOME", str(paths.hf_home)))
        text = text.replace("Environment=PATH=@PATH@", "Environment=" + _sd_env("PATH", paths.path_env))
        text = text.replace("ReadWritePaths=-@HF_HOME@", "ReadWritePaths=" + _sd_word("-" + str(paths.hf_home)))
    for key, value in values.items():
        text = text.replace(f"@{key}@", value)
    left = re.findall(r"@[A-Z_]+@", text)
    if left:
        raise ServiceError(f"template placeholders left unfilled: {sorted(set(left))}")
    return text


def _read_record(content: str) -> list[str]:
    for line in content.splitlines():
        if _RECORD_KEY in line:
            raw = line.split(_RECORD_KEY, 1)[1].strip()
            raw = raw.removesuffix("-->").strip()
            try:
                return list(json.loads(raw).get("created_dirs", []))
            except (ValueError, AttributeError):
                return []
    return []


_HEADER_MARKS = ("Generated by `councild service install`", "Rendered by `councild service print`", _RECORD_KEY)


def _without_record(content: str) -> str:
    """The content minus the header lines that differ between print and install."""
    return "\n".join(line for line in content.splitlines() if not any(m in line for m in _HEADER_MARKS))


# -- service-manager commands ------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    argv: list[str]
    may_fail: bool = False  # e.g. reset-failed on a unit that never failed
    # launchctl bootstrap right after a bootout can fail ("5: Input/output error") while
    # the old instance is still on its way out; retry a few times, a second apart.
    retries: int = 0

    def __str__(self) -> str:
        return shlex.join(self.argv)


class Context:
    def __init__(self, env: Mapping[str, str], out: TextIO, err: TextIO) -> None:
        self.env = env
        self.out = out
        self.err = err

    def say(self, text: str = "") -> None:
        print(text, file=self.out)

    def warn(self, text: str) -> None:
        print(f"councild service: warning: {text}", file=self.err)

    def which(self, tool: str) -> str | None:
        return shutil.which(tool, path=self.env.get("PATH", os.defpath))

    def run(self, step: Step, tool_path: str, *, quiet: bool = False, timeout: float = 120) -> subprocess.CompletedProcess:
        argv = [tool_path, *step.argv[1:]]
        if not quiet:
            self.say(f"$ {step}")
        try:
            proc = subprocess.run(argv, env=dict(self.env), capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise ServiceError(f"`{step}` did not finish within {timeout:.0f} s") from None
        if not quiet:
            for stream in (proc.stdout, proc.stderr):
                if stream.strip():
                    self.say(stream.rstrip())
        return proc


def _tool(kind: str) -> str:
    return "launchctl" if kind == "launchd" else "systemctl"


def _require_tool(ctx: Context, kind: str, what: str) -> str:
    tool = _tool(kind)
    found = ctx.which(tool)
    if not found:
        manager = "launchd (macOS)" if kind == "launchd" else "systemd (Linux)"
        raise ServiceError(
            f"--now needs `{tool}`, which is not on PATH, so the {manager} service cannot be "
            f"{what} here. Nothing was changed. Run without --now to only write or remove "
            "the file, or pass the --platform that matches this machine.",
            EXIT_UNAVAILABLE,
        )
    return found


def _domain() -> str:
    return f"gui/{os.getuid()}"


def _run_steps(ctx: Context, tool_path: str, steps: Sequence[Step]) -> None:
    for step in steps:
        proc = ctx.run(step, tool_path)
        for _ in range(step.retries):
            if proc.returncode == 0:
                break
            time.sleep(RETRY_DELAY_S)
            proc = ctx.run(step, tool_path)
        if proc.returncode != 0 and not step.may_fail:
            message = f"`{step}` failed with status {proc.returncode}"
            if "bus" in (proc.stderr or "").lower():
                message += (
                    " (no user manager reachable: `systemctl --user` needs a login session; "
                    "under su/sudo/ssh set XDG_RUNTIME_DIR=/run/user/$UID, or run "
                    "`loginctl enable-linger $USER` once)"
                )
            raise ServiceError(message)


def _launchd_loaded(ctx: Context, tool_path: str) -> bool:
    step = Step(["launchctl", "print", f"{_domain()}/{LABEL}"])
    return ctx.run(step, tool_path, quiet=True).returncode == 0


# -- filesystem helpers ------------------------------------------------------------------


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
            f"  launchctl bootstrap {_domain()} {shlex.quote(str(paths.unit_path))}",
        ]
        if changed:
            lines.append(
                f"If it was already loaded, reload it: launchctl bootout {_domain()}/{LABEL} && "
                f"launchctl bootstrap {_domain()} {shlex.quote(str(paths.unit_path))}"
            )
        lines.append(f"To restart it: launchctl kickstart -k {_domain()}/{LABEL}")
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
    tool_path = _require_tool(ctx, kind, "started") if args.now else None
    if args.now and not paths.config.exists():
        raise ServiceError(
            f"config file {paths.config} does not exist; the daemon would exit 78 (EX_CONFIG) "
            "at once. Create it (an empty file means all defaults) or pass --config PATH. "
            "Nothing was changed.",
            EXIT_CONFIG,
        )
    target = paths.unit_path
    existing = target.read_text() if target.exists() else None
    prior = _read_record(existing) if existing is not None else []
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
        loaded = _launchd_loaded(ctx, tool_path)
        plist = str(target)
        if loaded and changed:
            steps = [
                Step(["launchctl", "bootout", f"{_domain()}/{LABEL}"]),
                Step(["launchctl", "bootstrap", _domain(), plist], retries=10),
            ]
        elif loaded:
            steps = [Step(["launchctl", "kickstart", f"{_domain()}/{LABEL}"])]
        else:
            steps = [
                Step(["launchctl", "enable", f"{_domain()}/{LABEL}"]),
                Step(["launchctl", "bootstrap", _domain(), plist]),
            ]
    try:
        _run_steps(ctx, tool_path, steps)
    except ServiceError as exc:
        raise ServiceError(f"{exc}. {target} is installed; start it by hand once that is fixed") from None
    ctx.say(f"{SERVICE} started; `councild service status` shows it")
    return EXIT_OK


def cmd_uninstall(args: argparse.Namespace, ctx: Context) -> int:
    paths = _paths_from_args(args, ctx.env)
    kind = paths.kind
    tool_path = _require_tool(ctx, kind, "stopped") if args.now else None
    target = paths.unit_path
    wants_link = target.parent / "default.target.wants" / UNIT_NAME
    installed = target.exists()
    record = _read_record(target.read_text()) if installed else []
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
        stop = [Step(["launchctl", "bootout", f"{_domain()}/{LABEL}"])]

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
        if kind == "launchd" and not _launchd_loaded(ctx, tool_path):
            ctx.say(f"{LABEL} is not loaded in {_domain()}; nothing to stop")
        else:
            try:
                _run_steps(ctx, tool_path, stop)
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
        _run_steps(ctx, tool_path, after)
        ctx.say(f"{SERVICE} stopped and uninstalled")
    else:
        ctx.say("If it is still running, stop it:")
        if kind == "systemd":
            ctx.say(f"  systemctl --user stop {SERVICE} && systemctl --user daemon-reload")
        else:
            ctx.say(f"  launchctl bootout {_domain()}/{LABEL}")
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
        current = _without_record(target.read_text())
        wanted = _without_record(render(kind, paths))
        if current == wanted:
            ctx.say("installed: yes, matches this installation")
        else:
            ctx.say(
                "installed: yes, but differs from what `councild service install` would write "
                "now (interpreter, config or options changed): reinstall to update it"
            )
    else:
        ctx.say("installed: no (`councild service install` writes it)")
    tool_path = ctx.which(_tool(kind))
    if not tool_path:
        ctx.say(f"{_tool(kind)} not on PATH: cannot ask the service manager")
    else:
        if kind == "systemd":
            step = Step(["systemctl", "--user", "status", "--no-pager", "--lines=5", UNIT_NAME])
        else:
            step = Step(["launchctl", "print", f"{_domain()}/{LABEL}"])
        proc = ctx.run(step, tool_path, quiet=True, timeout=30)
        ctx.say(f"$ {step}  (exit {proc.returncode})")
        text = (proc.stdout + proc.stderr).rstrip()
        if text:
            ctx.say(text)
    return EXIT_OK if installed else EXIT_FAILED


# -- command line ------------------------------------------------------------------------

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
    except OSError as exc:
        print(f"councild service: error: {exc}", file=ctx.err)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
