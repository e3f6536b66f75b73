"""daemon.service: the rendered plist/unit, and install/uninstall into a temporary HOME."""

from __future__ import annotations

import io
import os
import plistlib
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from daemon import service
from daemon.service import LABEL, UNIT_NAME, render, resolve_paths, steps

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)

try:  # the daemon's own default, so the templates' stop timeouts are checked against it
    from daemon.config import Config

    DRAIN_S = Config().drain_deadline_s
except Exception:  # pragma: no cover - config module not importable in this tree
    DRAIN_S = 30.0

PY = os.path.abspath(sys.executable)


# -- helpers -------------------------------------------------------------------------------


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """A key-level systemd unit parser: sections -> key -> every value (keys repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        assert not line.endswith("\\"), f"continuation lines not expected: {raw!r}"
        m = re.fullmatch(r"\[([A-Za-z]+)\]", line)
        if m:
            current = sections.setdefault(m.group(1), {})
            continue
        assert current is not None, f"assignment outside a section: {raw!r}"
        key, sep, value = line.partition("=")
        assert sep, f"not KEY=VALUE: {raw!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def one(unit, section, key) -> str:
    values = unit[section][key]
    assert len(values) == 1, (key, values)
    return values[0]


def env_of(unit) -> dict[str, str]:
    out = {}
    for value in unit["Service"]["Environment"]:
        for word in shlex.split(value):
            k, _, v = word.partition("=")
            out[k] = v
    return out


def snapshot(root: Path) -> set[tuple[str, str]]:
    out = set()
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            out.add(("d", os.path.relpath(os.path.join(dirpath, name), root)))
        for name in filenames:
            out.add(("f", os.path.relpath(os.path.join(dirpath, name), root)))
    return out


def run(argv, env):
    out, err = io.StringIO(), io.StringIO()
    rc = service.main(argv, env=env, stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture
def home(tmp_path):
    h = tmp_path / "home"
    h.mkdir()
    cfg = h / "councild.toml"
    cfg.write_text("")
    return h


@pytest.fixture
def empty_path(tmp_path):
    d = tmp_path / "emptybin"
    d.mkdir()
    return str(d)


def base_env(home: Path, path: str) -> dict[str, str]:
    return {"HOME": str(home), "PATH": path, "TMPDIR": str(home / "tmp")}


# -- launchd plist ---------------------------------------------------------------------------


def _darwin_paths(home: Path, **kw):
    return resolve_paths("darwin", {"HOME": str(home), "TMPDIR": "/var/folders/xy/T/"}, **kw)


def test_plist_parses_with_the_right_keys_and_types(home):
    paths = _darwin_paths(home, config=str(home / "councild.toml"))
    data = plistlib.loads(render("launchd", paths).encode())
    assert data["Label"] == LABEL == "com.councild.daemon"
    assert data["ProgramArguments"] == [PY, "-m", "daemon.cli", "serve", "--config", str(home / "councild.toml")]
    assert all(isinstance(a, str) for a in data["ProgramArguments"])
    assert data["RunAtLoad"] is True
    assert data["KeepAlive"] == {"SuccessfulExit": False}
    assert type(data["ThrottleInterval"]) is int and data["ThrottleInterval"] >= 5
    assert type(data["ExitTimeOut"]) is int and data["ExitTimeOut"] == 45 > DRAIN_S
    assert data["ProcessType"] == "Interactive"
    logs = home / "Library" / "Logs" / "councild"
    assert Path(data["StandardOutPath"]).parent == logs
    assert Path(data["StandardErrorPath"]).parent == logs
    envv = data["EnvironmentVariables"]
    assert isinstance(envv, dict) and all(isinstance(v, str) for v in envv.values())
    assert envv["PYTHONUNBUFFERED"] == "1"
    assert envv["HF_HOME"] == str(home / ".cache" / "huggingface")
    assert envv["PATH"].split(":")[0] == str(Path(PY).parent) and "/usr/sbin" in envv["PATH"].split(":")
    # The folder clients compute from TMPDIR in a shell, pinned for launchd.
    assert envv["COUNCILD_RUNTIME_DIR"] == f"/var/folders/xy/T/councild-{os.getuid()}"
    assert os.path.isabs(data["WorkingDirectory"])
    for key in ("StandardOutPath", "StandardErrorPath", "WorkingDirectory"):
        assert os.path.isabs(data[key])


def test_plist_escapes_awkward_paths(home):
    odd = home / "my <models> & co" / "c.toml"
    paths = _darwin_paths(home, config=str(odd), runtime_dir="/tmp/a&b")
    data = plistlib.loads(render("launchd", paths).encode())
    assert data["ProgramArguments"][-1] == str(odd)
    assert data["EnvironmentVariables"]["COUNCILD_RUNTIME_DIR"] == "/tmp/a&b"


def test_plist_rejects_memory_flags(home):
    with pytest.raises(service.ServiceError) as exc:
        _darwin_paths(home, memory_high="24G")
    assert exc.value.code == service.EXIT_USAGE


# -- systemd unit ----------------------------------------------------------------------------


def _linux_paths(home: Path, **kw):
    return resolve_paths("linux", {"HOME": str(home)}, **kw)


def test_unit_keys(home):
    cfg = str(home / "councild.toml")
    unit = parse_unit(render("systemd", _linux_paths(home, config=cfg)))
    s = "Service"
    assert one(unit, s, "Type") == "notify"
    assert one(unit, s, "NotifyAccess") == "main"
    assert one(unit, s, "WatchdogSec") == "30"
    assert one(unit, s, "Restart") == "on-failure"
    assert one(unit, s, "RestartSec") == "5"
    assert int(one(unit, s, "RestartSteps")) >= 1
    assert one(unit, s, "RestartMaxDelaySec") == "60"
    assert "78" in one(unit, s, "RestartPreventExitStatus").split()
    assert float(one(unit, s, "TimeoutStopSec")) == 45 > DRAIN_S
    assert one(unit, s, "KillSignal") == "SIGTERM"
    assert one(unit, s, "NoNewPrivileges") == "yes"
    assert one(unit, s, "ProtectSystem") == "strict"
    assert one(unit, s, "PrivateTmp") == "no"
    assert one(unit, s, "RuntimeDirectory") == "councild"
    assert one(unit, s, "RuntimeDirectoryMode") == "0700"
    for key in ("CacheDirectory", "StateDirectory", "LogsDirectory"):
        assert one(unit, s, key) == "councild"
    assert one(unit, s, "ReadWritePaths") == f"-{home}/.cache/huggingface"
    assert shlex.split(one(unit, s, "ExecStart")) == [PY, "-m", "daemon.cli", "serve", "--config", cfg]
    assert one(unit, s, "ExecReload") == "/bin/kill -HUP $MAINPID"
    envv = env_of(unit)
    assert envv["PYTHONUNBUFFERED"] == "1"
    assert envv["COUNCILD_RUNTIME_DIR"] == "%t/councild"
    assert envv["PATH"].startswith(str(Path(PY).parent) + ":")
    assert os.path.isabs(one(unit, s, "WorkingDirectory"))
    assert "MemoryHigh" not in unit[s] and "MemoryMax" not in unit[s]
    assert one(unit, "Install", "WantedBy") == "default.target"
    assert int(one(unit, "Unit", "StartLimitBurst")) >= 1


def test_unit_memory_and_no_sandbox(home):
    unit = parse_unit(render("systemd", _linux_paths(home, memory_high="24G", memory_max="90%", sandbox=False)))
    assert one(unit, "Service", "MemoryHigh") == "24G"
    assert one(unit, "Service", "MemoryMax") == "90%"
    assert "ProtectSystem" not in unit["Service"] and "ReadWritePaths" not in unit["Service"]
    assert one(unit, "Service", "NoNewPrivileges") == "yes"


@pytest.mark.parametrize("bad", ["24 G", "lots", "-1G", "24g;rm"])
def test_unit_rejects_bad_memory_sizes(home, bad):
    with pytest.raises(service.ServiceError):
        _linux_paths(home, memory_high=bad)


def test_unit_quotes_awkward_paths(home):
    cfg = str(home / "my configs" / "100%" / "c$x.toml")
    unit = parse_unit(render("systemd", _linux_paths(home, config=cfg)))
    argv = shlex.split(one(unit, "Service", "ExecStart"))
    # systemd un-escapes %% -> % and $$ -> $ after unquoting.
    assert argv[-1].replace("%%", "%").replace("$$", "$") == cfg
    with pytest.raises(service.ServiceError):
        render("systemd", _linux_paths(home, config="/tmp/evil\nExecStartPre=/bin/true"))


SYSTEMD_ANALYZE = shutil.which("systemd-analyze")


def _systemd_version() -> int:
    out = subprocess.run([SYSTEMD_ANALYZE, "--version"], capture_output=True, text=True).stdout
    return int(re.search(r"systemd (\d+)", out).group(1))


def _verify(tmp_path: Path, text: str) -> tuple[int, list[str]]:
    """`systemd-analyze --user verify` on a unit file. A user manager is not running here;
    the verifier only needs an XDG_RUNTIME_DIR to set up its own private one."""
    unit_dir = tmp_path / "units"
    unit_dir.mkdir(exist_ok=True)
    unit = unit_dir / UNIT_NAME
    unit.write_text(text)
    # A short folder of its own, not under tmp_path: the user units the verifier also loads
    # put sockets in it, and a long path (an xdist worker's) overflows sun_path.
    with tempfile.TemporaryDirectory(prefix="xdg-") as rt:
        env = {**os.environ, "XDG_RUNTIME_DIR": rt, "SYSTEMD_LOG_COLOR": "0"}
        proc = subprocess.run(
            [SYSTEMD_ANALYZE, "--user", "--man=no", "verify", str(unit)], capture_output=True, text=True, env=env,
            timeout=60)
    # verify exits 0 even for bad values ("..., ignoring."), so every diagnostic line counts.
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    return proc.returncode, lines


def _unexpected(lines: list[str]) -> list[str]:
    allowed = []
    if _systemd_version() < 254:  # RestartSteps=/RestartMaxDelaySec= arrived in 254
        allowed = ["Unknown key 'RestartSteps'", "Unknown key 'RestartMaxDelaySec'",
                   "Unknown key name 'RestartSteps'", "Unknown key name 'RestartMaxDelaySec'"]
    return [ln for ln in lines if not any(a in ln for a in allowed)]


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze not installed")
@pytest.mark.parametrize(
    "kw",
    [{}, {"memory_high": "24G", "memory_max": "28G"}, {"sandbox": False}, {"config": "/srv/my configs/c.toml"}],
    ids=["default", "memory", "no-sandbox", "spaces"],
)
def test_unit_passes_systemd_analyze_verify(tmp_path, home, kw):
    kw.setdefault("config", str(home / "councild.toml"))
    rc, lines = _verify(tmp_path, render("systemd", _linux_paths(home, **kw)))
    assert rc == 0, lines
    assert _unexpected(lines) == [], lines


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze not installed")
def test_systemd_analyze_check_catches_mistakes(tmp_path, home):
    """The verify test would fail on a broken unit (it is not vacuous)."""
    good = render("systemd", _linux_paths(home))
    for broken in (
        good.replace("Type=notify", "Type=notifyy"),
        good.replace("RestartPreventExitStatus=78", "RestartPreventExitStatus=seventy-eight"),
        good.replace(f"ExecStart={PY}", "ExecStart=/nonexistent/python"),
    ):
        rc, lines = _verify(tmp_path, broken)
        assert rc != 0 or _unexpected(lines), lines


# -- install / uninstall round trips ---------------------------------------------------------


@pytest.mark.parametrize("platform", ["linux", "darwin"])
def test_install_uninstall_round_trip(home, empty_path, platform):
    env = base_env(home, empty_path)
    cfg = str(home / "councild.toml")
    before = snapshot(home)
    rc, out, err = run(["install", "--platform", platform, "--config", cfg], env)
    assert rc == 0, err
    if platform == "linux":
        target = home / ".config" / "systemd" / "user" / "councild.service"
        assert "systemctl --user daemon-reload && systemctl --user enable --now councild" in out
        unit = parse_unit(target.read_text())
        assert shlex.split(one(unit, "Service", "ExecStart"))[0] == PY
    else:
        target = home / "Library" / "LaunchAgents" / "com.councild.daemon.plist"
        assert f"launchctl bootstrap gui/{os.getuid()} {target}" in out
        assert (home / "Library" / "Logs" / "councild").is_dir()  # launchd will not create it
        data = plistlib.loads(target.read_bytes())
        assert data["ProgramArguments"][0] == PY
        assert data["StandardErrorPath"].startswith(str(home) + "/")
    content = target.read_text()
    assert PY in content and cfg in content
    assert oct(target.stat().st_mode & 0o777) == "0o644"
    mtime = target.stat().st_mtime_ns

    # Idempotent: same bytes, says so, file not rewritten.
    rc, out, _ = run(["install", "--platform", platform, "--config", cfg], env)
    assert rc == 0 and "unchanged" in out
    assert target.read_text() == content and target.stat().st_mtime_ns == mtime

    # print shows what install wrote (less the install record header).
    rc, printed, _ = run(["print", "--platform", platform, "--config", cfg], env)
    assert rc == 0
    assert service.without_record(printed) == service.without_record(content)

    rc, out, _ = run(["status", "--platform", platform, "--config", cfg], env)
    assert rc == 0 and "installed: yes, matches" in out and str(target) in out
    rc, out, _ = run(["status", "--platform", platform, "--config", str(home / "other.toml")], env)
    assert rc == 0 and "differs" in out

    rc, out, _ = run(["uninstall", "--platform", platform], env)
    assert rc == 0 and f"removed {target}" in out
    assert snapshot(home) == before  # nothing left behind, nothing else touched

    rc, out, _ = run(["status", "--platform", platform], env)
    assert rc == service.EXIT_FAILED and "installed: no" in out
    rc, out, _ = run(["uninstall", "--platform", platform], env)
    assert rc == 0 and "not installed" in out


@pytest.mark.parametrize("platform", ["linux", "darwin"])
def test_uninstall_keeps_folders_that_existed_or_hold_logs(home, empty_path, platform):
    env = base_env(home, empty_path)
    # Folders the user already had (one of them empty) must survive uninstall.
    (home / ".config" / "systemd" / "user").mkdir(parents=True)
    (home / "Library" / "LaunchAgents").mkdir(parents=True)
    before = snapshot(home)
    assert run(["install", "--platform", platform, "--config", str(home / "councild.toml")], env)[0] == 0
    # A reinstall with other options rewrites the file but keeps the record of created dirs.
    rc, out, _ = run(["install", "--platform", platform, "--config", str(home / "other.toml")], env)
    assert rc == 0 and "updated" in out
    if platform == "darwin":
        (home / "Library" / "Logs" / "councild" / "councild.err.log").write_text("{}\n")
    rc, out, _ = run(["uninstall", "--platform", platform], env)
    assert rc == 0
    after = snapshot(home)
    if platform == "darwin":
        assert "it holds the logs" in out
        log_entries = {("d", "Library/Logs"), ("d", "Library/Logs/councild"), ("f", "Library/Logs/councild/councild.err.log")}
        assert after == before | log_entries
    else:
        assert after == before


def test_uninstall_removes_a_dangling_enable_link(home, empty_path):
    env = base_env(home, empty_path)
    assert run(["install", "--platform", "linux", "--config", str(home / "councild.toml")], env)[0] == 0
    unit_dir = home / ".config" / "systemd" / "user"
    wants = unit_dir / "default.target.wants"
    wants.mkdir()
    (wants / UNIT_NAME).symlink_to(unit_dir / UNIT_NAME)  # what `systemctl enable` leaves
    rc, out, _ = run(["uninstall", "--platform", "linux"], env)
    assert rc == 0 and f"removed {wants / UNIT_NAME}" in out
    assert snapshot(home) == {("f", "councild.toml")}


@pytest.mark.parametrize("platform,tool", [("linux", "systemctl"), ("darwin", "launchctl")])
def test_now_without_the_tool_is_a_clear_error(home, empty_path, platform, tool):
    env = base_env(home, empty_path)
    before = snapshot(home)
    rc, out, err = run(["install", "--platform", platform, "--now", "--config", str(home / "councild.toml")], env)
    assert rc == service.EXIT_UNAVAILABLE == 69
    assert f"`{tool}`, which is not on PATH" in err and "Nothing was changed" in err
    assert snapshot(home) == before
    assert run(["install", "--platform", platform, "--config", str(home / "councild.toml")], env)[0] == 0
    rc, _, err = run(["uninstall", "--platform", platform, "--now"], env)
    assert rc == 69 and tool in err
    assert snapshot(home) != before  # still installed: nothing removed on refusal


def test_now_with_a_missing_config_refuses(home, tmp_path):
    bindir = _fake_tool(tmp_path, "systemctl")
    env = {**base_env(home, str(bindir)), "FAKE_LOG": str(tmp_path / "calls.log")}
    before = snapshot(home)
    rc, _, err = run(["install", "--platform", "linux", "--now", "--config", str(home / "nope.toml")], env)
    assert rc == service.EXIT_CONFIG == 78 and "does not exist" in err
    assert snapshot(home) == before and not (tmp_path / "calls.log").exists()


def test_install_warns_about_a_missing_config(home, empty_path):
    rc, _, err = run(["install", "--platform", "linux", "--config", str(home / "nope.toml")], base_env(home, empty_path))
    assert rc == 0 and "exit 78" in err


def _fake_tool(tmp_path: Path, name: str) -> Path:
    """A systemctl/launchctl stand-in that logs its argv; `launchctl print` says not loaded
    unless FAKE_LOADED is set; FAKE_FAIL=<word> makes the call containing it fail."""
    bindir = tmp_path / "fakebin"
    bindir.mkdir(exist_ok=True)
    script = bindir / name
    script.write_text(
        "#!/bin/sh\n"
        'echo "$*" >> "$FAKE_LOG"\n'
        'if [ "$1" = print ] && [ -z "$FAKE_LOADED" ]; then echo "Could not find service" >&2; exit 113; fi\n'
        'case " $* " in *" $FAKE_FAIL "*) [ -n "$FAKE_FAIL" ] && { echo "Failed to connect to bus" >&2; exit 1; };; esac\n'
        'if [ -n "$FAKE_FAIL_ONCE" ] && [ "$1" = "$FAKE_FAIL_ONCE" ] && [ ! -e "$FAKE_LOG.once" ]; then\n'
        '  : > "$FAKE_LOG.once"; echo "Bootstrap failed: 5: Input/output error" >&2; exit 5; fi\n'
        "exit 0\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return bindir


def _calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "calls.log"
    calls = log.read_text().splitlines() if log.exists() else []
    log.unlink(missing_ok=True)
    return calls


def test_now_runs_the_systemctl_commands(home, tmp_path):
    env = {**base_env(home, str(_fake_tool(tmp_path, "systemctl"))), "FAKE_LOG": str(tmp_path / "calls.log")}
    cfg = str(home / "councild.toml")
    assert run(["install", "--platform", "linux", "--now", "--config", cfg], env)[0] == 0
    assert _calls(tmp_path) == [
        "--user daemon-reload",
        f"--user try-restart {UNIT_NAME}",
        f"--user enable --now {UNIT_NAME}",
    ]
    assert run(["install", "--platform", "linux", "--now", "--config", cfg], env)[0] == 0
    assert _calls(tmp_path) == ["--user daemon-reload", f"--user enable --now {UNIT_NAME}"]

    rc, out, _ = run(["status", "--platform", "linux", "--config", cfg], env)
    assert rc == 0 and f"--user status --no-pager --lines=5 {UNIT_NAME}" in "\n".join(_calls(tmp_path))

    # A failing stop leaves the file so the user can retry.
    rc, _, err = run(["uninstall", "--platform", "linux", "--now"], {**env, "FAKE_FAIL": "disable"})
    assert rc == 1 and "left in place" in err
    assert (home / ".config/systemd/user/councild.service").exists()
    _calls(tmp_path)
    assert run(["uninstall", "--platform", "linux", "--now"], env)[0] == 0
    assert _calls(tmp_path) == [
        f"--user disable --now {UNIT_NAME}",
        "--user daemon-reload",
        f"--user reset-failed {UNIT_NAME}",
    ]
    assert not (home / ".config").exists()


def test_now_runs_the_launchctl_commands(home, tmp_path, monkeypatch):
    env = {**base_env(home, str(_fake_tool(tmp_path, "launchctl"))), "FAKE_LOG": str(tmp_path / "calls.log")}
    cfg = str(home / "councild.toml")
    plist = home / "Library" / "LaunchAgents" / f"{LABEL}.plist"
    domain = f"gui/{os.getuid()}"
    assert run(["install", "--platform", "darwin", "--now", "--config", cfg], env)[0] == 0
    assert _calls(tmp_path) == [f"print {domain}/{LABEL}", f"enable {domain}/{LABEL}", f"bootstrap {domain} {plist}"]
    loaded = {**env, "FAKE_LOADED": "1"}
    assert run(["install", "--platform", "darwin", "--now", "--config", cfg], loaded)[0] == 0
    assert _calls(tmp_path) == [f"print {domain}/{LABEL}", f"kickstart {domain}/{LABEL}"]
    rc, out, _ = run(["install", "--platform", "darwin", "--now", "--config", str(home / "x.toml")], loaded)
    assert rc == service.EXIT_CONFIG  # x.toml does not exist
    (home / "x.toml").write_text("")
    # A changed file while loaded: bootout, then bootstrap (retried while the old one exits).
    monkeypatch.setattr(steps, "RETRY_DELAY_S", 0.0)
    flaky = {**loaded, "FAKE_FAIL_ONCE": "bootstrap"}
    assert run(["install", "--platform", "darwin", "--now", "--config", str(home / "x.toml")], flaky)[0] == 0
    assert _calls(tmp_path) == [
        f"print {domain}/{LABEL}", f"bootout {domain}/{LABEL}", f"bootstrap {domain} {plist}", f"bootstrap {domain} {plist}"
    ]
    assert run(["uninstall", "--platform", "darwin", "--now"], loaded)[0] == 0
    assert _calls(tmp_path) == [f"print {domain}/{LABEL}", f"bootout {domain}/{LABEL}"]
    assert not plist.exists()


def test_dry_run_changes_nothing(home, empty_path):
    env = base_env(home, empty_path)
    before = snapshot(home)
    rc, out, _ = run(["install", "--platform", "darwin", "--dry-run", "--config", str(home / "councild.toml")], env)
    assert rc == 0 and "would write" in out and "would create" in out
    assert snapshot(home) == before
    assert run(["install", "--platform", "linux", "--config", str(home / "councild.toml")], env)[0] == 0
    rc, out, _ = run(["install", "--platform", "linux", "--dry-run", "--config", str(home / "other.toml")], env)
    assert rc == 0 and "would rewrite" in out and "+ExecStart=" in out
    installed = snapshot(home)
    rc, out, _ = run(["uninstall", "--platform", "linux", "--dry-run"], env)
    assert rc == 0 and "would remove" in out and snapshot(home) == installed


def test_help_answers_questions(capsys):
    assert service.main(["--help"]) == 0
    text = capsys.readouterr().out
    for needle in ("~/.config/systemd/user/councild.service", "~/Library/LaunchAgents/com.councild.daemon.plist",
                   "--now", "systemctl --user enable --now", "launchctl bootstrap", "78"):
        assert needle in text, needle
    assert service.main(["install", "--help"]) == 0
    text = capsys.readouterr().out
    assert "--memory-high" in text and "--dry-run" in text and "Library/Logs/councild" in text
    assert service.main(["frobnicate"]) == 2


def test_a_reader_that_leaves_gets_no_traceback(home):
    """`councild service print | head -3`: stdout is a pipe nobody reads any more."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write now fails with EPIPE, deterministically
    try:
        proc = subprocess.run([sys.executable, "-m", "daemon.cli", "service", "print", "--platform", "linux"],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120,
                              env={**os.environ, "HOME": str(home)})
    finally:
        os.close(write_end)
    assert proc.returncode == service.EXIT_FAILED
    assert proc.stderr == ""
