"""How many requests decode at once (governor/row_limit.py), with fake observations and a
fake clock: up on demand into an unmeasured bucket of heights (a probe), kept when it pays,
back when it does not, one row down when the height runs worse than the one below, never
above the ceiling, down under memory pressure, nothing while idle, and first-use cycles of
a new height not counted."""

from __future__ import annotations

import msgspec
import pytest

from governor.config import GovernorConfig
from governor.fakes import FakeClock, FakeLoad, FakeMemoryProbe, RecordingLogger, make_estimates
from governor.policy import decide
from governor.row_limit import bucket_estimate
from governor.runtime import Governor
from governor.types import CRITICAL, NORMAL, WARN, CycleTelemetry, Observation, SetMaxActive, State

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)

GiB, MiB = 1 << 30, 1 << 20
CFG = GovernorConfig()


def observe(scores: dict[str, float | None], *, samples: int | dict[str, int] = 50, rse: float = 0.02,
            pressure=NORMAL, active: int = 4, waiting: int = 2, limit: int = 4, ceiling: int = 8,
            available: int | None = 8 * GiB, row_bytes: int = 64 * MiB, decode_s: float = 10.0) -> Observation:
    """Scores (the batch's tokens/s) by bucket label ("1", "2", "3-4", "5-8", "9+"); a bucket
    not named, or None, was never measured."""
    def ests(label: str):
        sc = scores.get(label)
        n = samples.get(label, 50) if isinstance(samples, dict) else samples
        return make_estimates([sc], samples=n if sc is not None else 0, cost_rse=rse if sc is not None else None)

    return Observation(pressure=pressure, available_bytes=available, head_resident=True,
                       estimates=ests("1"), batch_estimates=tuple(ests(b) for b in ("2", "3-4", "5-8", "9+")),
                       decode_s=decode_s, rows_active=active, rows_waiting=waiting, row_limit=limit,
                       row_ceiling=ceiling, row_cache_bytes=row_bytes)  # fmt: skip


def row_actions(actions) -> list[int]:
    return [a.rows for a in actions if isinstance(a, SetMaxActive)]


def row_reasons(reasons, name: str | None = None) -> list[dict]:
    return [r for r in reasons if r["decision"].startswith("rows_") and (name is None or r["decision"] == name)]


def at(limit: int, **fields) -> State:
    return State(depth=0, head_target=True, row_limit=limit, **fields)


MEASURED_TO_4 = {"1": 40.0, "2": 70.0, "3-4": 100.0}


# ---------------------------------------------------------------- up: a probe, kept or not


def test_demand_waiting_probes_one_more_row_into_an_unmeasured_bucket():
    s, acts, why = decide(at(4), observe(MEASURED_TO_4), 100.0, CFG)
    assert row_actions(acts) == [5] and s.row_limit == 5 and s.row_probe_from == 4
    (r,) = row_reasons(why, "rows_probe")
    assert "never measured" in r["sentence"] and r["rows_from"] == 4 and r["rows_to"] == 5
    assert r["rows_waiting"] == 2 and r["ceiling"] == 8 and r["row_cache_bytes"] == 64 * MiB
    assert {h["heights"]: h["score"] for h in r["by_height"]}["3-4"] == 100.0


def test_a_probe_is_kept_when_the_next_height_pays_and_then_climbs_inside_its_bucket():
    s, _, _ = decide(at(4), observe(MEASURED_TO_4), 100.0, CFG)
    # The probed bucket's first cycles: fewer than trust_samples, the probe waits.
    s, acts, why = decide(s, observe({**MEASURED_TO_4, "5-8": 150.0}, samples={"5-8": 3}, limit=5), 100.5, CFG)
    assert not row_actions(acts) and s.row_probe_from == 4 and not row_reasons(why)
    s, acts, why = decide(s, observe({**MEASURED_TO_4, "5-8": 150.0}, limit=5), 101.0, CFG)
    assert not row_actions(acts) and s.row_limit == 5 and s.row_probe_from is None
    (r,) = row_reasons(why, "rows_keep")
    assert "pays" in r["sentence"] and r["margin"] >= CFG.depth_margin_min
    # Within the dwell: no move; after it, demand still waiting: one more row in the same bucket.
    s, acts, _ = decide(s, observe({**MEASURED_TO_4, "5-8": 150.0}, limit=5, active=5), 101.5, CFG)
    assert not row_actions(acts)
    s, acts, why = decide(s, observe({**MEASURED_TO_4, "5-8": 150.0}, limit=5, active=5), 101.0 + CFG.row_dwell_s, CFG)
    assert row_actions(acts) == [6] and row_reasons(why, "rows_raise")


def test_a_probe_that_does_not_pay_by_the_margin_goes_back():
    s, _, _ = decide(at(4), observe(MEASURED_TO_4), 100.0, CFG)
    # 3% better with 2% noise on each side: inside the noise-aware margin (2 x 2.8% -> 5.8%).
    s, acts, why = decide(s, observe({**MEASURED_TO_4, "5-8": 103.0}, limit=5), 101.0, CFG)
    assert row_actions(acts) == [4] and s.row_limit == 4 and s.row_probe_from is None
    (r,) = row_reasons(why, "rows_probe_end")
    assert "not better" in r["sentence"] and r["margin"] == pytest.approx(0.0582, abs=1e-3)
    # Measured now: demand still waits, but no second probe, and the hold is said once.
    s, acts, why = decide(s, observe({**MEASURED_TO_4, "5-8": 103.0}), 101.0 + CFG.row_dwell_s, CFG)
    assert not row_actions(acts) and row_reasons(why, "rows_hold")
    s, acts, why = decide(s, observe({**MEASURED_TO_4, "5-8": 103.0}), 105.0, CFG)
    assert not row_actions(acts) and not row_reasons(why)
    s, acts, why = decide(s, observe({**MEASURED_TO_4, "5-8": 101.0}), 106.0, CFG)  # new numbers, same blocker
    assert not row_actions(acts) and not row_reasons(why) and "101.0 tok/s" in s.row_why


def test_no_probe_before_the_limits_own_heights_are_measured():
    # At start-up: four rows run but their bucket has no cycle past its first use yet.
    s, acts, why = decide(at(4), observe({"1": 40.0, "3-4": 100.0}, samples={"3-4": 1}), 100.0, CFG)
    assert not row_actions(acts) and "not measured yet" in row_reasons(why, "rows_hold")[0]["sentence"]
    s, acts, _ = decide(s, observe(MEASURED_TO_4), 101.0, CFG)
    assert row_actions(acts) == [5] and s.row_probe_from == 4


def test_a_measured_paying_height_is_entered_without_a_probe():
    s, acts, why = decide(at(4), observe({**MEASURED_TO_4, "5-8": 180.0}), 100.0, CFG)
    assert row_actions(acts) == [5] and s.row_probe_from is None and row_reasons(why, "rows_raise")


def test_a_probe_that_gets_no_cycles_goes_back_unmeasured():
    s, _, _ = decide(at(4), observe(MEASURED_TO_4, decode_s=10.0), 100.0, CFG)
    wait = CFG.probe_s * CFG.probe_max_factor
    s, acts, _ = decide(s, observe(MEASURED_TO_4, limit=5, decode_s=10.0 + wait - 0.1), 101.0, CFG)
    assert not row_actions(acts)
    s, acts, why = decide(s, observe(MEASURED_TO_4, limit=5, decode_s=10.0 + wait), 102.0, CFG)
    assert row_actions(acts) == [4] and "not measured" in row_reasons(why, "rows_probe_end")[0]["sentence"]
    # The next look waits probe_interval_s of decoding.
    s, acts, _ = decide(s, observe(MEASURED_TO_4, decode_s=10.0 + wait + 1), 110.0, CFG)
    assert not row_actions(acts)
    s, acts, _ = decide(s, observe(MEASURED_TO_4, decode_s=10.0 + CFG.probe_interval_s), 120.0, CFG)
    assert row_actions(acts) == [5]


def test_a_bucket_scores_at_its_best_measured_depth_not_a_depth_just_probed():
    # Heights 3-4 measured at depth 0 (40 cycles), then the depth policy tried depth 1 (3 cycles).
    b34 = make_estimates([100.0, 90.0], samples=40, cost_rse=0.02)
    b34 = (b34[0], msgspec.structs.replace(b34[1], samples=3))
    o = msgspec.structs.replace(observe(MEASURED_TO_4), batch_estimates=(make_estimates([70.0]), b34, (), ()))
    e = bucket_estimate(o, 4, CFG.trust_samples)
    assert e.depth == 0 and e.score == 100.0
    s, acts, _ = decide(at(4), o, 100.0, CFG)
    assert row_actions(acts) == [5]  # measured: the probe has its reference


# ---------------------------------------------------------------- down, bounds, memory, idle


def test_one_row_back_when_the_height_runs_worse_than_the_bucket_below():
    scores = {**MEASURED_TO_4, "5-8": 80.0}
    s, acts, why = decide(at(7), observe(scores, limit=7, active=7), 100.0, CFG)
    assert row_actions(acts) == [6] and "does not pay" in row_reasons(why, "rows_back_off")[0]["sentence"]
    s, acts, _ = decide(s, observe(scores, limit=6, active=6), 100.5, CFG)  # inside the dwell
    assert not row_actions(acts)
    s, acts, _ = decide(s, observe(scores, limit=6, active=6), 100.0 + CFG.row_dwell_s, CFG)
    assert row_actions(acts) == [5]


def test_never_above_the_ceiling():
    s, acts, why = decide(at(3), observe(MEASURED_TO_4, limit=3, active=3, ceiling=3), 100.0, CFG)
    assert not row_actions(acts) and "ceiling" in row_reasons(why, "rows_hold")[0]["sentence"]
    # Everything pays and demand never stops: the climb ends at the ceiling.
    s, now = at(4), 100.0
    for _ in range(40):
        lim = s.row_limit
        s, acts, _ = decide(s, observe({"3-4": 100.0, "5-8": 200.0, "9+": 400.0}, limit=lim, active=lim, ceiling=6),
                            now, CFG)  # fmt: skip
        assert all(n <= 6 for n in row_actions(acts))
        now += CFG.row_dwell_s
    assert s.row_limit == 6
    # A ceiling lowered on reload brings the limit down to it.
    s, acts, _ = decide(at(8), observe(MEASURED_TO_4, limit=8, ceiling=5), 100.0, CFG)
    assert row_actions(acts) == [5]


def test_memory_pressure_steps_down_and_stops_raising():
    s, acts, why = decide(at(6), observe(MEASURED_TO_4, pressure=WARN, limit=6), 100.0, CFG)
    assert row_actions(acts) == [5] and row_reasons(why, "rows_pressure")
    # Warn with demand waiting and the next bucket unmeasured: no probe, one more row down.
    s, acts, _ = decide(s, observe(MEASURED_TO_4, pressure=WARN, limit=5), 100.0 + CFG.row_dwell_s, CFG)
    assert row_actions(acts) == [4]
    s, acts, why = decide(at(6), observe(MEASURED_TO_4, pressure=CRITICAL, limit=6), 100.0, CFG)
    assert row_actions(acts) == [CFG.row_floor] and "critical" in row_reasons(why, "rows_pressure")[0]["sentence"]
    # A probe in flight ends under pressure.
    s, _, _ = decide(at(4), observe(MEASURED_TO_4), 100.0, CFG)
    s, acts, _ = decide(s, observe(MEASURED_TO_4, pressure=WARN, limit=5), 100.0 + CFG.row_dwell_s, CFG)
    assert row_actions(acts) == [4] and s.row_probe_from is None


def test_no_room_for_another_rows_caches_holds():
    s, acts, why = decide(at(4), observe(MEASURED_TO_4, available=1 * GiB, row_bytes=900 * MiB), 100.0, CFG)
    assert not row_actions(acts) and "headroom" in row_reasons(why, "rows_hold")[0]["sentence"]
    s, acts, _ = decide(at(4), observe(MEASURED_TO_4, available=None), 100.0, CFG)
    assert not row_actions(acts)


def test_idle_or_no_demand_decides_nothing_and_a_pinned_limit_is_not_the_governors():
    for active, waiting in ((0, 0), (3, 0)):
        s, acts, why = decide(at(4), observe(MEASURED_TO_4, active=active, waiting=waiting), 100.0, CFG)
        assert not row_actions(acts) and not row_reasons(why) and s.row_limit == 4
    # Ceiling 0: the config pins max_active (and old traces have no row fields at all).
    s, acts, why = decide(State(), observe(MEASURED_TO_4, ceiling=0), 100.0, CFG)
    assert s.row_limit is None and not row_reasons(why)
    s, acts, why = decide(State(), Observation(), 100.0, CFG)
    assert s.row_limit is None and not row_reasons(why)
    # The first tick adopts the engine's limit, and says so only in the state (no decision).
    s, acts, why = decide(State(), observe(MEASURED_TO_4, active=0, waiting=0, limit=4), 100.0, CFG)
    assert s.row_limit == 4 and s.row_decision == "rows_start" and not row_reasons(why)


# ---------------------------------------------------------------- the runtime: first-use cycles


def test_first_use_cycles_of_a_new_height_do_not_decide_the_probe():
    clock, logger = FakeClock(100.0), RecordingLogger()
    gov = Governor(GovernorConfig(), clock=clock, memory_probes=[FakeMemoryProbe()], load=FakeLoad(active=1),
                   head_resident=False, logger=logger)  # fmt: skip
    gov.note_rows(rows_active=4, rows_waiting=3, row_limit=4, row_ceiling=8, row_cache_bytes=32 * MiB)
    for _ in range(20):
        gov.record_cycle(CycleTelemetry(depth=0, cycle_s=0.040, batch=4))
    assert row_actions(gov.tick()) == [5]
    gov.note_rows(row_limit=5, rows_active=5)
    # A 5-row batch's first cycles cost ten times as much (first use): marked transition, not counted.
    for _ in range(20):
        clock.advance(0.1)
        gov.record_cycle(CycleTelemetry(depth=0, cycle_s=0.500, batch=5, transition=True))
        assert row_actions(gov.tick()) == []
    assert gov.state.row_probe_from == 4
    for _ in range(CFG.trust_samples):
        gov.record_cycle(CycleTelemetry(depth=0, cycle_s=0.041, batch=5))  # 122 tok/s vs 100 at 4
    clock.advance(0.25)
    assert row_actions(gov.tick()) == []
    assert gov.state.row_limit == 5 and gov.state.row_decision == "rows_keep"
    assert gov.snapshot()["rows"] == {"limit": 5, "ceiling": 8, "decision": "rows_keep",
                                      "why": gov.state.row_why, "probing_from": None}
    keep = [e[2] for e in logger.events if e[1] == "governor.decision" and e[2]["decision"] == "rows_keep"]
    assert len(keep) == 1 and keep[0]["rows_to"] == 5


def test_a_probe_better_but_inside_the_noise_runs_on_before_its_verdict():
    """5 rows scoring 1.5x 4 rows with 30% noise each side (a ~134% margin): better by the
    fixed edge, inside the noise. The probe runs on (no move) until PROBE_EXTEND x
    trust_samples new cycles; kept once the noise has fallen, back if it has not."""
    from governor.row_limit import PROBE_EXTEND

    n = CFG.trust_samples
    s0, _, _ = decide(at(4), observe(MEASURED_TO_4, samples={"1": 50, "2": 50, "3-4": 50}), 100.0, CFG)
    assert s0.row_probe_from == 4
    noisy = {**MEASURED_TO_4, "5-8": 150.0}
    s, acts, why = decide(s0, observe(noisy, samples={"5-8": n}, rse=0.3, limit=5), 101.0, CFG)
    assert not row_actions(acts) and s.row_limit == 5 and s.row_probe_from == 4 and not row_reasons(why)
    # More cycles, the noise down to 5%: the margin is ~15%, and 1.5x clears it.
    s, acts, why = decide(s, observe(noisy, samples={"5-8": 2 * n}, rse=0.05, limit=5), 102.0, CFG)
    assert s.row_limit == 5 and s.row_probe_from is None and row_reasons(why, "rows_keep")
    # Still as noisy after PROBE_EXTEND x trust_samples cycles: the verdict is the margin's, back.
    s, _, _ = decide(s0, observe(noisy, samples={"5-8": n}, rse=0.3, limit=5), 101.0, CFG)
    s, acts, why = decide(s, observe(noisy, samples={"5-8": PROBE_EXTEND * n}, rse=0.3, limit=5), 102.0, CFG)
    assert row_actions(acts) == [4] and row_reasons(why, "rows_probe_end")
    # Better by less than the fixed edge (5% < depth_margin): no extension, back at once.
    s, _, _ = decide(s0, observe({**MEASURED_TO_4, "5-8": 105.0}, samples={"5-8": n}, rse=0.3, limit=5), 101.0, CFG)
    assert s.row_limit == 4 and s.row_probe_from is None


# ---------------------------------------------------------------- a learned start


def test_a_learned_limit_starts_there_as_far_as_the_headroom_holds_its_rows():
    """A restart's first tick starts where the last run settled (``rows`` of the learned
    profile), one ``rows_start`` decision: never above the ceiling, above the engine's start
    only as many rows as the headroom holds (each row's caches + row_margin_bytes once), and
    not above the engine's start where the headroom is unknown."""
    idle = dict(active=0, waiting=0, limit=4, ceiling=8, row_bytes=64 * MiB)
    s, acts, why = decide(State(row_learned=7), observe({}, available=8 * GiB, **idle), 100.0, CFG)
    assert row_actions(acts) == [7] and s.row_limit == 7 and s.row_learned is None
    (r,) = row_reasons(why, "rows_start")
    assert "learned profile: 7" in r["sentence"] and r["rows_from"] == 4 and r["rows_learned"] == 7
    # The next tick is an ordinary one: no second start, and the dwell holds the next move.
    s, acts, why = decide(s, observe(MEASURED_TO_4, active=7, waiting=2, limit=7), 100.5, CFG)
    assert not row_actions(acts) and not row_reasons(why)

    # Two rows' caches fit beside the margin (256 MiB): 4 + 2.
    s, acts, why = decide(State(row_learned=7), observe({}, available=256 * MiB + 130 * MiB, **idle), 100.0, CFG)
    assert row_actions(acts) == [6]
    assert "holds 2 more row(s)" in row_reasons(why, "rows_start")[0]["sentence"]
    # None fits, or the headroom is unknown: the engine's start, said so (no move).
    for available in (100 * MiB, None):
        s, acts, why = decide(State(row_learned=7), observe({}, available=available, **idle), 100.0, CFG)
        assert not row_actions(acts) and s.row_limit == 4 and row_reasons(why, "rows_start")
    # Above the ceiling: the ceiling. Below the engine's start (the last run backed off): there.
    s, acts, why = decide(State(row_learned=12), observe({}, **idle), 100.0, CFG)
    assert row_actions(acts) == [8] and "the ceiling 8" in row_reasons(why)[0]["sentence"]
    s, acts, _ = decide(State(row_learned=2), observe({}, **idle), 100.0, CFG)
    assert row_actions(acts) == [2]
    # Under memory pressure the first tick does not start above the engine's limit.
    s, acts, _ = decide(State(row_learned=7), observe({}, pressure=WARN, **idle), 100.0, CFG)
    assert 7 not in row_actions(acts) and s.row_limit <= 4


def test_the_settled_limit_is_learned_and_a_restart_starts_from_it():
    """Governor.learned() keeps the row limit (the limit a probe returns to, while one runs;
    nothing under memory pressure), and a Governor built with that profile starts there."""
    from governor.learned import learned_rows

    clock, logger = FakeClock(100.0), RecordingLogger()
    gov = Governor(GovernorConfig(), clock=clock, memory_probes=[FakeMemoryProbe()], load=FakeLoad(active=1),
                   head_resident=False, logger=logger)  # fmt: skip
    assert "rows" not in gov.learned()  # no limit adopted yet (no ceiling: pinned, or before the first tick)
    gov.note_rows(rows_active=4, rows_waiting=3, row_limit=4, row_ceiling=8, row_cache_bytes=32 * MiB)
    for _ in range(20):
        gov.record_cycle(CycleTelemetry(depth=0, cycle_s=0.040, batch=4))
    assert row_actions(gov.tick()) == [5] and gov.state.row_probe_from == 4
    assert gov.learned()["rows"] == 4  # probing 5: what it returns to
    gov.state = msgspec.structs.replace(gov.state, row_limit=6, row_probe_from=None)
    profile = gov.learned()
    assert profile["rows"] == 6

    again = Governor(GovernorConfig(), clock=FakeClock(200.0), memory_probes=[FakeMemoryProbe()],
                     load=FakeLoad(active=1), head_resident=False, logger=RecordingLogger(), profile=profile)  # fmt: skip
    again.note_rows(rows_active=0, rows_waiting=0, row_limit=4, row_ceiling=8, row_cache_bytes=32 * MiB)
    assert row_actions(again.tick()) == [6] and again.state.row_limit == 6
    assert again.rows()["decision"] == "rows_start" and "learned profile" in again.rows()["why"]
    # Malformed or absent values are no start (a file written before rows were kept).
    assert [learned_rows(p) for p in ({"rows": "7"}, {"rows": 0}, {"rows": True}, {}, None)] == [None] * 5
