"""What the scheduler tests share: a job with only the fields the scheduler reads."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class FakeJob:
    seat: str
    priority: str = "normal"
    weight: float = 1.0
    enqueued_at: float = 0.0
    name: str = ""
    tokens: int = field(default=0)
