"""The status reply: what `councild status`, /metrics and the periodic ``stats`` log read.

Built by the socket loop from the engine's last published snapshot (engine_thread/status_snapshot.py)
and its own counts (in-flight requests, clients, refusals), so answering never waits on
or touches the engine thread.

``StatusReplies`` is a part of ``Server`` (server.py) kept in its own file.
"""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path

import daemon
from protocol import messages as m

from ..logs import get_logger, lines_dropped
from ..engine_thread.stats import Tallies

log = get_logger("councild.server")


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(timespec="milliseconds")


class StatusReplies:
    """Building the status reply (a mixin of Server)."""

    def status_reply(self) -> m.StatusReply:
        snap = self.worker.read_snapshot()
        now_wall = time.time()
        return m.StatusReply(
            server=f"councild {daemon.__version__}",
            model=snap.model or Path(self.model_path).name,
            uptime_s=round(time.monotonic() - self.started, 3),
            active=len(snap.active),
            queued=sum(snap.queued.values()),
            detail={
                "pid": os.getpid(),
                "endpoint": self.endpoint,
                "model_type": snap.model_type,
                "draining": self.draining_since is not None,
                "state": ("loading" if not (snap.ready and self.accepting) else "draining" if self.draining_since is not None
                          else "serving"),
                "load_progress": snap.load_progress,
                "head_resident": snap.head_resident,
                "head_bytes": snap.head_bytes,
                "exact_decode": snap.exact_decode,
                "kernels": {"name": snap.kernels, "reason": snap.kernels_reason},
                "recurrence": snap.recurrence,
                "linears": snap.linears,
                "decode_path": snap.decode_path,
                "batch_decode_path": snap.batch_decode_path,
                "depth": snap.depth,
                "in_flight": len(self.live),
                "active_requests": snap.active,
                "seats": snap.seats,
                "tokens_total": snap.tokens_total,
                "prefill_tokens_total": snap.prefill_tokens_total,
                # The engine step: budget, its use (decode and prefill tokens per iteration),
                # and the prefill queue (OPERATIONS.md, "The engine step").
                "step": snap.step,
                # How many requests decode at once, who sets it and why (scheduler.max_active).
                "rows": snap.rows,
                "warmup": snap.warmup,
                "warming": snap.warming,
                "prefix_cache": snap.prefix_cache,
                "recent_tokens_per_s": round(snap.recent_tokens_per_s, 2),
                # Heard from within heartbeat_timeout_s (a client that left counts until then:
                # a ROUTER socket is not told when a peer goes), and those with work in flight.
                "clients": len(self.last_seen),
                "clients_with_work": len(set(self.live.values())),
                "slow_clients": len(self._slow),
                "log_lines_dropped": lines_dropped(),
                "memory": snap.memory,
                "governor": snap.governor,
                **({"group": snap.group} if snap.group else {}),
                "stats": self._stats(snap),
                # Wall-clock times (UTC, ISO 8601 and Unix seconds), for logs and dashboards.
                "time": {
                    "now": _iso(now_wall), "now_unix": round(now_wall, 3),
                    "started_at": _iso(self.started_wall), "started_at_unix": round(self.started_wall, 3),
                },
            },
        )

    def _stats(self, snap) -> dict:
        """The engine's tallies, with the requests this loop refused merged into the outcomes."""
        stats = dict(snap.stats) if snap.stats else Tallies().to_dict()
        requests = {seat: dict(v) for seat, v in stats.get("requests", {}).items()}
        for (seat, code), n in self.rejected.items():
            by = requests.setdefault(seat, {})
            by[code] = by.get(code, 0) + n
        stats["requests"] = requests
        return stats

    def _log_stats(self) -> None:
        """The periodic ``stats`` event: what /metrics shows, for shops that only read logs."""
        d = self.status_reply().detail
        st = d["stats"]
        log.info("stats", active=len(d["active_requests"]), queued=sum(s.get("queued", 0) for s in d["seats"].values()),
                 in_flight=d["in_flight"], tokens_total=d["tokens_total"], tokens_per_s=d["recent_tokens_per_s"],
                 depth=d["depth"], head_resident=d["head_resident"], memory=d["memory"],
                 pressure=d["governor"].get("pressure"), requests=st["requests"], drafted=st["drafted"],
                 accepted=st["accepted"], ttft_count=st["ttft_seconds"]["count"],
                 ttft_mean_s=round(st["ttft_seconds"]["sum"] / max(1, st["ttft_seconds"]["count"]), 4),
                 clients=d["clients"])
