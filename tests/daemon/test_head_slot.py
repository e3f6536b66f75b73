"""The head slot (daemon/engine_thread/head_slot.py): what the worker reads and governance changes, on a
real (random-weight) checkpoint, and the rule that governance holds the slot, not the worker."""

from __future__ import annotations

import ast
import pathlib
import shutil
import time

import pytest

import daemon
from daemon.engine.model.loading import load_model
from daemon.engine.types import DecodeStep
from daemon.engine_thread.governance import Governance
from daemon.engine_thread.head_slot import HeadSlot


@pytest.fixture(scope="module")
def lm(random_model_path):
    return load_model(random_model_path)


def _finish(slot: HeadSlot, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while (done := slot.finish_load()) is None:
        assert time.monotonic() < deadline, "the head's background load did not finish"
        time.sleep(0.05)
    return done


def test_startup_probe_learns_the_head_without_keeping_it(lm):
    changes = []
    slot = HeadSlot(lm, depth=2, on_change=lambda resident, nbytes: changes.append((resident, nbytes)))
    slot.load_at_startup(keep=False)
    assert slot.available and not slot.resident and slot.bytes_hint > 0
    assert slot.current_depth() == 0  # no head: nothing drafts, whatever the depth
    assert slot.nbytes == slot.bytes_hint and changes == []


@pytest.mark.quick
def test_load_install_evict_round_trip(lm):
    changes = []
    slot = HeadSlot(lm, depth=2, on_change=lambda resident, nbytes: changes.append((resident, nbytes)))
    slot.load_at_startup(keep=True)
    assert slot.resident and slot.current_depth() == 2
    head, held = slot.head, slot.head.nbytes
    assert changes == [(True, held)] and slot.nbytes == held
    assert not slot.start_load()  # one is resident already

    nbytes, freed = slot.evict()
    assert nbytes == held and not slot.resident and slot.current_depth() == 0
    assert head.unloaded  # a request still holding it sees it gone at its next cycle
    assert changes[-1] == (False, 0)
    assert slot.evict() is None

    assert slot.start_load() and slot.loading
    assert not slot.start_load()  # one load at a time
    done = _finish(slot)
    assert done.error is None and slot.head is done.head and slot.resident
    assert changes[-1] == (True, done.head.nbytes)
    assert slot.finish_load() is None  # reported once


def test_a_failed_load_is_reported_and_leaves_the_slot_empty(lm, random_model_path, tmp_path):
    slot = HeadSlot(lm, depth=1)
    slot.load_at_startup(keep=False)
    # The head's weights vanish between start-up and the governor's reload.
    moved = tmp_path / "moved"
    moved.mkdir()
    heads = [p for p in pathlib.Path(random_model_path).iterdir() if "mtp" in p.name]
    assert heads, "the random checkpoint carries a sidecar head"
    for p in heads:
        shutil.move(str(p), moved / p.name)
    try:
        assert slot.start_load()
        done = _finish(slot)
    finally:
        for p in moved.iterdir():
            shutil.move(str(p), pathlib.Path(random_model_path) / p.name)
    assert done.head is None and done.error is not None
    assert not slot.resident and slot.current_depth() == 0


def test_no_head_is_recorded_not_raised(lm, tmp_path, random_model_path):
    bare = tmp_path / "bare"
    shutil.copytree(random_model_path, bare, ignore=lambda d, names: [n for n in names if "mtp" in n])
    slot = HeadSlot(load_model(bare), depth=2)
    slot.load_at_startup(keep=True)
    assert not slot.available and not slot.resident and slot.error


def test_governance_holds_the_slot_not_the_worker():
    """Not even for annotations: the governor's hands reach the head slot and the prefix
    cache it is given, never the worker's jobs, scheduler or sockets."""
    source = (pathlib.Path(daemon.__file__).parent / "engine_thread" / "governance.py").read_text()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
            imported.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
    assert not {n for n in imported if "worker" in n.lower() or "server" in n.lower()}, imported
    assert "head_slot" in imported


def test_depth_for_follows_the_governors_table_per_batch_height(lm, random_model_path):
    """A real slot under a real Governance: batched cycles reported through after_step give
    their height's bucket a depth of its own, which depth_for returns and status shows;
    other heights follow the solo depth; a pin sets every height; no head, depth 0."""
    slot = HeadSlot(lm, depth=1)
    slot.load_at_startup(keep=True)
    # learn=False: the suite's daemons on this model leave a learned profile in the shared
    # cache folder, which would set the table this test watches being learned.
    gov = Governance(slot, {}, random_model_path, learn=False)
    assert [slot.depth_for(n) for n in (1, 2, 4, 9)] == [slot.current_depth()] * 4  # nothing measured

    def tick() -> None:
        gov.next_tick = 0.0  # a tick at this safe point, whatever the wall clock says
        gov.safe_point()

    for _ in range(12):
        k = slot.depth_for(4)
        step = DecodeStep(tokens=[7] * (4 * (k + 1)), depth=k, drafted=4 * k, accepted=4 * k,
                          accepted_mask=[True] * (4 * k), cycle_s=0.02)
        gov.after_step(step, batch=4)
        tick()
    table = {r["heights"]: r for r in gov.snapshot()["depth_by_height"]}
    assert table["3-4"]["chosen"] is not None and slot.depth_for(3) == table["3-4"]["depth"] == slot.depth_for(4)
    # Height 2 has no measurement: it borrows the nearest measured height's depth.
    assert table["2"]["chosen"] is None and slot.depth_for(2) == table["2"]["depth"] == slot.depth_for(4)
    assert slot.depth_for(1) == slot.current_depth()
    heights = gov.snapshot()["cost_model"]["heights"]
    assert next(h for h in heights if h["heights"] == "3-4")["cycles"] == 12

    ok, _ = gov.override("pin_depth", 3)
    assert ok and [slot.depth_for(n) for n in (1, 2, 3, 4, 8, 9, 32)] == [3] * 7
    assert [r["depth"] for r in gov.snapshot()["depth_by_height"]] == [3] * 5
    ok, _ = gov.override("evict_head", None)
    assert ok and not slot.resident and slot.depth_for(4) == 0
    gov.close()


def test_a_shapes_first_cycle_is_not_booked_as_its_cost(lm, random_model_path):
    """The first cycle of each shape (rows, depth) pays first-use costs (a trace, a kernel's
    first launch): Governance books its acceptance, not its cost; the next one is booked."""
    slot = HeadSlot(lm, depth=1)
    slot.load_at_startup(keep=True)
    gov = Governance(slot, {}, random_model_path, learn=False)  # as above: no learned profile
    cm = gov.gov.cost

    def cycle(depth: int, batch: int, seconds: float) -> None:
        gov.after_step(DecodeStep(tokens=[7] * batch * (depth + 1), depth=depth, drafted=batch * depth,
                                  accepted=batch * depth, accepted_mask=[True] * (batch * depth), cycle_s=seconds),
                       batch=batch)

    cycle(1, 1, 5.0)  # a first use: 250x a steady cycle
    assert cm.transition_cycles == 1 and cm.estimate(1, time.monotonic()).samples == 0
    cycle(1, 1, 0.02)
    assert cm.estimate(1, time.monotonic()).samples == 1
    cycle(1, 4, 5.0)  # another shape (height 4: bucket 3-4, index 2): its own first use
    cycle(0, 1, 5.0)
    assert cm.transition_cycles == 3 and cm.batch_estimate(2, 1, time.monotonic()).samples == 0
    cycle(1, 4, 0.04)
    assert cm.batch_estimate(2, 1, time.monotonic()).samples == 1
