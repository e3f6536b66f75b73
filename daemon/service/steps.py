"""Running systemctl / launchctl: a Step is one command line, a Context carries the
environment and the output streams, and run_steps stops at the first failure that matters."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass
from typing import Mapping, Sequence, TextIO

from ..exits import EXIT_UNAVAILABLE
from .errors import ServiceError
from .paths import LABEL

RETRY_DELAY_S = 1.0


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


def tool_name(kind: str) -> str:
    return "launchctl" if kind == "launchd" else "systemctl"


def require_tool(ctx: Context, kind: str, what: str) -> str:
    tool = tool_name(kind)
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


def domain() -> str:
    return f"gui/{os.getuid()}"


def run_steps(ctx: Context, tool_path: str, steps: Sequence[Step]) -> None:
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


def launchd_loaded(ctx: Context, tool_path: str) -> bool:
    step = Step(["launchctl", "print", f"{domain()}/{LABEL}"])
    return ctx.run(step, tool_path, quiet=True).returncode == 0
