"""The Governor runtime on fakes: sampling, logging, the cost loop, overrides, traces."""

from __future__ import annotations

import io
import json

import structlog

from governor.config import GovernorConfig
from governor.fakes import (
    FakeClock,
    FakeLoad,
    FakeMemoryProbe,
    FakeMlxProbe,
    RaisingProbe,
    RecordingLogger,
    SimEngine,
)
from governor.replay import replay
from governor.runtime import Governor
from governor.types import ClearCache, CycleTelemetry, EvictHead, LoadHead, SetDepth, SetHeightDepth, ShedAdmissions, action_name
import pytest

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)

GiB, MiB = 1 << 30, 1 << 20


def make(cfg=None, **kw):
    clock, mem, load, logger = FakeClock(0.0), FakeMemoryProbe(), FakeLoad(), RecordingLogger()
    kw.setdefault("head_resident", True)
    gov = Governor(cfg or GovernorConfig(), clock=clock, memory_probes=[mem], load=load, head_bytes=850 * MiB,
                   logger=logger, **kw)  # fmt: skip
    return gov, clock, mem, load, logger


def test_tick_returns_actions_and_logs_one_event_per_decision():
    gov, clock, mem, load, logger = make()
    assert gov.tick() == []
    assert logger.events[-1][:2] == ("debug", "governor.decision")  # holds are debug
    mem.level, mem.available_bytes = "critical", 100 * MiB
    clock.advance(0.25)
    acts = gov.tick()
    assert acts == [SetDepth(0), EvictHead(), ClearCache(), ShedAdmissions(True, 5.0)]
    infos = [e for e in logger.events if e[0] == "info"]
    assert [e[2]["decision"] for e in infos] == ["depth", "evict_head", "clear_cache", "shed_admissions"]
    ev = infos[1][2]
    assert ev["pressure"] == "critical" and ev["available_bytes"] == 100 * MiB and ev["sentence"]
    assert ev["actions"] == ["SetDepth(0)", "EvictHead", "ClearCache", "ShedAdmissions(on)"]
    assert gov.shedding and gov.depth == 0


def test_default_logger_is_councild_governor_structlog():
    gov, clock, mem, *_ = make()
    gov.log = structlog.get_logger("councild.governor")
    mem.level = "critical"
    with structlog.testing.capture_logs() as logs:
        gov.tick()
    assert logs and all(e["event"] == "governor.decision" for e in logs)
    assert any(e.get("decision") == "evict_head" for e in logs)


def test_probes_combine_worst_level_and_least_headroom_and_survive_raising():
    clock = FakeClock(0.0)
    a, b = FakeMemoryProbe("normal", 12 * GiB), FakeMemoryProbe("warn", 20 * GiB)
    off = FakeMemoryProbe("critical", 1, available=False)  # unavailable: ignored
    gov = Governor(clock=clock, memory_probes=[a, RaisingProbe(), off, b],
                   mlx_probe=FakeMlxProbe(active=10 * GiB, recommended=18 * GiB), logger=RecordingLogger())  # fmt: skip
    raw = gov.observe()
    assert raw["pressure"] == "warn"
    assert raw["available_bytes"] == 8 * GiB  # MLX's working set is the tightest
    gov.tick()  # and a raising probe does not take the tick down
    assert gov.last_observation.pressure == "warn"


def test_no_memory_probe_means_normal_and_unknown_headroom():
    gov = Governor(clock=FakeClock(), logger=RecordingLogger())
    raw = gov.observe()
    assert raw["pressure"] == "normal" and raw["available_bytes"] is None


def test_depth_follows_cost_as_load_rises_at_constant_acceptance():
    """Acceptance fixed at 0.85; the council's load makes the wide verify dearer. Quiet:
    speculation pays. Loaded: a depth-1 cycle costs more than its 1.85 tokens are worth."""
    gov, clock, mem, load, _ = make()

    def cost(k, ld):
        return 0.05 * (1.0 + ld) * (1.0 + k * (0.15 + 1.0 * ld))

    eng = SimEngine(gov, cost, acceptance=0.85, load_fn=lambda: load.cpu_load)
    load.cpu_load = 0.1
    eng.run(120.0, clock)
    assert gov.depth >= 1
    load.cpu_load = 1.2
    eng.run(180.0, clock)
    assert gov.depth == 0
    tail = [a for t, a in eng.history if t > clock.t - 60 and isinstance(a, SetDepth)]
    assert all(a.depth <= 1 for a in tail)  # at most the occasional probe
    load.cpu_load = 0.1
    eng.run(120.0, clock)
    assert gov.depth >= 1
    snap = gov.snapshot()
    assert snap["cost_model"]["depths"][0]["source"] == "measured"
    json.dumps(snap)  # the status reply carries it as is


def test_snapshot_keeps_a_bounded_ring_of_the_decisions_logged_at_info():
    from governor.runtime import RECENT_DECISIONS

    gov, clock, mem, load, logger = make()
    gov.tick()  # a hold: logged at debug, not kept
    assert gov.snapshot()["recent_decisions"] == []
    mem.level, mem.available_bytes = "critical", 100 * MiB
    clock.advance(0.25)
    gov.tick()
    clock.advance(2.0)
    recent = gov.snapshot()["recent_decisions"]
    infos = [e[2] for e in logger.events if e[0] == "info"]
    assert [d["decision"] for d in recent] == [e["decision"] for e in infos]
    assert all(d["sentence"] and d["age_s"] == 2.0 for d in recent)
    assert recent[1]["actions"] == ["SetDepth(0)", "EvictHead", "ClearCache", "ShedAdmissions(on)"]
    for _ in range(RECENT_DECISIONS):  # overrides decide at once, each logged at info
        clock.advance(0.25)
        gov.override("pin_depth", 2)
        gov.override("auto")
    recent = gov.snapshot()["recent_decisions"]
    assert len(recent) == RECENT_DECISIONS and recent[-1]["age_s"] == 0.0
    assert [d["age_s"] for d in recent] == sorted((d["age_s"] for d in recent), reverse=True)


def test_override_decides_at_once_and_releases():
    gov, clock, *_ = make()
    # The pin holds at every batch height too.
    assert gov.override("pin_depth", 3) == [SetDepth(3)] + [SetHeightDepth(b, 3) for b in range(1, 5)]
    assert all(gov.depth_for(n) == 3 for n in (1, 2, 3, 4, 8, 16))
    assert gov.snapshot()["override"] == "pin_depth" and gov.snapshot()["pin_depth"] == 3
    clock.advance(1.0)
    acts = gov.override("evict_head")
    assert acts == [SetDepth(0), EvictHead()]
    gov.note_head(resident=False)
    clock.advance(1.0)
    gov.override("auto")
    assert gov.state.override == "auto"


def test_loading_head_is_not_loaded_twice():
    cfg = GovernorConfig(restore_window_s=1.0, warn_clear_s=1.0, min_reload_gap_s=0.0)
    gov, clock, *_ = make(cfg, head_resident=False)
    gov.record_cycle(CycleTelemetry(depth=0, cycle_s=0.05))
    acts = []
    for _ in range(20):
        acts += gov.tick()
        clock.advance(0.25)
    assert acts.count(LoadHead()) == 1
    gov.note_head(loading=True)
    for _ in range(20):
        acts += gov.tick()
        clock.advance(0.25)
    gov.note_head(loading=False, resident=True)
    for _ in range(20):
        acts += gov.tick()
        clock.advance(0.25)
    assert acts.count(LoadHead()) == 1


def test_trace_replays_to_the_same_decisions(tmp_path):
    path = tmp_path / "trace.jsonl"
    clock, mem, load = FakeClock(0.0), FakeMemoryProbe(), FakeLoad()
    gov = Governor(GovernorConfig(), clock=clock, memory_probes=[mem], load=load, head_resident=True,
                   head_bytes=850 * MiB, trace=str(path), logger=RecordingLogger(), profile={"acceptance": [0.8]})  # fmt: skip
    eng = SimEngine(gov, lambda k, ld: 0.05 * (1 + 0.3 * k * (1 + ld)), load_fn=lambda: load.cpu_load)
    eng.run(40.0, clock)
    mem.level = "critical"
    eng.run(5.0, clock)
    mem.level = "normal"
    eng.run(10.0, clock)
    eng.apply(gov.override("pin_depth", 2))  # head is out: the pin loads it
    eng.run(10.0, clock)
    eng.apply(gov.override("auto"))
    load.cpu_load = 0.9
    eng.run(60.0, clock)
    gov.close()
    live = [(round(t, 9), action_name(a)) for t, a in eng.history]
    rows = replay(str(path))
    replayed = [(round(r["t"], 9), a) for r in rows for a in r["actions"]]
    assert replayed == live
    assert ("LoadHead" in dict(map(reversed, live))) and ("EvictHead" in dict(map(reversed, live)))


def test_trace_to_a_stream_has_config_obs_and_cycles():
    buf = io.StringIO()
    clock = FakeClock(5.0)
    gov = Governor(clock=clock, trace=buf, logger=RecordingLogger())
    gov.record_cycle(CycleTelemetry(depth=0, cycle_s=0.05))
    gov.tick()
    kinds = [json.loads(line)["kind"] for line in buf.getvalue().splitlines()]
    assert kinds == ["config", "cycle", "obs"]
    assert all(json.loads(line)["t"] == 5.0 for line in buf.getvalue().splitlines())


def test_reconfigure_takes_new_settings_live_and_replays():
    import io

    from governor import Governor, GovernorConfig
    from governor.replay import replay

    clock = [0.0]
    trace = io.StringIO()
    gov = Governor(GovernorConfig(), clock=lambda: clock[0], head_resident=True, head_bytes=1 << 20, trace=trace)
    gov.tick()
    changed = gov.reconfigure(GovernorConfig(tick_s=0.5, depth_margin=0.2))
    assert changed == ["depth_margin", "tick_s"] and gov.cfg.depth_margin == 0.2 and gov.cost.cfg.depth_margin == 0.2
    # A smaller depth range rebuilds the cost model's tables and clamps the depth.
    gov.reconfigure(GovernorConfig(max_depth=1, initial_depth=1))
    assert gov.depth <= 1 and len(gov.cost._cost) == 2
    clock[0] = 1.0
    gov.tick()
    rows = replay(trace.getvalue().splitlines(), all_ticks=True)
    assert len(rows) == 2 and all(r["depth"] <= 1 for r in rows[1:])


# ---------------------------------------------------------------- tuned profile start, decode clock

# This CPU (bench run 6): a depth-k cycle costs ~(1 + 0.97 k) serial steps of 10 ms.
def _slow_cpu(k, ld):
    return 0.010 * (1.0 + 0.97 * k)


SLOW_PROFILE = {"cost_s": {str(k): _slow_cpu(k, 0.0) for k in range(5)}, "acceptance": [0.79, 0.7, 0.6, 0.5]}


def test_tuned_profile_start_is_its_best_depth_and_is_logged_once():
    gov, clock, mem, load, logger = make(profile=SLOW_PROFILE, initial_depth=1)
    assert gov.depth == 0
    starts = [e for e in logger.events if e[2].get("decision") == "start_depth"]
    assert len(starts) == 1 and logger.events[0] is starts[0]
    level, event, f = starts[0]
    assert (level, event) == ("info", "governor.decision")
    assert f["depth"] == 0 and f["depth_from"] == 1 and f["depth_to"] == 0 and f["actions"] == []
    assert f["sentence"].startswith("tuned profile: no depth beats serial by 10%: best depth 1 scores")
    assert gov.start_reason == {k: v for k, v in f.items() if k not in ("depth", "actions")}
    # No profile: the configured depth, and no start event (profile.absent says so already).
    gov2, *_, logger2 = make(initial_depth=1)
    assert gov2.depth == 1 and gov2.start_reason is None and not logger2.events
    # A profile in which depth 2 pays: start there.
    fast = {"cost_s": {"0": 0.010, "1": 0.0115, "2": 0.013}, "acceptance": [0.9, 0.85]}
    gov3, *_ = make(profile=fast, initial_depth=1)
    assert gov3.depth == 2
    # Head not resident: 0, whatever the profile says.
    gov4, *_ = make(profile=fast, initial_depth=1, head_resident=False)
    assert gov4.depth == 0 and gov4.start_reason["sentence"] == "head not resident: serial"


def test_profile_start_at_zero_stays_at_zero_on_the_machine_it_describes():
    """Started at 0 by the profile, on a machine where the profile is right: depth 1 is
    visited only by probes (measured, not better, left), never moved to."""
    gov, clock, mem, load, logger = make(profile=SLOW_PROFILE, initial_depth=1)
    eng = SimEngine(gov, _slow_cpu, acceptance=0.79, load_fn=lambda: load.cpu_load)
    eng.run(120.0, clock)
    assert gov.depth == 0
    decisions = [e[2]["decision"] for e in logger.events if e[0] == "info"]
    assert "depth" not in decisions  # no move, only probes and their ends
    assert decisions.count("probe") == decisions.count("probe_end") <= 4
    time_at = {0: 0.0, 1: 0.0}
    depth, last = 0, clock.t - 120.0
    for t, a in eng.history:
        if isinstance(a, SetDepth):
            time_at[depth] = time_at.get(depth, 0.0) + t - last
            depth, last = a.depth, t
    time_at[depth] = time_at.get(depth, 0.0) + clock.t - last
    assert time_at[0] > 0.9 * 120.0


def test_bursts_after_idle_gaps_do_not_start_with_a_probe():
    """A council's turn-taking: 5 s bursts, 35 s idle. Staleness and probe timing run on the
    decode clock, so the idle gaps neither make every burst's estimates stale nor make a probe
    due at each burst's start (with wall-clock timing, bench run 1 probed in 9 of its bursts'
    first seconds, 41% of its time)."""
    clock = FakeClock(0.0)
    probes: list[float] = []

    class Logger(RecordingLogger):
        def info(self, event, **kw):
            super().info(event, **kw)
            if kw.get("decision") == "probe":
                probes.append(clock.t)

    load = FakeLoad()
    gov = Governor(GovernorConfig(probe_interval_s=30.0, stale_after_s=30.0), clock=clock, load=load,
                   memory_probes=[FakeMemoryProbe()], head_resident=True, head_bytes=850 * MiB, logger=Logger())
    period, burst = 40.0, 5.0
    eng = SimEngine(gov, _slow_cpu, acceptance=0.79, load_fn=lambda: load.cpu_load,
                    streams_fn=lambda: 1 if clock.t % period < burst else 0)  # fmt: skip
    eng.run(12 * period, clock)
    assert abs(gov.cost.decode_s - 12 * burst) < 0.5
    # 60 s of decoding: one or two probes, where wall-clock timing would make one due at
    # almost every burst's start (the interval passes in every 35 s gap).
    assert 1 <= len(probes) <= 2
    assert all(t % period >= 1.0 for t in probes), probes  # none in a burst's first second
    # Depth 1, decoded in the last burst, is still fresh 35 s of idling later (on the wall
    # clock it would be stale: more than stale_after_s since its last sample).
    assert clock.t - gov.cost._cost[1].last_at > gov.cfg.stale_after_s
    assert not gov.cost.stale(1, clock.t, load.cpu_load)
