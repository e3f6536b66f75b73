"""`councild serve --distributed` on a rank other than 0: load this rank's share of the model
and follow rank 0's engine loop until rank 0 stops (exit 0) or the group breaks (exit 70).

No socket: clients talk to rank 0 only. SIGTERM / SIGINT are logged and otherwise ignored:
rank 0's drain ends this rank with it (a follower that left first would fail rank 0's
in-flight work); the service manager's stop timeout is the backstop.
"""

from __future__ import annotations

import signal

from ..engine.model.sharding import ShardingRefused
from ..exits import EXIT_CONFIG, EXIT_SOFTWARE
from ..logs import get_logger
from .lockstep import FollowerWorker

log = get_logger("councild.group")


def run_follower(cfg, model_path: str, group) -> int:
    rank = group.rank()

    def term(signum, _frame):
        log.info("group.signal_ignored", rank=rank, signal=signal.Signals(signum).name,
                 reason="a follower stops when rank 0 stops (drain) or the group breaks")

    signal.signal(signal.SIGTERM, term)
    signal.signal(signal.SIGINT, term)
    log.info("daemon.loading", model=model_path, rank=rank, size=group.size())
    worker = FollowerWorker(cfg, model_path, group=group)
    try:
        return worker.serve()
    except (ShardingRefused, FileNotFoundError, ValueError) as exc:
        log.error("daemon.startup_failed", rank=rank, error=f"model {model_path} failed to load: {exc}",
                  exit_code=EXIT_CONFIG)
        return EXIT_CONFIG
    except Exception as exc:
        log.error("daemon.startup_failed", rank=rank, error=repr(exc), exit_code=EXIT_SOFTWARE)
        return EXIT_SOFTWARE
