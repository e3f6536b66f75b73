"""What one request has received so far; the sync Stream and the AsyncStream add only how
they wait for the next message."""

from __future__ import annotations

from typing import Any

from .. import messages as m
from .errors import DaemonError, error_from_wire


class StreamState:
    """One request's Accepted, Tokens (in seq order), and its terminal Done or error."""

    def __init__(self, request: m.Generate):
        self.request = request
        self.request_id: str = request.request_id
        self.accepted: m.Accepted | None = None
        self.done: m.Done | None = None
        self.error: BaseException | None = None
        self.token_ids: list[int] = []
        self.chunks: list[str] = []
        # Thinking text streamed apart from the answer (PROTOCOL.md 4.1); iteration yields
        # the answer's chunks only.
        self.reasoning_chunks: list[str] = []
        self.cancel_requested = False
        self._next_seq = 0

    @property
    def finished(self) -> bool:
        """True once the terminal message (Done or Error) has been consumed, or the stream failed."""
        return self.done is not None or self.error is not None

    @property
    def text(self) -> str:
        """The full text once done (Done.text, after stop strings), else the chunks so far."""
        if self.done is not None:
            return self.done.text
        return "".join(self.chunks)

    @property
    def reasoning(self) -> str:
        """The thinking text: Done.reasoning once done, else the reasoning chunks so far."""
        if self.done is not None:
            return self.done.reasoning
        return "".join(self.reasoning_chunks)

    def _deliver(self, item: Any) -> None:
        """Queue a routed message (or the exception that failed the connection)."""
        raise NotImplementedError

    def _apply(self, msg: Any) -> str | None:
        """Consume one routed message; returns a text chunk to hand out, raises on Error."""
        if isinstance(msg, m.Tokens):
            if msg.seq != self._next_seq:
                self.error = DaemonError(
                    "internal", f"stream out of order: expected seq {self._next_seq}, got {msg.seq}", request_id=self.request_id
                )
                raise self.error
            self._next_seq += 1
            self.token_ids.extend(msg.token_ids)
            if msg.reasoning:
                self.reasoning_chunks.append(msg.reasoning)
            if msg.text:
                self.chunks.append(msg.text)
                return msg.text
            return None
        if isinstance(msg, m.Accepted):
            self.accepted = msg
            return None
        if isinstance(msg, m.Done):
            self.done = msg
            return None
        if isinstance(msg, m.Error):
            self.error = error_from_wire(msg)
            raise self.error
        if isinstance(msg, BaseException):  # the client failed every pending stream
            self.error = msg
            raise msg
        return None  # pragma: no cover - the router only queues the types above

    def __repr__(self) -> str:
        state = "done" if self.done else "failed" if self.error else "pending"
        return f"<{type(self).__name__} {self.request_id} {state} chunks={len(self.chunks)}>"
