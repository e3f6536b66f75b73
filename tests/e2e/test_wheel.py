"""The wheel, as a user gets it: built from pyproject.toml (`pip wheel --no-deps`), installed
into a fresh venv outside the source tree, and run from a folder outside it.

The venv borrows the dependencies already installed beside this interpreter through a .pth
line (no download, no second mlx), but holds its own copy of councild: what is not in the
wheel is not there. Every check also proves the code ran from that copy, from what it
printed (paths under the venv), not from the source tree.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from protocol.readiness import wait_until_answering

REPO = Path(__file__).resolve().parents[2]
# Files the daemon reads at run time besides its modules; each must be a plain file in the wheel.
RUNTIME_FILES = [
    "daemon/service/templates/councild.service.in",
    "daemon/service/templates/councild.plist.in",
    "daemon/service/OPERATIONS.md",
    "daemon/measure/fidelity_prompts.json",
    "daemon/measure/quoting_prompts.json",
    "daemon/assets/tiny-qwen35/config.json",
    "daemon/assets/tiny-qwen35/model.safetensors",
    "daemon/assets/tiny-qwen35/tokenizer.json",
    "protocol/PROTOCOL.md",
]


def _git_listed(*pathspec: str) -> list[str]:
    out = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard",
                          *pathspec], capture_output=True, check=True).stdout.decode()
    return [rel for rel in out.split("\0") if rel]


@dataclass
class Installed:
    venv: Path
    site: Path  # the venv's site-packages, where the wheel put councild
    wheel: Path
    home: Path
    cwd: Path  # a folder outside the source tree to run from

    @property
    def councild(self) -> Path:
        return self.venv / "bin" / "councild"

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "COUNCILD_", "VIRTUAL_ENV"))}
        return {**env, "HOME": str(self.home), "PYTHONUNBUFFERED": "1", **extra}

    def run(self, *args: str, timeout: float = 240, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.councild), *args], cwd=self.cwd, env=self.env(**env),
                              capture_output=True, text=True, timeout=timeout)


def _copy_source(dst: Path) -> None:
    """What a fresh clone holds (tracked files plus new ones git does not ignore), with the
    working tree's edits: the build then writes its build/ and egg-info into the copy."""
    for rel in _git_listed():
        src, out = REPO / rel, dst / rel
        if not os.path.lexists(src):  # deleted in the working tree, not yet staged
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            out.symlink_to(os.readlink(src))
        else:
            shutil.copy2(src, out)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.fail("the wheel test builds from the files git lists; run it from a git checkout")
    import setuptools  # the build runs without isolation (no download): it needs bdist_wheel

    if tuple(int(x) for x in setuptools.__version__.split(".")[:2]) < (70, 1):
        pytest.fail(f"setuptools {setuptools.__version__} cannot build a wheel by itself: "
                    "make venv (the test extra lists setuptools>=70.1)")
    tmp = tmp_path_factory.mktemp("wheel")
    src, dist, venv = tmp / "src", tmp / "dist", tmp / "venv"
    _copy_source(src)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(dist), str(src)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (wheel,) = dist.glob("councild-*.whl")

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    # The dependencies: this interpreter's site-packages, appended after the venv's own. A .pth
    # line only adds the folder; the .pth files inside it (this checkout's editable install)
    # are not run, so the source tree stays off the path.
    borrowed = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (site / "borrowed-deps.pth").write_text("".join(f"{p}\n" for p in borrowed))
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
                              "--no-deps", "--no-index", "-q", str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]

    home, cwd = tmp / "home", tmp / "elsewhere"
    home.mkdir()
    cwd.mkdir()
    return Installed(venv=venv, site=site, wheel=wheel, home=home, cwd=cwd)


def test_the_wheel_carries_every_file_read_at_run_time(installed):
    with zipfile.ZipFile(installed.wheel) as zf:
        infos = {i.filename: i for i in zf.infolist()}
    for name in RUNTIME_FILES:
        assert name in infos, f"{name} is not in {installed.wheel.name}"
        mode = infos[name].external_attr >> 16
        assert not (mode and (mode & 0o170000) == 0o120000), f"{name} is stored as a symlink"
        assert infos[name].file_size > 0, name
    for name in RUNTIME_FILES:
        path = installed.site / name
        assert path.is_file() and not path.is_symlink(), path
    # Nor may a data file added to daemon/ later be left behind (a symlinked folder counts by
    # its files).
    for rel in _git_listed("daemon"):
        path = REPO / rel
        if not path.exists():  # deleted in the working tree, not yet staged
            continue
        names = [f"{rel}/{f.name}" for f in path.iterdir() if f.is_file()] if path.is_dir() else [rel]
        for name in names:
            assert name.endswith(".py") or name in infos, f"{name} is in daemon/ but not in the wheel"
    template = (installed.site / "daemon/service/templates/councild.service.in").read_text()
    assert template == (REPO / "systemd-launchd" / "councild.service.in").read_text()
    # The installed code is what the venv imports, from any folder.
    proc = subprocess.run([str(installed.venv / "bin" / "python"), "-c", "import daemon, protocol, governor, sys;"
                           "print(daemon.__file__, protocol.__file__, governor.__file__, sep='\\n')"],
                          cwd=installed.cwd, env=installed.env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for line in proc.stdout.split():
        assert Path(line).is_relative_to(installed.site), line


def test_service_print_renders_from_the_installed_copy(installed):
    for platform in ("linux", "darwin"):
        proc = installed.run("service", "print", "--platform", platform)
        assert proc.returncode == 0, proc.stderr
        assert "@" + "PYTHON@" not in proc.stdout
        assert str(installed.venv / "bin" / "python") in proc.stdout
    unit = installed.run("service", "print", "--platform", "linux").stdout
    # The installed copy links its own OPERATIONS.md, and runs from HOME (an installed
    # package needs no working directory); a source checkout would name itself in both.
    doc = installed.site / "daemon" / "service" / "OPERATIONS.md"
    assert f"Documentation=file://{doc}" in unit
    assert f"WorkingDirectory={installed.home}\n" in unit
    assert str(REPO) not in unit


def test_gate_fidelity_runs_from_the_installed_copy(installed):
    # The short form: 8 tokens, depth 1, exact mode, the head's drafts only, no sampling draws,
    # no batched or prefix-cache arms and no extra passes (what is checked is that the installed
    # copy runs it; the prefix arms alone took 35 of its 41 s).
    proc = installed.run("gate", "fidelity", "--tokens", "8", "--depths", "1", "--modes", "exact", "--draws", "0",
                         "--no-deviation", "--no-processors", "--drafting", "mtp", "--batched", "",
                         "--prefix-chunk", "0")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    # It reads its prompts and the bundled model from the venv.
    model = installed.site / "daemon" / "assets" / "tiny-qwen35"
    assert f"fidelity gate: {model} " in proc.stdout
    rows = [line for line in proc.stdout.splitlines() if line.startswith("|") and "| exact |" in line]
    assert rows, proc.stdout
    for row in rows:  # every prompt token-identical to serial decode
        identical = re.search(r"\| (\d+)/(\d+) \|", row)
        assert identical and identical.group(1) == identical.group(2) != "0", row
    assert proc.stdout.rstrip().endswith("PASS")


def test_generate_against_a_daemon_served_from_the_installed_copy(installed, tmp_path):
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    endpoint = f"ipc://{runtime / 'councild.sock'}"
    log_path = tmp_path / "daemon.log"
    with open(log_path, "w") as log:
        daemon = subprocess.Popen([str(installed.councild), "serve", "--endpoint", endpoint, "--log-format", "json"],
                                  cwd=installed.cwd, env=installed.env(COUNCILD_RUNTIME_DIR=str(runtime)),
                                  stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until_answering(endpoint, daemon, timeout_s=180, log_path=log_path)
        proc = installed.run("generate", "The council met at dawn", "--endpoint", endpoint, "--max-tokens", "8",
                             "--timeout", "120")
        assert proc.returncode == 0, proc.stderr
        done = re.search(r"\[(length|stop)\] (\d+) tokens", proc.stderr)
        assert done and int(done.group(2)) >= 1, proc.stderr
    finally:
        if daemon.poll() is None:
            daemon.send_signal(signal.SIGTERM)
        try:
            code = daemon.wait(timeout=60)
        except subprocess.TimeoutExpired:
            daemon.kill()
            code = daemon.wait()
    log_text = log_path.read_text()
    assert code == 0, log_text[-3000:]
    # The daemon loaded the model bundled in the venv, not the one in the source tree.
    events = [json.loads(line) for line in log_text.splitlines() if line.startswith("{")]
    (start,) = [e for e in events if e["event"] == "daemon.start"]
    assert start["model"] == str(installed.site / "daemon" / "assets" / "tiny-qwen35"), start
