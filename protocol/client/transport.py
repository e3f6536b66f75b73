"""The DEALER socket both clients use: options, CURVE, closing, and the monitor event that
says the connection dropped."""

from __future__ import annotations

from typing import Iterable, Iterator

import zmq
from zmq.utils.monitor import parse_monitor_message

from .. import messages as m
from ..codec import encode

# The largest frame a client accepts from the daemon (ZMQ_MAXMSGSIZE on the DEALER socket and
# the bound given to decode_daemon). A Done carries the full text; 64 MiB is far above any
# max_tokens a daemon allows.
MAX_DAEMON_FRAME_BYTES = 64 << 20
SOCKET_LINGER_MS = 100

LOST = "lost the connection (the daemon exited or restarted); requests in flight there are gone"


def _as_key(key: str | bytes) -> bytes:
    return key.encode("ascii") if isinstance(key, str) else bytes(key)


def connect_dealer(ctx: zmq.Context, endpoint: str, timeout_s: float, curve_server_key, curve_keys):
    """A DEALER socket connected to ``endpoint`` (of ``ctx``'s socket class, sync or asyncio)
    and its monitor socket for EVENT_DISCONNECTED; ValueError for an endpoint zmq rejects."""
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, SOCKET_LINGER_MS)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_DAEMON_FRAME_BYTES)
        # Sends are bounded too: a full queue to an absent daemon must not block forever.
        sock.setsockopt(zmq.SNDTIMEO, max(1, int(timeout_s * 1000)))
        if curve_server_key is not None:
            public, secret = curve_keys if curve_keys is not None else zmq.curve_keypair()
            sock.setsockopt(zmq.CURVE_SERVERKEY, _as_key(curve_server_key))
            sock.setsockopt(zmq.CURVE_PUBLICKEY, _as_key(public))
            sock.setsockopt(zmq.CURVE_SECRETKEY, _as_key(secret))
        sock.connect(endpoint)
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        raise ValueError(f"cannot connect to {endpoint!r}: {exc}") from None
    # A dropped connection (the daemon exited or restarted) fails what waits at once: a
    # restarted daemon would answer our pings but know nothing of our requests.
    return sock, sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)


def close_socket(sock, monitor, linger: int) -> None:
    if monitor is not None:
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass
        monitor.close(linger=0)
    sock.close(linger=linger)


def send_cancels(sock, request_ids: Iterable[str]) -> None:
    """Cancel requests still in flight without waiting (on close), so the daemon stops
    spending on them; a full queue drops the rest. Sync sends on a shadow of an asyncio socket."""
    raw = zmq.Socket.shadow(sock.underlying)
    for rid in list(request_ids):
        try:
            raw.send(encode(m.Cancel(request_id=rid)), zmq.NOBLOCK)
        except zmq.ZMQError:
            break


def recv_nowait(sock) -> Iterator[bytes]:
    """The frames already queued on ``sock``, read one at a time as the caller asks (sync
    reads on a shadow of an asyncio socket)."""
    raw = zmq.Socket.shadow(sock.underlying)
    while True:
        try:
            frame = raw.recv(zmq.NOBLOCK)
        except zmq.ZMQError:
            return
        yield frame


def disconnected(frames: list[bytes]) -> bool:
    try:
        return parse_monitor_message(frames)["event"] == zmq.EVENT_DISCONNECTED
    except Exception:  # pragma: no cover - malformed monitor message
        return False
