"""daemon.cli: the `councild status` table (format_status) and the help texts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from daemon.cli import build_parser, format_status
from protocol import StatusReply


def reply(**detail) -> StatusReply:
    return StatusReply(server="councild 0.1.0", model="tiny-qwen35", uptime_s=3725.4, active=1, queued=2,
                       detail=detail)


FULL = dict(
    pid=4242, endpoint="ipc:///run/user/1000/councild/councild.sock", model_type="qwen3_5", draining=False,
    head_resident=True, head_bytes=850_000_000, depth=2, in_flight=3, clients=2, tokens_total=12345,
    recent_tokens_per_s=41.26, decode_path="compiled", exact_decode="serial",
    kernels={"name": "mlx", "reason": "the invariant kernels failed batch: refused, MLX's kept"},
    memory={"active_bytes": 17_500_000_000, "cache_bytes": 250_000_000, "peak_bytes": 18_000_000_000},
    governor={"depth": 2, "head": {"head_available": True, "head_resident": True, "head_loading": False,
                                   "head_bytes": 850_000_000, "target": "resident"},
              "override": "auto", "pin_depth": None, "shedding": False, "pressure": "warn",
              "available_bytes": 3_200_000_000, "state": {"depth": 2}, "cost_model": {},
              "last_actions": ["SetDepth(2)"], "last_reasons": [],
              "depth_by_height": [{"heights": "1", "chosen": 2, "depth": 2},
                                  {"heights": "2", "chosen": None, "depth": 3, "probing": False},
                                  {"heights": "3-4", "chosen": 3, "depth": 3, "probing": False},
                                  {"heights": "5-8", "chosen": 0, "depth": 0, "probing": True},
                                  {"heights": "9+", "chosen": None, "depth": 0, "probing": False}]},
    seats={"planner": {"active": 1, "queued": 0, "tokens": 9000, "tokens_per_s": 30.5},
           "critic": {"active": 0, "queued": 2, "tokens": 3345}},
)


def rows(text: str) -> dict[str, str]:
    out = {}
    for line in text.split("\n\n")[0].splitlines():
        key, _, value = line.partition("  ")
        out[key.strip()] = value.strip()
    return out


def test_status_table_has_every_fact():
    text = format_status(reply(**FULL))
    r = rows(text)
    assert r["model"] == "tiny-qwen35 (qwen3_5)"
    assert "pid 4242" in r["server"]
    assert r["uptime"] == "1h 02m 05s"
    assert r["MTP head"] == "resident, 850.0 MB"
    assert r["depth"] == "2"
    assert r["depth by batch height"] == "1: 2, 2: 3 (not measured), 3-4: 3, 5-8: 0, 9+: 0 (not measured)"
    assert r["decoding"] == "compiled, mlx kernels; exact greedy requests decode serially (verify rounds unlike serial here)"
    assert r["in flight"] == "1 active, 2 queued; clients: 2 heard from within the heartbeat timeout"
    assert r["throughput"].startswith("41.3 tok/s") and "12345 tokens total" in r["throughput"]
    assert r["memory"] == "active 17500.0 MB, cache 250.0 MB, peak 18000.0 MB"
    assert r["pressure"] == "warn, 3200.0 MB available"
    assert "override=auto" in r["governor"] and "SetDepth(2)" in r["governor"]
    assert "state" not in r  # not draining
    # The rows line up: every value starts in the same column.
    first = text.split("\n\n")[0].splitlines()
    assert len({len(line) - len(line[len(line.split("  ")[0]):].lstrip()) for line in first}) == 1


def test_status_says_whether_batched_steps_run_compiled():
    r = rows(format_status(reply(**FULL, batch_decode_path="eager: plain batch B=2, array 0: compiled differs")))
    assert r["decoding"].startswith("compiled (batches: eager: plain batch B=2, array 0: compiled differs), mlx kernels;")
    assert rows(format_status(reply(**FULL, batch_decode_path="compiled")))["decoding"].startswith(
        "compiled (batches: compiled), mlx")


def test_status_says_when_the_gated_delta_recurrence_runs_fused():
    assert rows(format_status(reply(**FULL, recurrence="fused")))["decoding"].startswith(
        "compiled, mlx kernels, fused GatedDeltaNet conv and recurrence; exact greedy")
    assert rows(format_status(reply(**FULL, recurrence="fused recurrence, conv in mlx ops: bias")))["decoding"].startswith(
        "compiled, mlx kernels, fused GatedDeltaNet recurrence; exact greedy")
    assert "recurrence" not in rows(format_status(reply(**FULL, recurrence="mlx-lm: not CUDA")))["decoding"]
    assert rows(format_status(reply(**FULL, recurrence="fused", linears="merged 64")))["decoding"].startswith(
        "compiled, mlx kernels, fused GatedDeltaNet conv and recurrence, merged projections; exact greedy")
    assert "merged" not in rows(format_status(reply(**FULL, linears="separate: configured")))["decoding"]


def test_status_from_an_older_daemon_has_no_decoding_row():
    detail = {k: v for k, v in FULL.items() if k not in ("decode_path", "exact_decode")}
    assert "decoding" not in rows(format_status(reply(**detail)))


def test_status_seat_rows():
    seat_block = format_status(reply(**FULL)).split("\n\n")[1].splitlines()
    assert seat_block[0].split() == ["seat", "active", "queued", "tokens", "tok/s"]
    assert seat_block[1].split() == ["critic", "0", "2", "3345", "-"]  # sorted; no rate known
    assert seat_block[2].split() == ["planner", "1", "0", "9000", "30.5"]


def test_status_states_worth_shouting():
    detail = {**FULL, "draining": True, "head_resident": False,
              "governor": {**FULL["governor"], "shedding": True, "pressure": "critical", "override": "pin_depth",
                           "pin_depth": 0}}
    r = rows(format_status(reply(**detail)))
    assert r["MTP head"] == "not resident"
    assert r["pressure"].startswith("critical") and "SHEDDING" in r["pressure"]
    assert r["depth"].startswith("2 (pinned to 0")
    assert r["state"].startswith("draining")


def test_status_head_absent_and_governor_disabled():
    detail = {**FULL, "head_resident": False, "governor": {**FULL["governor"], "head": {"head_available": False}}}
    assert rows(format_status(reply(**detail)))["MTP head"].startswith("absent")
    bare = {k: v for k, v in FULL.items() if k not in ("governor", "memory", "seats")}
    text = format_status(reply(**bare))
    assert rows(text)["governor"] == "disabled" and "memory" not in rows(text) and "\n\n" not in text


def test_status_of_an_old_daemon_with_no_detail():
    text = format_status(StatusReply(server="councild 0.0.1", model="m", uptime_s=5.0, active=0, queued=0))
    r = rows(text)
    assert r["uptime"] == "5 s" and r["MTP head"] == "not resident" and r["depth"] == "0"


@pytest.mark.parametrize("argv, needles", [
    (["--help"], ["serve", "generate", "status", "governor", "service", "exit codes", "78", "75",
                  "COUNCILD_ENDPOINT"]),
    (["serve", "--help"], ["SIGTERM", "SIGHUP", "drain_deadline_s", "READY=1", "WATCHDOG=1", "STOPPING=1",
                           "JSON", "docs/OPERATIONS.md", "--log-format"]),
    (["status", "--help"], ["--json", "memory", "pressure", "seat"]),
])
def test_help_texts(capsys, argv, needles):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for needle in needles:
        assert needle in out, (needle, out)
    assert max(len(line) for line in out.splitlines()) <= 100  # readable in a terminal


def test_every_exit_code_is_documented():
    """daemon/exits.py is the one list of exit codes; OPERATIONS.md names each of them."""
    import re

    from daemon import exits
    from daemon.paths import PACKAGE_DIR

    doc = (PACKAGE_DIR.parent / "docs" / "OPERATIONS.md").read_text()
    documented = {int(n) for n in re.findall(r"^\| (\d+) \|", doc, re.M)} | {
        int(n) for n in re.findall(r"\b(\d\d) \((?:EX_\w+)\)", doc)} | {
        int(n) for n in re.findall(r"exits (\d+)\b", doc)}
    assert set(exits.ALL.values()) <= documented | {0, 1, 2}, set(exits.ALL.values()) - documented


def test_help_lists_every_command_it_dispatches():
    """The CLI is built from one table: whatever `main` can dispatch, `--help` lists."""
    from daemon import cli

    top = cli.build_parser().format_help()
    for path in cli.DELEGATED:
        if len(path) == 1:
            assert path[0] in top, path
        else:
            assert path[0] in top
            group = subprocess.run([sys.executable, "-m", "daemon.cli", path[0], "--help"],
                                   capture_output=True, text=True, timeout=60)
            assert group.returncode == 0 and path[1] in group.stdout, (path, group.stdout)
    for name in ("serve", "generate", "status", "tune", "keys", "service"):
        assert name in top


def test_clients_with_work_are_told_apart_from_clients_heard_from():
    r = dict(row.split("  ", 1) for row in format_status(reply(**dict(FULL, clients_with_work=1))).splitlines()
             if "  " in row)
    assert r["in flight"].strip() == "1 active, 2 queued; clients: 1 with work in flight, 2 heard from within the heartbeat timeout"


def test_status_table_says_what_is_still_warming_and_nothing_once_done():
    warming = {"pending": ["splits", "batch", "warmup"], "running": "splits", "parts": {}}
    r = dict(row.split("  ", 1) for row in format_status(reply(**dict(FULL, warming=warming))).splitlines()
             if "  " in row)
    assert r["warming"].strip() == "splits, batch, warmup (serving meanwhile on the safe paths)"
    done = format_status(reply(**dict(FULL, warming={"pending": [], "running": None, "parts": {}})))
    assert "warming" not in done


def test_status_table_shows_a_tensor_parallel_group_rank_by_rank():
    group = {"size": 2, "backend": "ring", "exchanges": 812, "ranks": [
        {"rank": r, "host": f"mac-{r}", "pid": 100 + r,
         "memory": {"active_bytes": 8_000_000_000, "cache_bytes": 0, "peak_bytes": 9_000_000_000,
                    "available_bytes": 2_000_000_000, "total_bytes": None, "pressure": p}}
        for r, p in ((0, "normal"), (1, "warn"))]}
    text = format_status(reply(**FULL, group=group))
    r = rows(text)
    assert r["group"] == "2 ranks, ring backend, 812 exchanges"
    assert r["rank 1"] == "mac-1 pid 101: active 8000.0 MB, cache 0.0 MB, pressure warn, 2000.0 MB available"
    assert "group" not in rows(format_status(reply(**FULL)))


def test_status_step_row():
    detail = {**FULL, "step": {"budget": 256, "steps": 40, "last": {"decode_tokens": 3, "prefill_tokens": 128},
                               "prefill_queue": [{"request_id": "r1", "seat": "critic", "left": 900, "cached_tokens": 0},
                                                 {"request_id": "r2", "seat": "planner", "left": 17,
                                                  "cached_tokens": 512}]}}
    r = rows(format_status(reply(**detail)))
    assert r["step"] == "budget 256 tokens; last: 3 decode + 128 prefill; prefill queue 2 (917 tokens left)"
    assert "step" not in rows(format_status(reply(**FULL)))  # an older daemon, or no iteration yet


def test_status_prefill_row_says_how_prompts_are_paced_and_shared():
    step = {"budget": 256, "steps": 40, "last": {}, "prefill_queue": [],
            "pacing": {"bound": 3.0, "quiet_ms": 14.2, "last_piece": 9, "paced_iterations": 120},
            "together": {"enabled": True, "exact_rows": True, "forwards": 7, "rows": 19}}
    r = rows(format_status(reply(**{**FULL, "step": step})))
    assert r["prefill"] == ("paced within 3x a quiet iteration (14.2 ms), last piece 9 tokens, 120 paced iterations; "
                            "prompts together: on (7 forwards, 19 pieces)")
    step = {**step, "pacing": {"bound": 0.0, "paced_iterations": 0}, "together": {"enabled": False}}
    assert rows(format_status(reply(**{**FULL, "step": step})))["prefill"] == "paced: off (whole chunks); prompts together: off"
    step = {**step, "mixed": {"enabled": True, "exact_rows": False, "forwards": 31, "tokens": 248}}
    assert rows(format_status(reply(**{**FULL, "step": step})))["prefill"] == (
        "paced: off (whole chunks); prompts together: off; "
        "pieces in decode forwards: on (31 forwards, 248 tokens; not beside exact rows)")
    step = {**step, "mixed": {"enabled": False}}
    assert rows(format_status(reply(**{**FULL, "step": step})))["prefill"].endswith("pieces in decode forwards: off")
    assert "prefill" not in rows(format_status(reply(**FULL)))
