"""Replay on synthetic traces: each scenario tells the story it is named for."""

from __future__ import annotations

import functools
import json

import pytest

from governor.config import GovernorConfig
from governor.replay import replay
from governor.replay_cli import main
from governor.traces import SCENARIOS, generate

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)


@functools.lru_cache(maxsize=None)
def trace(name: str) -> tuple[str, ...]:
    return tuple(generate(name))


def acts(rows, name):
    return [r for r in rows if any(a == name for a in r["actions"])]


def test_generation_is_deterministic():
    assert list(trace("critical")) == generate("critical")


def test_quiet_keeps_the_head_and_speculates():
    rows = replay(trace("quiet"))
    assert not acts(rows, "EvictHead") and not acts(rows, "LoadHead") and not acts(rows, "ShedAdmissions(on)")
    final = replay(trace("quiet"), all_ticks=True)[-1]
    assert final["depth"] >= 1 and final["head"]


def test_busy_batches_at_zero_evicts_idle_head_and_restores_it():
    rows = replay(trace("busy"))
    batch = next(r for r in rows if r["streams"] >= 2 and r["actions"])
    assert batch["actions"] == ["SetDepth(0)"] and 180 <= batch["t"] < 182
    (ev,) = acts(rows, "EvictHead")
    assert "unused" in ev["reasons"] and 475 <= ev["t"] <= 485
    (ld,) = acts(rows, "LoadHead")
    assert ld["t"] >= 540 and ld["streams"] == 1
    assert not acts(rows, "ShedAdmissions(on)")


def test_flapping_evicts_once_and_restores_once_after_a_calm_window():
    cfg = GovernorConfig()
    rows = replay(trace("flapping"))
    (ev,) = acts(rows, "EvictHead")
    (ld,) = acts(rows, "LoadHead")
    assert 20 + cfg.warn_evict_s <= ev["t"] < 260
    assert ld["t"] >= 256 + cfg.restore_window_s  # the last warn ended at 256 s
    assert not acts(rows, "ShedAdmissions(on)")


def test_critical_spike_sheds_fast_and_restores_slowly():
    cfg = GovernorConfig()
    rows = replay(trace("critical"))
    first = next(r for r in rows if r["pressure"] == "critical")
    assert first["actions"] == ["SetDepth(0)", "EvictHead", "ClearCache", "ShedAdmissions(on)"]
    assert 30 <= first["t"] < 30 + cfg.tick_s * 2
    (off,) = acts(rows, "ShedAdmissions(off)")
    assert 50 + cfg.shed_release_s <= off["t"] < 50 + cfg.shed_release_s + 1
    (ld,) = acts(rows, "LoadHead")
    assert ld["t"] >= max(70 + cfg.restore_window_s, first["t"] + cfg.min_reload_gap_s)
    later = [r for r in rows if r["t"] > ld["t"] and r["actions"]]
    assert later and later[0]["actions"] == ["SetDepth(1)"]  # and back to speculating, one step at a time


def test_replay_with_other_thresholds_answers_what_if():
    # 150 s, not more: the replay's cycles are the recorded run's, which reloaded at ~188 s
    # and speculated from then on, so a replay still serial after that has no fresh
    # depth-0 cost to judge a move by (it holds, as the live policy would without data).
    rows = replay(trace("critical"), GovernorConfig(min_reload_gap_s=150.0))
    (ld,) = acts(rows, "LoadHead")
    first = next(r for r in rows if r["pressure"] == "critical")
    assert ld["t"] >= first["t"] + 150.0
    # The simulated head follows the replay's own decisions: speculation resumes after it
    # (a probe of the depth that looks best, paired against serial).
    later = [r for r in rows if r["t"] > ld["t"] and r["actions"]]
    assert later and later[0]["actions"][0] in ("SetDepth(1)", "SetDepth(2)", "SetDepth(3)", "SetDepth(4)")
    assert "probe" in later[0]["reasons"]


def test_replay_rejects_a_broken_line():
    with pytest.raises(ValueError, match="line 2"):
        replay(['{"t": 0, "kind": "config", "cfg": {}}', "{not json"])


def test_replay_without_config_record_uses_defaults():
    lines = [json.dumps({"t": 1.0, "kind": "obs", "obs": {"pressure": "critical", "head_resident": True}})]
    (row,) = replay(lines)
    assert "EvictHead" in row["actions"] and "ShedAdmissions(on)" in row["actions"]


def test_main_prints_a_table(capsys, tmp_path):
    assert main(["--synthetic", "critical", "--save", str(tmp_path / "t.jsonl")]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:3] == ["time", "pressure", "avail"]
    assert "EvictHead" in out and "critical memory pressure" in out
    assert main([str(tmp_path / "t.jsonl")]) == 0
    assert capsys.readouterr().out == out


def test_main_errors(capsys, tmp_path):
    assert main(["--synthetic", "nope"]) == 2
    assert main(["--synthetic", "quiet", "--config", '{"no_such_knob": 1}']) == 2
    assert main([str(tmp_path / "missing.jsonl")]) == 1
    assert set(SCENARIOS) == {"quiet", "busy", "flapping", "critical", "council"}


def test_council_finds_a_depth_per_batch_height_and_keeps_it_while_the_height_alternates():
    live = replay(trace("council"), all_ticks=True)
    at = lambda t: next(r for r in live if r["t"] >= t)  # noqa: E731
    # Alone, before any batch: no height has a depth of its own.
    assert at(20.0)["heights"] == [None, None, None, None]
    # A batch of 4 on a GPU-like machine speculates (its bucket, 3-4, chose >= 2).
    assert at(110.0)["heights"][1] >= 2
    # Heights alternating 2, 3 every tick: each bucket keeps its own depth; the changes are
    # probes of a neighbour (each returning unless it is 10% better), not a flip-flop.
    window = [r for r in live if 125.0 <= r["t"] < 240.0]
    verdicts = [d for r in window for d in r["decisions"]
                if d["decision"] in ("height_adopt", "height_depth", "height_probe_end")]
    for label in ("2", "3-4"):
        kept = {d["depth_to"] for d in verdicts if d["heights"] == label}
        assert len(kept) == 1 and min(kept) >= 1, (label, kept)
    # Then 8 rows: bucket 5-8 starts from its neighbour's depth and keeps speculating.
    assert live[-1]["heights"][2] >= 2
