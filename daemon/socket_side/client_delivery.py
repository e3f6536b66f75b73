"""Replies to clients, sent without ever blocking the socket loop.

A client that stops reading fills its send queue. Inside ``slow_consumer_grace_s`` its
messages wait here in order (the backlog) and go out as it reads again; past the grace
(or past the backlog's cap) its requests are cut with ``slow_consumer``. A request's one
terminal message is never lost to a full queue: it is held and retried (``_held``) until
the client reads or leaves; a cut connection gets no new work accepted until every
terminal owed to it has gone out (``_settle``).

``ClientDelivery`` is a part of ``Server`` (server.py) kept in its own file, with the state
it owns (``_init_delivery``); it uses the server's ``live`` requests, ``seats``, ``cfg``
and the engine's command queue (a cut request is cancelled there).
"""

from __future__ import annotations

import time
from collections import deque

import zmq

from protocol import encode
from protocol import messages as m

from ..engine_thread.commands import CancelJob
from ..logs import get_logger

log = get_logger("councild.server")

# A full queue is logged (client.backlog) once it has stayed full this long: a client that
# reads, only slower than the engine writes, fills and empties its queue many times a second,
# and that is not news.
BACKLOG_LOG_AFTER_S = 1.0
# During a slow consumer's grace (slow_consumer_grace_s) its messages wait in the daemon, at
# most this many (or client_send_hwm, if larger) per connection: room for seconds of four
# streams' chunks, and a bound on what a client that never reads again can cost (~1 MB).
GRACE_BACKLOG_MIN = 4096


class ClientDelivery:
    """Sending, holding and cutting (a mixin of Server)."""

    def _init_delivery(self, cfg) -> None:
        self._cut: set[tuple[str, str]] = set()  # live requests already cancelled by _drop_client
        self._held: dict[bytes, deque[bytes]] = {}  # terminal messages a full queue refused, to retry
        # Connections cut as slow consumers: until every terminal owed to them has gone out,
        # their new Generates are refused (slow_consumer), never accepted.
        self._slow: set[bytes] = set()
        # Rejections past the per-connection hold bound, answered by one summary Error later.
        self._discarded: dict[bytes, int] = {}
        self._held_cap = 16 * cfg.client_send_hwm
        # A connection whose send queue is full, inside its grace: the messages it has not
        # taken yet, in order (payload, request key or None, terminal, rejection), and since when.
        self._backlog: dict[bytes, deque[tuple[bytes, tuple[str, str] | None, bool, bool]]] = {}
        # (when the queue filled, when the client last took a message): the grace runs from the latter.
        self._backlog_since: dict[bytes, tuple[float, float]] = {}
        self._backlog_logged: set[bytes] = set()  # episodes long enough to be logged
        self._backlog_cap = max(GRACE_BACKLOG_MIN, cfg.client_send_hwm)

    def _forward_replies(self, engine_out: zmq.Socket, router: zmq.Socket) -> None:
        for _ in range(1024):
            try:
                identity, payload, key, terminal = engine_out.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if not key:  # not a request's message (a GovernorReply)
                self._send(router, identity, payload)
                continue
            seat, rid = key.decode().split("\x00", 1)
            if terminal:
                self.live.pop((seat, rid), None)
                self._cut.discard((seat, rid))
                self._send(router, identity, payload, terminal=True, key=(seat, rid))
            elif (seat, rid) not in self._cut:
                self._send(router, identity, payload, key=(seat, rid))
            # else: a request already cut (slow consumer, client gone): its remaining chunks
            # are dropped on purpose, so a client that resumes reading sees no seq gap, just
            # the chunks it had, then the terminal Error.

    def _reply(self, router: zmq.Socket, identity: bytes, msg) -> None:
        # An Error with a request id (not_found aside) is that request's terminal: a
        # rejection, held like any terminal when the client's queue is full.
        terminal = isinstance(msg, m.Error) and msg.request_id is not None and msg.code != "not_found"
        self._send(router, identity, encode(msg), terminal=terminal, rejection=terminal)

    def _send(self, router: zmq.Socket, identity: bytes, payload: bytes, terminal: bool = False,
              rejection: bool = False, key: tuple[str, str] | None = None) -> None:
        """Send without ever blocking. A full queue (EAGAIN: the client is not reading)
        starts the client's grace: its messages wait in order (``_backlog``) for up to
        ``slow_consumer_grace_s``, so a client that pauses on a starved machine and reads
        again loses nothing. A queue still full past the grace (or a backlog past its cap)
        cuts the client's requests with slow_consumer rather than buffering without bound
        or blocking every other client; a terminal message that cannot go out then is held
        (``_held``) and retried, so no request loses its one terminal message. Replies that
        end no request (Pong, Welcome, StatusReply, GovernorReply, id-less Errors) are
        dropped when they do not fit after a cut."""
        if identity in self._backlog:  # inside the grace: behind what waits already
            self._backlog[identity].append((payload, key, terminal, rejection))
            self._flush_backlog(router, identity)
            return
        try:
            if identity in self._held and not self._flush_held(router, identity):
                raise zmq.Again()  # keep the order: held terminals first
            router.send_multipart([identity, payload], zmq.NOBLOCK)
        except zmq.Again:
            if self.cfg.slow_consumer_grace_s > 0 and identity not in self._slow and identity not in self._held:
                self._backlog[identity] = deque([(payload, key, terminal, rejection)])
                now = time.monotonic()
                self._backlog_since[identity] = (now, now)
                return
            if terminal:
                self._hold(identity, payload, rejection)
            self._drop_client(identity, "slow_consumer")
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:  # the connection is gone: nothing can be delivered
                self._forget_held(identity)
                self._drop_client(identity, "client_gone")
            else:
                raise
        else:
            if identity in self._slow:
                self._settle(identity)

    def _flush_backlog(self, router: zmq.Socket, identity: bytes) -> None:
        """Send what waits for a client inside its grace, in order. Emptied: the grace ends
        (client.backlog_cleared). Nothing taken for slow_consumer_grace_s (a client that
        takes some restarts the clock), or past the cap: the client is cut (_cut_backlog)."""
        backlog = self._backlog[identity]
        since, progress = self._backlog_since[identity]
        sent = 0
        while backlog:
            try:
                router.send_multipart([identity, backlog[0][0]], zmq.NOBLOCK)
            except zmq.Again:
                break
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                self._forget_held(identity)  # the connection is gone: nothing can be delivered
                self._drop_client(identity, "client_gone")
                return
            backlog.popleft()
            sent += 1
        now = time.monotonic()
        if sent:
            progress = now
            self._backlog_since[identity] = (since, progress)
        if not backlog:
            del self._backlog[identity], self._backlog_since[identity]
            if identity in self._backlog_logged:
                self._backlog_logged.discard(identity)
                log.info("client.backlog_cleared", seat=self.seats.get(identity, "default"), held_s=round(now - since, 3))
            return
        if identity not in self._backlog_logged and now - since >= BACKLOG_LOG_AFTER_S:
            self._backlog_logged.add(identity)
            log.info("client.backlog", seat=self.seats.get(identity, "default"), full_s=round(now - since, 3),
                     waiting=len(backlog), grace_s=self.cfg.slow_consumer_grace_s, send_hwm=self.cfg.client_send_hwm)
        if now - progress > self.cfg.slow_consumer_grace_s or len(backlog) > self._backlog_cap:
            self._cut_backlog(identity, now - since)

    def _cut_backlog(self, identity: bytes, held_s: float) -> None:
        """The grace is over: cut the client as a slow consumer. Of what waited, requests
        that have ended keep all their messages (their chunks then their terminal, held for
        delivery); those still running lose their waiting chunks (their slow_consumer
        Error follows what the client already has, with no seq gap); other replies go."""
        backlog = self._backlog.pop(identity)
        del self._backlog_since[identity]
        self._backlog_logged.discard(identity)
        ended = {key for _, key, terminal, _ in backlog if terminal and key is not None}
        kept = [(payload, rejection) for payload, key, terminal, rejection in backlog if terminal or key in ended]
        for payload, rejection in kept:
            self._hold(identity, payload, rejection)
        self._drop_client(identity, "slow_consumer", held_s=round(held_s, 3), waiting=len(backlog))

    def _hold(self, identity: bytes, payload: bytes, rejection: bool) -> None:
        """Keep a terminal for a client that is not reading. Terminals of accepted requests
        are always kept (a cut connection gets no new ones accepted, so they are at most
        its share of the queue); rejections are kept up to ``_held_cap`` per connection,
        and past it only counted: the client gets one summary Error for them instead."""
        held = self._held.setdefault(identity, deque())
        if rejection and len(held) >= self._held_cap:
            n = self._discarded.get(identity, 0) + 1
            self._discarded[identity] = n
            if n == 1:
                log.warning("client.terminal_lost", reason="too many undelivered rejections for a client that "
                            "is not reading; the excess is counted and reported to it", held=len(held))
            return
        held.append(payload)

    def _forget_held(self, identity: bytes) -> None:
        self._backlog_logged.discard(identity)
        self._backlog.pop(identity, None)
        self._backlog_since.pop(identity, None)
        self._held.pop(identity, None)
        self._discarded.pop(identity, None)
        self._slow.discard(identity)

    def _flush_held(self, router: zmq.Socket, identity: bytes) -> bool:
        """Send held terminal messages in order, then the summary of discarded rejections;
        True when nothing is left."""
        held = self._held.get(identity)
        while held:
            try:
                router.send_multipart([identity, held[0]], zmq.NOBLOCK)
            except zmq.Again:
                return False
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                log.warning("client.terminal_lost", reason="connection gone", undelivered=len(held))
                self._forget_held(identity)
                return True
            held.popleft()
            if not held:
                log.info("client.terminal_delivered", late=True)
        discarded = self._discarded.get(identity, 0)
        if discarded:
            summary = m.Error(code="slow_consumer", request_id=None,
                              message=f"{discarded} Generate requests sent while this connection was not reading "
                                      "got no reply of their own: none of them was accepted")
            try:
                router.send_multipart([identity, encode(summary)], zmq.NOBLOCK)
            except zmq.ZMQError:
                return False
            log.info("client.terminal_delivered", late=True, discarded=discarded)
            del self._discarded[identity]
        self._held.pop(identity, None)
        self._settle(identity)
        return True

    def _settle(self, identity: bytes) -> None:
        """A cut connection is whole again once every terminal owed to it has gone out."""
        if identity in self._held or identity in self._discarded:
            return
        if any(self.live.get(k) == identity for k in self._cut):
            return  # a cut request's terminal is still on its way from the engine
        self._slow.discard(identity)

    def _drop_client(self, identity: bytes, why: str, **grace) -> None:
        """End every request of a connection with ``why`` (``slow_consumer`` or
        ``client_gone``: the terminal Error's code). Each request is cancelled once: the
        chunks still on their way from the engine would otherwise repeat the cancel (and the
        log line) for every undeliverable message until the terminal one passes."""
        if why == "slow_consumer":
            self._slow.add(identity)
        keys = [k for k, ident in self.live.items() if ident == identity and k not in self._cut]
        if keys:
            log.warning("client.dropped", reason=why, requests=[k[1] for k in keys], seat=keys[0][0], **grace)
        for key in keys:
            self._cut.add(key)
            self.worker.commands.put(CancelJob(key, why))
