"""The daemon's endpoint before any client is served: one daemon per endpoint (a lock file
beside an ipc socket), the socket folder's security, CURVE for TCP, and the bind itself.
Every failure here is a ``StartupError`` with a one-line message and the exit code a service
manager should see (daemon/exits.py), raised before the model loads.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path

import zmq

from ..config import Config
from ..exits import EXIT_CONFIG, EXIT_TEMPFAIL
from ..logs import get_logger

log = get_logger("councild.server")


class StartupError(Exception):
    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


# Filesystem failures that may clear by themselves (a full disk, too many open files): a
# service manager should retry. Anything else (permissions, a read-only filesystem, a path
# of the wrong kind) needs an operator.
_TRANSIENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EMFILE, errno.ENFILE, errno.EAGAIN, errno.ENOMEM}


def startup_fs_error(what: str, exc: OSError) -> StartupError:
    """A start-up filesystem failure as a one-line message and its exit code."""
    code = EXIT_TEMPFAIL if exc.errno in _TRANSIENT_ERRNOS else EXIT_CONFIG
    reason = exc.strerror or str(exc)
    hint = " (the disk is full: free space, then start again)" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else ""
    return StartupError(f"{what}: {reason}{hint}", code)


class EndpointGuard:
    """Claims, secures and binds one endpoint for the server's ROUTER socket."""

    def __init__(self, cfg: Config, endpoint: str, ctx: zmq.Context):
        self.cfg = cfg
        self.endpoint = endpoint
        self.ctx = ctx
        self._lock_file = None  # held open (and flock'ed) for the daemon's lifetime
        self._curve: tuple[bytes, bytes] | None = None  # (public, secret) on CURVE TCP

    def claim(self) -> None:
        """One daemon per endpoint: an ipc endpoint is guarded by a lock file beside the
        socket (a crashed daemon's stale socket is then safe to remove).

        Security of an ipc endpoint rests on its directory (see ``check_socket_dir``): the
        default runtime dir is made 0700; an explicit --endpoint elsewhere must be in a
        directory this user owns that nobody else can write to."""
        if not self.endpoint.startswith("ipc://"):
            return
        sock = Path(self.endpoint[len("ipc://"):])
        try:
            sock.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise startup_fs_error(f"cannot create the socket's folder {sock.parent}", exc) from None
        self.check_socket_dir(sock.parent)
        lock_path = sock.with_name(sock.name + ".lock")
        # O_NOFOLLOW: never truncate whatever a planted symlink points at.
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise startup_fs_error(f"cannot open the lock file {lock_path}", exc) from None
        self._lock_file = os.fdopen(fd, "r+")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise StartupError(
                f"another councild is already serving {self.endpoint} (lock {lock_path} is held); "
                "stop it first or choose another --endpoint",
                EXIT_TEMPFAIL,
            ) from None
        try:
            self._lock_file.seek(0)
            self._lock_file.truncate()
            self._lock_file.write(str(os.getpid()))
            self._lock_file.flush()
        except OSError as exc:
            raise startup_fs_error(f"cannot write the lock file {lock_path}", exc) from None
        try:
            st = sock.lstat()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise startup_fs_error(f"cannot inspect the socket path {sock}", exc) from None
        if not (stat.S_ISSOCK(st.st_mode) or stat.S_ISLNK(st.st_mode)):
            kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a regular file" if stat.S_ISREG(st.st_mode) \
                else "not a socket"
            raise StartupError(f"the socket path {sock} exists and is {kind}; councild removes only a stale "
                               "socket: move it away or choose another --endpoint", EXIT_CONFIG)
        try:
            sock.unlink()  # a stale socket (or a symlink, never followed): its owner no longer holds the lock
        except OSError as exc:
            raise startup_fs_error(f"cannot remove the stale socket {sock}", exc) from None

    @staticmethod
    def check_socket_dir(folder: Path) -> None:
        """Decision for ipc endpoints outside the 0700 runtime dir: refuse (exit 78) a
        directory owned by another user or writable by group/others (they could replace
        the socket or plant the lock file); accept one that others can only read or
        traverse, with a warning, because the socket itself is made 0600 (connecting to a
        unix socket needs write permission on it) and is bound under umask 077."""
        try:
            st = folder.stat()
        except OSError as exc:
            raise startup_fs_error(f"cannot inspect the socket's folder {folder}", exc) from None
        if not stat.S_ISDIR(st.st_mode):
            raise StartupError(f"the socket's folder {folder} is not a directory", EXIT_CONFIG)
        mode = st.st_mode & 0o777
        if st.st_uid != os.getuid() or mode & 0o022:
            raise StartupError(
                f"refusing to put the ipc socket in {folder} (mode {mode:04o}, owner uid {st.st_uid}): "
                "it must be owned by this user and writable by nobody else; use the default "
                "runtime dir or a 0700 folder",
                EXIT_CONFIG,
            )
        if mode & 0o077:
            log.warning("server.socket_dir_open", folder=str(folder), mode=f"{mode:04o}",
                        message="others can see the socket's folder; the socket itself is 0600")

    def bind(self) -> zmq.Socket:
        router = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 100)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.setsockopt(zmq.MAXMSGSIZE, self.cfg.max_frame_bytes + 1024)
        router.setsockopt(zmq.SNDHWM, self.cfg.client_send_hwm)
        router.setsockopt(zmq.RCVHWM, 10000)
        if self._curve is not None:
            public, secret = self._curve
            router.setsockopt(zmq.CURVE_SERVER, 1)
            router.setsockopt(zmq.CURVE_SECRETKEY, secret)
            router.setsockopt(zmq.CURVE_PUBLICKEY, public)
        # umask 077 while binding: the ipc socket is never connectable by others, not even
        # in the instant before the chmod below.
        old_umask = os.umask(0o077)
        try:
            router.bind(self.endpoint)
        except zmq.ZMQError as exc:
            router.close(linger=0)
            code = EXIT_TEMPFAIL if exc.errno in _TRANSIENT_ERRNOS | {errno.EADDRINUSE} else EXIT_CONFIG
            hint = " (the disk is full)" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else ""
            raise StartupError(f"cannot bind {self.endpoint}: {exc}{hint}", code) from None
        finally:
            os.umask(old_umask)
        if self.endpoint.startswith("ipc://"):
            try:
                os.chmod(self.endpoint[len("ipc://"):], 0o600)
            except OSError as exc:
                router.close(linger=0)
                raise startup_fs_error(f"cannot restrict the socket {self.endpoint}", exc) from None
        return router

    def secure_tcp(self) -> None:
        """TCP endpoints need CURVE. Checked before the model loads, so a refused start is
        immediate: sets ``self._curve`` to (public, secret), or refuses (exit 78), or, with
        insecure_tcp, warns and serves plaintext."""
        if not self.endpoint.startswith("tcp://"):
            return
        if self.cfg.curve_secret_key_file:
            from .keys import KeyFileError, load_secret_key

            try:
                self._curve = load_secret_key(self.cfg.curve_secret_key_file)
            except KeyFileError as exc:
                raise StartupError(str(exc), EXIT_CONFIG) from None
            log.info("server.curve", endpoint=self.endpoint, public_key=self._curve[0].decode())
            return
        if not self.cfg.insecure_tcp:
            raise StartupError(
                f"{self.endpoint} is a TCP endpoint: give curve_secret_key_file (make one with "
                "`councild keys`) or start with --insecure-tcp to serve it unencrypted",
                EXIT_CONFIG,
            )
        log.warning("server.insecure_tcp", endpoint=self.endpoint,
                     message="serving TCP without CURVE: anyone who can reach the port can use the model")
