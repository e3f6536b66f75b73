"""sd_notify without dependencies: tell systemd we are ready, stopping, reloading, alive.

systemd (Type=notify) passes ``NOTIFY_SOCKET`` to the service: an AF_UNIX datagram socket,
either a filesystem path (``/run/user/1000/systemd/notify``) or an abstract name written
with a leading ``@``. Each message is one datagram of ``KEY=VALUE`` lines. Under launchd,
or started by hand, ``NOTIFY_SOCKET`` is unset and every call is a cheap no-op.

Usage in the daemon::

    notifier = Notifier()                  # reads NOTIFY_SOCKET once
    notifier.status("loading model")
    notifier.extend_timeout(120)           # while a slow load runs
    ...
    notifier.ready("serving on ipc://...")
    pacer = WatchdogPacer(notifier)        # interval from WATCHDOG_USEC
    while serving:
        ...one decode step / prefill chunk / idle poll...
        pacer.tick()                       # sends WATCHDOG=1 at most every interval/2
    notifier.stopping("draining 3 requests")

The watchdog is fed from loop progress, never from a timer thread: a timer would keep a
wedged step loop alive in systemd's eyes. So ``tick()`` must be reached at least every
interval/2 while healthy, idle included (the server's poll timeout is far below that) and
during a long prefill (once per chunk).

Nothing here raises into the caller: a failed send is logged (once, then again only when
it recovers) and the daemon carries on. Telling systemd is never worth stopping decode.
"""

from __future__ import annotations

import errno
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping

import structlog

log = structlog.get_logger("councild.notify")

__all__ = ["Notifier", "WatchdogPacer", "watchdog_interval_s"]


def watchdog_interval_s(env: Mapping[str, str] | None = None, pid: int | None = None) -> float | None:
    """The watchdog timeout systemd expects us to meet, in seconds, or None when there is
    no watchdog for this process.

    ``WATCHDOG_USEC`` carries the timeout; ``WATCHDOG_PID``, when set, names the process it
    is meant for (a child that inherited the environment must not think it is watched).
    """
    env = os.environ if env is None else env
    raw = env.get("WATCHDOG_USEC")
    if not raw:
        return None
    try:
        usec = int(raw)
    except ValueError:
        log.warning("notify.bad_watchdog_usec", value=raw)
        return None
    if usec <= 0:
        return None
    owner = env.get("WATCHDOG_PID")
    if owner:
        try:
            owner_pid = int(owner)
        except ValueError:
            log.warning("notify.bad_watchdog_pid", value=owner)
            return None
        if owner_pid != (os.getpid() if pid is None else pid):
            return None
    return usec / 1_000_000


def _parse_address(raw: str | None) -> str | bytes | None:
    """NOTIFY_SOCKET -> an address for sendto, or None (unset or unsupported)."""
    if not raw:
        return None
    if raw.startswith("@"):
        # Abstract namespace: a leading NUL byte instead of the '@'.
        return b"\0" + raw[1:].encode()
    if raw.startswith("/"):
        return raw
    # systemd >= 254 may also hand out vsock: addresses (VMs); not used for user units.
    log.warning("notify.unsupported_socket", notify_socket=raw)
    return None


class Notifier:
    """Sends sd_notify messages to $NOTIFY_SOCKET; a no-op when it is unset.

    Thread-safe: the step loop (watchdog) and the control path (status, stopping) may call
    it concurrently. Every method returns True when a datagram was sent, False otherwise.
    """

    def __init__(self, env: Mapping[str, str] | None = None, *, unset_environment: bool = False) -> None:
        env = os.environ if env is None else env
        self._raw = env.get("NOTIFY_SOCKET") or None
        self._address = _parse_address(self._raw)
        self._watchdog_s = watchdog_interval_s(env)
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._failing = False
        if unset_environment:
            # Like sd_notify(unset_environment=1): children we spawn are not the service.
            for key in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
                os.environ.pop(key, None)

    @property
    def enabled(self) -> bool:
        """True when there is a service manager to talk to."""
        return self._address is not None

    @property
    def socket_name(self) -> str | None:
        return self._raw

    def watchdog_interval_s(self) -> float | None:
        """The watchdog timeout read at construction (see :func:`watchdog_interval_s`)."""
        return self._watchdog_s

    # -- the messages ----------------------------------------------------------------

    def ready(self, status: str | None = None) -> bool:
        """READY=1: start-up is complete (model loaded, socket bound); also ends a reload."""
        return self.notify("READY=1", *self._status_line(status))

    def stopping(self, status: str | None = None) -> bool:
        """STOPPING=1: shutdown has begun (the drain); sent once, before draining."""
        return self.notify("STOPPING=1", *self._status_line(status))

    def reloading(self, status: str | None = None) -> bool:
        """RELOADING=1 with MONOTONIC_USEC (systemd >= 253 requires it for notify-reload);
        follow with ready() when the reload is done."""
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.notify("RELOADING=1", f"MONOTONIC_USEC={usec}", *self._status_line(status))

    def watchdog(self) -> bool:
        """WATCHDOG=1: the loop made progress. Call through a WatchdogPacer."""
        return self.notify("WATCHDOG=1")

    def status(self, text: str) -> bool:
        """STATUS=...: one line shown by `systemctl --user status councild`."""
        return self.notify(*self._status_line(text))

    def extend_timeout(self, seconds: float, status: str | None = None) -> bool:
        """EXTEND_TIMEOUT_USEC: the current start/stop phase needs up to `seconds` more
        (e.g. while loading a large model past TimeoutStartSec); with ``status``, its STATUS
        line in the same datagram."""
        return self.notify(f"EXTEND_TIMEOUT_USEC={max(0, int(seconds * 1_000_000))}", *self._status_line(status))

    # -- the transport ---------------------------------------------------------------

    @staticmethod
    def _status_line(text: str | None) -> tuple[str, ...]:
        if text is None:
            return ()
        # One line only: a newline would start a new KEY=VALUE assignment.
        return ("STATUS=" + " ".join(str(text).split()),)

    def notify(self, *lines: str) -> bool:
        """Send KEY=VALUE lines as one datagram. Never raises."""
        if self._address is None or not lines:
            return False
        payload = "\n".join(lines).encode("utf-8", "replace")
        try:
            with self._lock:
                if self._sock is None:
                    # Not inherited by children: Python sockets are non-inheritable (PEP 446).
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                    # Never block the step loop: a full receive queue drops the message.
                    sock.setblocking(False)
                    self._sock = sock
                try:
                    self._sock.sendto(payload, self._address)
                except OSError:
                    # A manager restart replaces the socket; next call starts afresh.
                    self._close_locked()
                    raise
            if self._failing:
                self._failing = False
                log.info("notify.recovered", notify_socket=self._raw)
            return True
        except Exception as exc:  # noqa: BLE001 - by contract this never raises
            if not self._failing:
                self._failing = True
                log.warning(
                    "notify.send_failed",
                    notify_socket=self._raw,
                    message=lines[0].split("=", 1)[0],
                    error=repr(exc),
                    errno=errno.errorcode.get(getattr(exc, "errno", None) or -1),
                )
            return False

    def _close_locked(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._close_locked()

    def __enter__(self) -> Notifier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class WatchdogPacer:
    """Rate-limits WATCHDOG=1 to once per half the watchdog interval.

    Call ``tick()`` as often as you like from the loop that must stay alive (every decode
    step is fine: it costs one clock read when nothing is due). Disabled (tick() returns
    False at once) when systemd set no watchdog. Meant for one thread: the step loop.
    """

    def __init__(
        self,
        notifier: Notifier,
        interval_s: float | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._notifier = notifier
        interval = notifier.watchdog_interval_s() if interval_s is None else interval_s
        self.period_s: float | None = interval / 2 if interval and interval > 0 and notifier.enabled else None
        self._clock = clock
        self._last: float | None = None
        self.sent = 0

    @property
    def enabled(self) -> bool:
        return self.period_s is not None

    def tick(self) -> bool:
        """Send WATCHDOG=1 if half the interval has passed since the last one."""
        if self.period_s is None:
            return False
        now = self._clock()
        if self._last is not None and now - self._last < self.period_s:
            return False
        self._last = now
        if self._notifier.watchdog():
            self.sent += 1
            return True
        return False

    # What the server's engine hooks call on each unit of progress.
    progress = tick
