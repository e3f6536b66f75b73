"""The log sink never raises: with its descriptor pointed at /dev/full
every write fails with ENOSPC; the lines are dropped and counted, and once writes work again
the first line is followed by log.lines_dropped with the count. Real descriptors throughout
(dup2 swaps what the sink's fd refers to, as a disk filling and emptying would)."""

from __future__ import annotations

import json
import logging
import os

from daemon import logs
import pytest

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)


def test_failing_writes_are_dropped_counted_and_reported(tmp_path):
    path = tmp_path / "daemon.log"
    stream = open(path, "a")
    fd = stream.fileno()
    saved = os.dup(fd)
    full = os.open("/dev/full", os.O_WRONLY)
    try:
        logs.configure_logging("json", "info", stream=stream)
        log = logs.get_logger("test")
        log.info("before.full")
        os.dup2(full, fd)  # the disk is full now
        for i in range(3):
            log.info("while.full", i=i)  # must not raise
        logging.getLogger("library").warning("a library's record")  # the stdlib route too
        assert logs.lines_dropped() == 4
        os.dup2(saved, fd)  # space again
        log.info("after.full")
    finally:
        os.close(full)
        os.close(saved)
        stream.close()
        import structlog

        structlog.reset_defaults()  # other tests in this process log to the default place
        logging.getLogger().handlers = []
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e["event"] for e in events] == ["before.full", "after.full", "log.lines_dropped"]
    assert events[2]["lines"] == 4 and events[2]["total"] == 4 and "No space left" in events[2]["error"]
    assert logs.lines_dropped() == 4
