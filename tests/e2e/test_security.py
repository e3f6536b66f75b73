"""Security against a real daemon: ipc permissions (another user cannot connect), CURVE on
TCP (keys, refusal without a key, plaintext clients get nothing), no pickle on the wire,
and no client field reaching a filesystem path or a shell."""

from __future__ import annotations

import ast
import errno
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import zmq

from e2e_harness import REPO, DaemonProcess, start_daemon, wait_ready
from protocol import Client, DaemonUnavailable, Ping, decode_daemon, encode

CONFIG = "heartbeat_timeout_s = 3.0\nheartbeat_interval_s = 0.5\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(tmp: Path, model: Path, *extra: str, config: str = CONFIG) -> subprocess.Popen:
    """Start `councild serve` with explicit arguments (no ipc endpoint of the harness)."""
    cfg = tmp / "councild.toml"
    cfg.write_text(config)
    log = open(tmp / "daemon.log", "w")
    return subprocess.Popen([sys.executable, "-m", "daemon.cli", "serve", "--model", str(model), "--log-format", "json",
                             "--config", str(cfg), *extra], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))


# ---------------------------------------------------------------------------- ipc


def test_default_runtime_dir_is_tightened(tmp_path, monkeypatch):
    from daemon.paths import ensure_runtime_dir

    loose = tmp_path / "rt"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    monkeypatch.setenv("COUNCILD_RUNTIME_DIR", str(loose))
    assert ensure_runtime_dir() == loose
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700


def test_explicit_endpoint_in_a_world_writable_dir_is_refused(tmp_path, e2e_model):
    # Decision (endpoint.EndpointGuard.check_socket_dir): a folder others can write to could have the socket
    # or its lock file replaced, so the daemon refuses it (exit 78) before loading the model.
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    proc = _serve(tmp_path, e2e_model, "--endpoint", f"ipc://{open_dir / 'c.sock'}")
    assert proc.wait(60) == 78
    assert "writable by nobody else" in (tmp_path / "daemon.log").read_text()
    assert not (open_dir / "c.sock").exists()


def test_lock_file_symlink_is_not_followed(tmp_path, e2e_model):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (run / "c.sock.lock").symlink_to(victim)
    proc = _serve(tmp_path, e2e_model, "--endpoint", f"ipc://{run / 'c.sock'}")
    assert proc.wait(60) == 78
    assert victim.read_text() == "precious"


def _try_as(uid: int, gid: int, endpoint: str) -> str:
    """In a forked child that has dropped to (uid, gid): connect to the ipc socket with a
    plain unix socket and with a ZeroMQ DEALER (a Ping). Returns what happened."""
    path = endpoint[len("ipc://"):]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        result = "?"
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(path)
                raw = "raw-connected"
            except OSError as exc:
                raw = f"raw-refused:{exc.errno}"
            finally:
                s.close()
            ctx = zmq.Context()
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.setsockopt(zmq.RCVTIMEO, 1500)
            d.connect(endpoint)
            d.send(encode(Ping(nonce=7)))
            try:
                decode_daemon(d.recv())
                z = "zmq-reply"
            except zmq.Again:
                z = "zmq-no-reply"
            d.close()
            ctx.term()
            result = f"{raw} {z}"
        except BaseException as exc:  # report, never raise into the forked pytest
            result = f"error {exc!r}"
        finally:
            os.write(w, result.encode())
            os._exit(0)
    os.close(w)
    out = b""
    while chunk := os.read(r, 4096):
        out += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return out.decode()


def test_ipc_permissions_another_user_cannot_connect(e2e_model):
    """The socket is 0600 in a 0700 folder (and the lock file private); another user gets
    EACCES from connect() and no reply over ZeroMQ, even with the folder opened up."""
    # A base folder the other user can traverse, so only the runtime dir and the socket's own
    # modes stand in its way.
    base = Path(tempfile.mkdtemp(prefix="councild-sec-"))
    os.chmod(base, 0o755)
    d = start_daemon(base, e2e_model, config=CONFIG)
    name = None
    try:
        sock_path = Path(d.endpoint[len("ipc://"):])
        assert stat.S_IMODE(d.runtime.stat().st_mode) == 0o700
        assert stat.S_IMODE(sock_path.stat().st_mode) == 0o600
        lock = sock_path.with_name(sock_path.name + ".lock")
        assert stat.S_IMODE(lock.stat().st_mode) & 0o077 == 0
        if os.geteuid() != 0:
            pytest.skip("needs root for the other-user part: it creates a throwaway account (useradd)")
        name = f"cdt{uuid.uuid4().hex[:8]}"
        made = subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                              capture_output=True, text=True)
        if made.returncode != 0:
            name = None
            pytest.skip(f"useradd failed: {made.stderr.strip()}")
        import pwd

        pw = pwd.getpwnam(name)
        # As the other user: the 0700 runtime dir stops it (EACCES) and ZeroMQ gets no reply.
        other = _try_as(pw.pw_uid, pw.pw_gid, d.endpoint)
        assert other == f"raw-refused:{errno.EACCES} zmq-no-reply", other
        # As the daemon's own user, the same probe gets through (the test is not vacuous).
        assert _try_as(os.getuid(), os.getgid(), d.endpoint) == "raw-connected zmq-reply"
        # Even with the folder opened up, the 0600 socket alone refuses the other user.
        os.chmod(d.runtime, 0o755)
        other = _try_as(pw.pw_uid, pw.pw_gid, d.endpoint)
        os.chmod(d.runtime, 0o700)
        assert other == f"raw-refused:{errno.EACCES} zmq-no-reply", other
        assert d.proc.poll() is None
    finally:
        assert d.stop() == 0
        if name is not None:
            subprocess.run(["userdel", name], capture_output=True)
            assert subprocess.run(["id", name], capture_output=True).returncode != 0
        shutil.rmtree(base, ignore_errors=True)


# ---------------------------------------------------------------------------- CURVE on TCP


def test_keys_cli_writes_modes_and_loads(tmp_path):
    from daemon.socket_side import keys

    out = subprocess.run([sys.executable, "-m", "daemon.cli", "keys", "--out", str(tmp_path / "k")], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    public = out.stdout.strip()
    assert len(public) == 40
    secret_file = tmp_path / "k" / keys.SECRET_NAME
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "k" / keys.PUBLIC_NAME).stat().st_mode) == 0o644
    pub, sec = keys.load_secret_key(secret_file)
    assert pub.decode() == public and len(sec) == 40 and zmq.curve_public(sec) == pub
    # Never overwrites a key by accident.
    again = subprocess.run([sys.executable, "-m", "daemon.cli", "keys", "--out", str(tmp_path / "k")], cwd=REPO,
                           capture_output=True, text=True, timeout=60)
    assert again.returncode != 0 and "already exists" in again.stderr
    # A secret readable by others is refused.
    os.chmod(secret_file, 0o644)
    with pytest.raises(keys.KeyFileError, match="chmod 600"):
        keys.load_secret_key(secret_file)
    help_out = subprocess.run([sys.executable, "-m", "daemon.cli", "keys", "--help"], cwd=REPO, capture_output=True,
                              text=True, timeout=60)
    assert "CURVE" in help_out.stdout


def test_tcp_without_key_refuses_to_start(tmp_path, e2e_model):
    t0 = time.monotonic()
    proc = _serve(tmp_path, e2e_model, "--endpoint", f"tcp://127.0.0.1:{_free_port()}")
    assert proc.wait(60) == 78
    log = (tmp_path / "daemon.log").read_text()
    assert "curve_secret_key_file" in log and "--insecure-tcp" in log
    assert time.monotonic() - t0 < 30  # refused before the model loads


@pytest.mark.quick
def test_tcp_with_curve(tmp_path, e2e_model):
    from daemon.socket_side import keys

    secret_file, _, public = keys.generate(tmp_path / "keys")
    port = _free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    proc = _serve(tmp_path, e2e_model, "--endpoint", endpoint,
                  config=CONFIG + f'curve_secret_key_file = "{secret_file}"\n')
    d = DaemonProcess(endpoint, proc, tmp_path / "daemon.log", tmp_path)
    try:
        deadline = time.monotonic() + 90
        while True:  # wait until it serves (a CURVE client is needed even for that)
            assert proc.poll() is None, d.log_path.read_text()[-2000:]
            try:
                with Client(endpoint, timeout_s=2, curve_server_key=public) as c:
                    c.ping()
                break
            except DaemonUnavailable:
                assert time.monotonic() < deadline
        with Client(endpoint, seat="remote", timeout_s=20, curve_server_key=public) as c:
            done = c.generate("def f(x):", max_tokens=5).result()
            assert done.usage.completion_tokens == 5
        # A plaintext client gets nothing (the CURVE handshake never completes).
        raw = zmq.Context.instance().socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.setsockopt(zmq.RCVTIMEO, 1500)
        raw.connect(endpoint)
        raw.send(encode(Ping(nonce=3)))
        with pytest.raises(zmq.Again):
            raw.recv()
        raw.close()
        # A client with the wrong server key gets nothing either: DaemonUnavailable.
        wrong_public, _ = zmq.curve_keypair()
        with pytest.raises(DaemonUnavailable):
            with Client(endpoint, timeout_s=1.5, curve_server_key=wrong_public) as c:
                c.ping()
        assert proc.poll() is None
    finally:
        assert d.stop() == 0


def test_insecure_tcp_warns(tmp_path, e2e_model):
    # The TCP security decision is taken before the model loads, so the warning is there
    # long before the daemon serves; no need to wait for it.
    proc = _serve(tmp_path, e2e_model, "--endpoint", f"tcp://127.0.0.1:{_free_port()}", "--insecure-tcp")
    d = DaemonProcess("", proc, tmp_path / "daemon.log", tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not any(e["event"] == "server.insecure_tcp" for e in d.events()):
            assert proc.poll() is None and time.monotonic() < deadline, d.log_path.read_text()[-2000:]
            time.sleep(0.1)
        warning = next(e for e in d.events() if e["event"] == "server.insecure_tcp")
        assert warning["level"] == "warning" and "anyone" in warning["message"]
    finally:
        d.stop(timeout=60)


# ---------------------------------------------------------------------------- the code itself


def _modules(*packages: str):
    for pkg in packages:
        for path in sorted((REPO / pkg).rglob("*.py")):
            yield path, ast.parse(path.read_text(), filename=str(path))


@pytest.mark.quick
def test_no_pickle_on_the_wire():
    """Messages are msgspec only: nothing in protocol/ or daemon/ imports pickle (or its
    relatives), and the codec's decoders are msgspec msgpack decoders of typed unions."""
    banned = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve", "jsonpickle"}
    offenders = []
    for path, tree in _modules("protocol", "daemon"):
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module.split(".")[0]]
            elif isinstance(node, ast.Attribute) and node.attr in ("recv_pyobj", "send_pyobj", "recv_serialized",
                                                                    "send_serialized"):
                names = [node.attr]
            offenders += [f"{path.relative_to(REPO)}:{node.lineno} {n}" for n in names if n in banned
                          or n.endswith("_pyobj") or n.endswith("_serialized")]
    assert not offenders, offenders
    from protocol import codec

    for dec in (codec._client, codec._daemon, codec._envelope):
        assert type(dec).__module__.startswith("msgspec")


def test_no_client_field_reaches_a_path_or_a_shell():
    """Audit, as a test: the modules that see client messages (the socket loop's server and
    its parts, the engine thread's worker and its parts, requests, scheduler) import no
    process or file-tree module, never evaluate code, and touch the filesystem only at the
    reviewed places below, whose paths come from the configuration (the endpoint, the model
    folder), never from a client frame."""
    builtins_risky = {"open", "eval", "exec", "compile", "__import__", "Path", "PurePath"}
    os_risky = {"system", "popen", "open", "remove", "unlink", "rename", "replace", "mkdir", "makedirs", "rmdir",
                "chmod", "chown", "symlink", "link", "truncate", "execv", "execve", "execvp", "spawnv", "startfile"}
    path_methods = {"unlink", "write_text", "write_bytes", "read_text", "read_bytes", "mkdir", "rmdir", "rename",
                    "symlink_to", "touch", "open", "with_name"}
    reviewed = {  # file -> calls reviewed by hand, every argument traced to config or a constant
        "daemon/socket_side/server.py": {"Path", "mkdir", "with_name", "os.open", "os.chmod", "unlink"},
        # the prefix cache's disk folder: prefix_cache.disk_dir from the config, else the cache dir
        "daemon/engine_thread/prefix_cache_use.py": {"Path"},
        # the model's folder name, from the command line or the config
        "daemon/socket_side/status_reply.py": {"Path"},
    }
    audited = ("daemon/socket_side/server.py", "daemon/socket_side/client_delivery.py", "daemon/socket_side/status_reply.py",
               "daemon/engine_thread/worker.py", "daemon/engine_thread/commands.py", "daemon/engine_thread/decode_paths.py", "daemon/engine_thread/prefix_cache_use.py",
               "daemon/engine_thread/startup.py", "daemon/engine_thread/status_snapshot.py", "daemon/request_text/requests.py", "daemon/engine_thread/scheduler.py")
    assert all((REPO / rel).is_file() for rel in audited), "an audited module moved: audit its new home"
    found = []
    for path, tree in _modules("daemon"):
        rel = str(path.relative_to(REPO))
        if rel not in audited:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not any(x.split(".")[0] in ("subprocess", "shutil", "pty", "importlib", "pickle") for x in mods), \
                    (rel, mods)
            if not isinstance(node, ast.Call):
                continue
            fn = node.func
            name = None
            if isinstance(fn, ast.Name) and fn.id in builtins_risky:
                name = fn.id
            elif isinstance(fn, ast.Attribute):
                if isinstance(fn.value, ast.Name) and fn.value.id == "os" and fn.attr in os_risky:
                    name = f"os.{fn.attr}"
                elif fn.attr in path_methods:
                    name = fn.attr
            if name is not None and name not in reviewed.get(rel, set()):
                found.append(f"{rel}:{node.lineno} {name}")
    assert not found, found
