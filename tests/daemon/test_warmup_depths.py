"""engine_thread/warmup.py's batch stage: with the head resident, "full" runs every batch
height at every depth the governor may give it (a depth's first cycle at a height traces the
compiled step for that shape), a depth a piece, and leaves the batch and its depth as it
found them."""

from __future__ import annotations

import pytest

mx = pytest.importorskip("mlx.core")

from daemon.engine.decoders.batch_spec import SpecBatchDecoder  # noqa: E402
from daemon.engine_thread import warmup  # noqa: E402


def test_full_warmup_steps_every_height_at_every_depth(lm, head):
    live = lambda _height: 3  # noqa: E731 - the governor's depth, which the stage must put back
    batch = SpecBatchDecoder(lm, lambda: head, live, max_rows=4)
    seen: set[tuple[int, int]] = set()
    step = batch.step

    def recording_step(*args, **kwargs):
        out = step(*args, **kwargs)
        seen.add((len(batch), batch.last_depth))
        return out

    batch.step = recording_step
    events = []
    out = warmup.run("full", lm, chunk=64, head=head, depths=[1, 2], batch=batch, max_rows=4,
                     emit=lambda name, **fields: events.append((name, fields)))
    (fields,) = [f for n, f in events if n == "warmup.batch"]
    assert fields["heights"] == [2, 3, 4] and fields["depths"] == [0, 1, 2]
    assert {(h, d) for h in (2, 3, 4) for d in (0, 1, 2)} <= seen
    assert len(batch) == 0 and batch.depth_for is live and out["batch"] > 0


def test_light_warmup_keeps_the_batch_depth(lm, head):
    batch = SpecBatchDecoder(lm, lambda: head, lambda _height: 1, max_rows=4)
    events = []
    warmup.run("light", lm, chunk=64, head=head, depths=[1, 2], batch=batch, max_rows=4,
               emit=lambda name, **fields: events.append((name, fields)))
    (fields,) = [f for n, f in events if n == "warmup.batch"]
    assert fields["heights"] == [2] and fields["depths"] == []
