"""The start-up cost probes' timing loop (batched_prefill.together_cost_ratio,
mixed_forward.mixed_cost_ratio): a ratio of two ways of doing the same work, timed in pairs.

Each timed forward is a piece of its own (engine/pieces.py): a pause falls between two
timings, never inside one, so a request that arrives mid-probe waits for one forward, not a
pair (the pairs' pieces were 250-290 ms on this CPU and 19-84 ms on an H100, where a council's
first prompts waited for one). The two halves of a pair stay next to each other in the
engine's time, with at most the serving between two pieces in between."""

from __future__ import annotations

import statistics
from collections.abc import Callable

from ..pieces import pause


def paired_median(a: Callable[[], float], b: Callable[[], float], reps: int) -> float:
    """The median of ``reps`` ratios a() / b(), each function's seconds, after one untimed
    run of each (first-use compiles and allocations)."""
    for fn in (b, a):
        fn()
        pause()
    ratios = []
    for _ in range(reps):
        num = a()
        pause()
        ratios.append(num / b())
        pause()
    return statistics.median(ratios)
