"""structlog set-up: JSON lines for machines, a console renderer for people at a terminal.

Every event carries ``event`` (a dotted name ops can grep, listed in docs/OPERATIONS.md),
a timestamp and a level; request events also carry ``request_id`` and ``seat``.

Logging can never take the daemon down: every line goes through one ``LogSink`` that
catches a failing write (ENOSPC on a full disk, EIO, EPIPE, a closed stream), drops that
line and counts it. Serving goes on; the count is in ``councild status``
(``log_lines_dropped``), and the first line that gets through again is followed by a
``log.lines_dropped`` event saying how many were lost and why.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


class LogSink:
    """Writes whole lines, never raises. Where the stream has a file descriptor the line
    goes out with os.write (no userspace buffer, so a failed write leaves nothing behind to
    come out garbled later); otherwise through the stream's write/flush."""

    def __init__(self, stream):
        self.stream = stream
        try:
            self._fd: int | None = stream.fileno()
        except (AttributeError, OSError, ValueError):  # StringIO and friends
            self._fd = None
        self._lock = threading.RLock()
        self.dropped = 0  # lines lost since start-up
        self._unreported = 0  # lines lost since the last log.lines_dropped
        self._last_error = ""
        self._mid_line = False  # a write failed part-way: start the next line afresh

    def write_line(self, line: str) -> None:
        with self._lock:
            ok = self._write(("\n" if self._mid_line else "") + line + "\n")
            if not ok:
                self.dropped += 1
                self._unreported += 1
                return
            lost, self._unreported = self._unreported, 0
            error = self._last_error
        if lost:  # outside the lock's write: this goes through write_line like any event
            get_logger("councild.logs").warning("log.lines_dropped", lines=lost, total=self.dropped, error=error)

    def _write(self, text: str) -> bool:
        try:
            if self._fd is None:
                self.stream.write(text)
                self.stream.flush()
                return True
            data = text.encode("utf-8", "backslashreplace")
            while data:
                n = os.write(self._fd, data)
                self._mid_line = True
                data = data[n:]
            self._mid_line = False
            return True
        except Exception as exc:  # noqa: BLE001 - whatever the sink raises, the caller must not see it
            self._last_error = f"{type(exc).__name__}: {exc}"
            return False


class _SinkLogger:
    """structlog's logger interface (one method per level), writing through the sink."""

    def __init__(self, sink: LogSink):
        self._sink = sink

    def msg(self, message: str) -> None:
        self._sink.write_line(message)

    log = debug = info = warn = warning = err = error = critical = exception = fatal = failure = msg


class _SinkHandler(logging.Handler):
    """The standard logging module's records, rendered by the formatter, into the sink."""

    def __init__(self, sink: LogSink):
        super().__init__()
        self._sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
        except Exception:  # noqa: BLE001 - logging's own convention for a record that will not format
            self.handleError(record)
            return
        self._sink.write_line(line)


SINK: LogSink | None = None


def _library_event(_logger, _method, event_dict: dict) -> dict:
    """A library's log record becomes the event ``library.log`` with its text under
    ``message``: event names stay a small fixed set that ops can count and alert on, not
    one per library sentence."""
    return {"event": "library.log", "message": event_dict.pop("event", ""), **event_dict}


def lines_dropped() -> int:
    return SINK.dropped if SINK is not None else 0


def configure_logging(fmt: str = "auto", level: str = "info", stream=None) -> None:
    global SINK
    stream = stream or sys.stderr
    if fmt == "auto":
        try:
            fmt = "console" if stream.isatty() else "json"
        except (OSError, ValueError):
            fmt = "json"
    renderer = (
        structlog.dev.ConsoleRenderer(colors=False)
        if fmt == "console"
        else structlog.processors.JSONRenderer(sort_keys=False)
    )
    SINK = LogSink(stream)
    sink = SINK
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=lambda *_args: _SinkLogger(sink),
        cache_logger_on_first_use=False,
    )
    # Libraries that log through the standard logging module (transformers, huggingface_hub)
    # write through the same renderer and the same sink, so every line on stderr stays one
    # JSON object and a full disk costs them a counted line too, never an exception.
    handler = _SinkHandler(sink)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        processor=renderer,
        foreign_pre_chain=[_library_event, structlog.stdlib.add_logger_name, structlog.processors.add_log_level,
                           structlog.processors.TimeStamper(fmt="iso", utc=True)],
    ))
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(max(_LEVELS[level], logging.WARNING))
    # transformers prints through a handler of its own ("[transformers] ..." lines) from the
    # moment it is imported; keep its import quiet until route_library_logs takes it over.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def route_library_logs() -> None:
    """Hand transformers' log records to the root handler above (called before the model
    load, where it warns about config keys): they become JSON events with a ``logger``."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    hf_logging.set_verbosity_warning()


def get_logger(name: str = "councild"):
    return structlog.get_logger(name)
