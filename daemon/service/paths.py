"""Where things are: the absolute paths a rendered unit or plist names, resolved once.

HOME and the rest of the environment come in as a mapping, so tests resolve into a
temporary home; nothing here touches the file system beyond asking what exists.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from ..exits import EXIT_USAGE
from .errors import ServiceError

LABEL = "com.councild.daemon"
UNIT_NAME = "councild.service"
SERVICE = "councild"

PACKAGE_DIR = Path(__file__).resolve().parent
# The folder that holds the `daemon` package: a source checkout, or site-packages.
INSTALL_ROOT = PACKAGE_DIR.parent.parent
# docs/OPERATIONS.md, shipped inside the package (a symlink in a checkout, a copy in a
# wheel); resolved, so a checkout's unit links the file under docs/ itself.
OPERATIONS_DOC = (PACKAGE_DIR / "OPERATIONS.md").resolve()
_MEMORY_RE = re.compile(r"^(infinity|\d+(\.\d+)?[KMGTPE]?|\d+(\.\d+)?%)$")


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
    if INSTALL_ROOT.name in ("site-packages", "dist-packages"):
        return home
    return INSTALL_ROOT


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
    docs = OPERATIONS_DOC

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
