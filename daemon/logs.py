"""structlog set-up: JSON lines for machines, a console renderer for people at a terminal.

Every event carries ``event`` (a dotted name ops can grep, listed in docs/OPERATIONS.md),
a timestamp and a level; request events also carry ``request_id`` and ``seat``.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure_logging(fmt: str = "auto", level: str = "info", stream=None) -> None:
    stream = stream or sys.stderr
    if fmt == "auto":
        fmt = "console" if stream.isatty() else "json"
    renderer = (
        structlog.dev.ConsoleRenderer(colors=False)
        if fmt == "console"
        else structlog.processors.JSONRenderer(sort_keys=False)
    )
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
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    # Libraries that log through the standard logging module (transformers, huggingface_hub)
    # write through the same renderer, so every line on stderr stays one JSON object.
    handler = logging.StreamHandler(stream)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        processor=renderer,
        foreign_pre_chain=[structlog.stdlib.add_logger_name, structlog.processors.add_log_level,
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
