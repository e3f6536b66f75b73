"""How many requests decode at once, the daemon's side: the config ("auto", an int, the
ceiling), the scheduler's live limit (lowering it drops nothing), and one row's cache bytes
at its context counted from the model's shapes (governor/row_limit.py reads them)."""

from __future__ import annotations

import pytest

from daemon.config import AUTO_START_HEIGHT, ConfigError, SchedulerConfig, load_config
from daemon.engine_thread.scheduler import Scheduler
from scheduler_helpers import FakeJob

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)


def test_max_active_is_the_governors_by_default_and_an_int_pins_it():
    sc = load_config(None, env={}).scheduler
    assert sc.max_active == "auto" and sc.height_auto and sc.max_active_ceiling == 8
    assert sc.batch_rows == 8 and sc.start_height == AUTO_START_HEIGHT == 4
    sc = load_config(None, {"scheduler": {"max_active": 4}}, env={}).scheduler
    assert sc.max_active == 4 and not sc.height_auto and sc.batch_rows == 4 and sc.start_height == 4
    sc = load_config(None, {"scheduler": {"max_active": 6, "max_active_ceiling": 2}}, env={}).scheduler
    assert not sc.height_auto and sc.batch_rows == 6 and sc.start_height == 6  # a pin ignores the ceiling
    sc = load_config(None, {"scheduler": {"max_active": "auto", "max_active_ceiling": 3}}, env={}).scheduler
    assert sc.batch_rows == 3 and sc.start_height == 3  # the start never passes the ceiling


@pytest.mark.parametrize("table, needle", [
    ({"max_active": "autox"}, '`$.scheduler.max_active` (an int from 1 to 256, or "auto"'),
    ({"max_active": 0}, "Expected `int` >= 1 - at `$.scheduler.max_active`"),
    ({"max_active": 300}, "Expected `int` <= 256 - at `$.scheduler.max_active`"),
    ({"max_active": 2.5}, '`$.scheduler.max_active` (an int from 1 to 256, or "auto"'),
    ({"max_active_ceiling": 0}, "Expected `int` >= 1 - at `$.scheduler.max_active_ceiling`"),
    ({"max_active_ceiling": 1000}, "Expected `int` <= 256 - at `$.scheduler.max_active_ceiling`"),
], ids=["word", "zero", "huge", "float", "ceiling-zero", "ceiling-huge"])
def test_bad_row_settings_are_refused_with_the_key(table, needle):
    with pytest.raises(ConfigError) as err:
        load_config(None, {"scheduler": table}, env={})
    assert needle in str(err.value), str(err.value)


def test_the_live_limit_admits_up_to_it_and_lowering_it_drops_nothing():
    s = Scheduler(SchedulerConfig(max_active="auto", max_active_ceiling=8))
    assert s.max_active == 4
    jobs = [FakeJob("a", name=f"j{i}") for i in range(7)]
    for j in jobs:
        s.submit(j)
    assert len(s.admit()) == 4 and s.queued_count() == 3
    s.set_max_active(6)
    assert len(s.admit()) == 2 and len(s.active) == 6
    # Down to 2: the six running keep running (they finish), nobody new gets in until below 2.
    s.set_max_active(2)
    assert s.admit() == [] and len(s.active) == 6 and not s.parked
    for j in list(s.active)[:5]:
        s.remove(j)
    assert s.admit() == [jobs[6]] and len(s.active) == 2
    # Reload: a pinned int applies at once; back to "auto" starts from its start height.
    s.reconfigure(SchedulerConfig(max_active=3))
    assert s.max_active == 3
    s.reconfigure(SchedulerConfig(max_active="auto", max_active_ceiling=2))
    assert s.max_active == 2
    s.set_max_active(2)
    s.reconfigure(SchedulerConfig(max_active="auto", max_active_ceiling=8))
    assert s.max_active == 2  # the governor's limit stays under "auto"


def test_a_rows_cache_bytes_match_a_real_cache_at_that_context(tiny):
    import mlx.core as mx

    from daemon.engine.caches.cache_size import row_cache_bytes

    for n in (5, 300):  # one and two of the KV cache's 256-position steps
        cache = tiny.make_cache()
        mx.eval(tiny.hidden(mx.array([list(range(1, n + 1))]), cache))
        assert row_cache_bytes(tiny, n) == sum(c.nbytes for c in cache)
    # The KV part grows with the context; the GatedDeltaNet state does not.
    assert row_cache_bytes(tiny, 4096) > row_cache_bytes(tiny, 300)
