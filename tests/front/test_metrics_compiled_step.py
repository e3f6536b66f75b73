"""front/metrics.py: whether one row's and a batch's steps run compiled, from the status detail."""

from __future__ import annotations

from front.metrics import DaemonCollector
from protocol import StatusReply


def _compiled_step(detail: dict) -> dict[str, float] | None:
    c = DaemonCollector()
    c.status = StatusReply(server="councild", model="m", uptime_s=1.0, active=0, queued=0, detail=detail)
    for family in c.collect():
        if family.name == "councild_compiled_step":
            return {s.labels["rows"]: s.value for s in family.samples}
    return None


def test_the_gauge_says_which_steps_run_compiled():
    assert _compiled_step({"decode_path": "compiled", "batch_decode_path": "compiled"}) == {"one": 1.0, "batch": 1.0}
    assert _compiled_step({"decode_path": "compiled", "batch_decode_path": "eager: plain batch B=2, array 0: differs"}) \
        == {"one": 1.0, "batch": 0.0}
    assert _compiled_step({"decode_path": "eager: not requested"}) == {"one": 0.0, "batch": 0.0}
    assert _compiled_step({}) is None  # an older daemon's status: no series rather than a wrong 0
