"""Replay a governor trace through the policy: the decision timeline, as rows and a table.

The command (`councild governor replay TRACE.jsonl`, `--synthetic critical`, `--timeline
FILE`) is replay_cli.py.

The trace holds what the probes saw (one "obs" record per tick), every cycle's telemetry,
overrides, and the config it ran with. Replaying it rebuilds the cost model from the
cycles and calls the same pure ``decide``; with the trace's own config the timeline is
exactly the live one, and with another config (``--config``) it answers "what would the
governor have done with these thresholds". The recorded head state is the live run's; when
the decisions differ from it, the replay simulates the head instead (loads and evictions
land at once), which it does by default whenever the config differs from the trace's.
"""

from __future__ import annotations

import json
from typing import Any, Iterable

import msgspec

from .config import GovernorConfig
from .cost_model import CostModel
from .heights import bucket_label
from .policy import apply_override, decide
from .types import CycleTelemetry, EvictHead, LoadHead, Observation, State, action_name


def _lines(trace: str | Iterable[str]) -> Iterable[str]:
    if isinstance(trace, str):
        with open(trace, encoding="utf-8") as f:
            yield from f
    else:
        yield from trace


def replay(
    trace: str | Iterable[str],
    cfg: GovernorConfig | None = None,
    *,
    all_ticks: bool = False,
    simulate_head: bool | None = None,
) -> list[dict]:
    """Decision timeline rows: one per tick that acted (every tick with ``all_ticks``).

    ``simulate_head``: None = simulate when ``cfg`` differs from the trace's own config.

    Row keys: t, pressure, available_mib, streams, cpu_load, depth, heights, head, actions, reasons
    (the reason sentences joined), and decisions (the structured reasons).
    """
    rows: list[dict] = []
    given_cfg = cfg is not None  # a --config replaces the trace's settings, reloads included
    model: CostModel | None = None
    state: State | None = None
    sim: bool | None = None  # the simulated head's residency, once known
    for n, line in enumerate(_lines(trace), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            kind, t = rec["kind"], float(rec["t"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"trace line {n}: {e}") from None
        if kind == "config":
            recorded = msgspec.convert(rec["cfg"], GovernorConfig)
            if simulate_head is None:
                simulate_head = cfg is not None and cfg != recorded
            cfg = cfg or recorded
            state = State(depth=int(rec.get("initial_depth", cfg.initial_depth)))
            model = CostModel(cfg)
            continue
        if cfg is None:
            cfg = GovernorConfig()
        if model is None:
            model = CostModel(cfg)
        if state is None:
            state = State(depth=cfg.initial_depth)
        if kind == "profile":
            model.seed(rec["profile"])
        elif kind == "cycle":
            model.record(msgspec.convert(rec["cycle"], CycleTelemetry), t, rec.get("load"))
        elif kind == "override":
            state = apply_override(state, rec["action"], rec.get("depth"))
        elif kind == "reconfigure" and not given_cfg:  # the live run took new settings (SIGHUP)
            new_cfg = msgspec.convert(rec["cfg"], GovernorConfig)
            if new_cfg.max_depth != cfg.max_depth:
                decode_s = model.decode_s
                model = CostModel(new_cfg)
                model.decode_s = decode_s
                state = msgspec.structs.replace(state, depth=min(state.depth, new_cfg.max_depth), heights=())
            else:
                model.cfg = new_cfg
            cfg = new_cfg
        elif kind == "obs":
            raw = rec["obs"]
            if simulate_head:
                sim = bool(raw.get("head_resident", False)) if sim is None else sim
                raw = {**raw, "head_resident": sim, "head_loading": False}
            obs = Observation(**raw, estimates=model.estimates(t, raw.get("cpu_load")), decode_s=model.decode_s,
                              lookup=model.lookup_estimate(),
                              batch_estimates=model.batch_estimates(t, raw.get("cpu_load")),
                              batch_decode_s=model.batch_decode_s(), acceptance=model.acceptance_noise())
            state, actions, reasons = decide(state, obs, t, cfg)
            for a in actions:
                if isinstance(a, (LoadHead, EvictHead)):
                    sim = isinstance(a, LoadHead)
            if actions or all_ticks or any(r["decision"] != "hold" for r in reasons):
                rows.append(
                    {
                        "t": t,
                        "pressure": obs.pressure,
                        "available_mib": None if obs.available_bytes is None else obs.available_bytes >> 20,
                        "streams": obs.active_streams,
                        "cpu_load": obs.cpu_load,
                        "depth": state.depth,
                        # Depth per bucket of batch heights 2, 3-4, 5-8, 9+ (None: the solo depth).
                        "heights": [h.depth for h in state.heights],
                        # Requests decoded at once (row_limit.py; None: not the governor's).
                        "rows": state.row_limit,
                        "head": bool(state.head_target),
                        "actions": [action_name(a) for a in actions],
                        "reasons": "; ".join(r["sentence"] for r in reasons),
                        "decisions": reasons,
                    }
                )
    return rows


def format_table(rows: list[dict]) -> str:
    head = f"{'time':>8}  {'pressure':<8} {'avail':>7} {'str':>3} {'load':>5} {'dep':>3} {'head':<4}  actions / reason"
    out = [head, "-" * len(head)]
    for r in rows:
        load = "-" if r["cpu_load"] is None else f"{r['cpu_load']:.2f}"
        avail = "-" if r["available_mib"] is None else f"{r['available_mib']}M"
        acts = ", ".join(r["actions"]) or "-"
        hs = r.get("heights") or []
        if any(k is not None for k in hs):  # the batch heights' depths, when any was chosen
            acts = "[B " + " ".join(f"{bucket_label(b)}:{'-' if k is None else k}"
                                    for b, k in enumerate(hs, start=1)) + "] " + acts  # fmt: skip
        out.append(
            f"{r['t']:8.2f}  {r['pressure']:<8} {avail:>7} {r['streams']:>3} {load:>5} {r['depth']:>3} "
            f"{'in' if r['head'] else 'out':<4}  {acts} | {r['reasons']}"
        )
    return "\n".join(out)
