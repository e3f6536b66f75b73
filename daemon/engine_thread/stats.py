"""Cumulative counters and latency histograms the engine thread keeps for status readers.

Plain Python, no metrics library: the daemon publishes ``Tallies.to_dict()`` in its status
snapshot (``detail["stats"]``), and front ends turn it into what they serve (the HTTP front's
/metrics exposes it through prometheus-client; the periodic ``stats`` log event prints it).
Counters only ever rise while the daemon runs, as Prometheus counters must.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# Seconds. TTFT spans queueing and prefill; inter-token latency one decode cycle's share.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


@dataclass
class Histogram:
    """Prometheus-style: counts[i] observations <= buckets[i] (not cumulative here; the
    exporter accumulates), plus the overflow, the sum and the count."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += n
        self.sum += value * n
        self.count += n

    def to_dict(self) -> dict:
        return {"buckets": list(self.buckets), "counts": list(self.counts), "sum": round(self.sum, 6), "count": self.count}


@dataclass
class Tallies:
    # seat -> outcome ("stop", "length", "cancelled", or an error code) -> requests ended
    requests: dict[str, dict[str, int]] = field(default_factory=dict)
    drafted: int = 0
    accepted: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    inter_token: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))

    def finished(self, seat: str, outcome: str) -> None:
        by = self.requests.setdefault(seat, {})
        by[outcome] = by.get(outcome, 0) + 1

    def to_dict(self) -> dict:
        return {
            "requests": {s: dict(v) for s, v in self.requests.items()},
            "drafted": self.drafted,
            "accepted": self.accepted,
            "ttft_seconds": self.ttft.to_dict(),
            "inter_token_seconds": self.inter_token.to_dict(),
        }


# Fractions of scheduler.step_token_budget one engine iteration used (it can pass 1: a
# chunk always runs when a prompt waits, and a big batch may spend it all on decode).
STEP_USE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0)


@dataclass
class StepUse:
    """Per engine iteration (worker._step): tokens its decode phase and its prefill phase
    forwarded, against the token budget. Counters rise; ``last`` is the latest iteration."""

    steps: int = 0
    decode_tokens: int = 0
    prefill_tokens: int = 0
    steps_with_prefill: int = 0
    use: Histogram = field(default_factory=lambda: Histogram(STEP_USE_BUCKETS))
    last: dict = field(default_factory=dict)

    def record(self, decode: int, prefill: int, budget: int) -> None:
        self.steps += 1
        self.decode_tokens += decode
        self.prefill_tokens += prefill
        self.steps_with_prefill += prefill > 0
        self.use.observe((decode + prefill) / budget)
        self.last = {"decode_tokens": decode, "prefill_tokens": prefill, "budget": budget}

    def to_dict(self) -> dict:
        return {"steps": self.steps, "decode_tokens": self.decode_tokens, "prefill_tokens": self.prefill_tokens,
                "steps_with_prefill": self.steps_with_prefill, "budget_use": self.use.to_dict(), "last": self.last}
