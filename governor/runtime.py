"""Governor: probes + cost model + policy, with an injected clock.

The daemon owns one, calls ``tick()`` every ``cfg.tick_s`` beside the step loop and
applies the returned actions at the next safe point, feeds ``record_cycle()`` after every
decode cycle, and tells it about the head with ``note_head()``. Everything that happens
can be written as JSON lines to a trace, which ``governor.replay`` runs back through the
same policy.

    gov = Governor(cfg, clock=time.monotonic,
                   memory_probes=default_memory_probes(cfg),
                   mlx_probe=MlxMemoryProbe(mx.get_active_memory, ...),
                   load=tracker, head_bytes=head.nbytes, head_resident=True)
"""

from __future__ import annotations

import json
import threading
from collections import deque
from typing import IO, Any, Callable, Sequence

import msgspec
import structlog

from .config import GovernorConfig
from .cost_model import CostModel
from .heights import N_BUCKETS, bucket_label, bucket_top, depth_at
from .learned import learned_rows, learned_solo_depth, learned_table, start_heights
from .policy import Reason, apply_override, decide, start_depth
from .probes.base import LoadProbe, MemoryProbe, MemoryReading, MlxProbe
from .types import NORMAL, Action, CycleTelemetry, Observation, State, action_name, worst

log = structlog.get_logger("councild.governor")

# Decisions the status snapshot keeps (`councild top` scrolls them): the ones logged at info,
# newest last; a bound, so a daemon that runs for months keeps a few kilobytes of them.
RECENT_DECISIONS = 32


class Governor:
    def __init__(
        self,
        cfg: GovernorConfig | None = None,
        *,
        clock: Callable[[], float],
        memory_probes: Sequence[MemoryProbe] = (),
        mlx_probe: MlxProbe | None = None,
        load: LoadProbe | None = None,
        profile: dict[str, Any] | None = None,
        head_available: bool = True,
        head_resident: bool = False,
        head_bytes: int = 0,
        initial_depth: int | None = None,
        trace: str | IO[str] | None = None,
        logger: Any = None,
    ):
        self.cfg = cfg or GovernorConfig()
        self.clock = clock
        self.memory_probes = list(memory_probes)
        self.mlx_probe = mlx_probe
        self.load = load
        self.cost = CostModel(self.cfg, profile)
        self.log = logger or log
        self._lock = threading.RLock()
        self._head = {"head_available": head_available, "head_resident": head_resident, "head_loading": False,
                      "head_bytes": int(head_bytes), "prompt_cache_bytes": 0}  # fmt: skip
        # How many requests decode at once (note_rows): what the engine runs and waits, and
        # the limits (row_limit.py); a ceiling of 0 leaves the limit to the config.
        self._rows = {"rows_active": 0, "rows_waiting": 0, "row_limit": 0, "row_ceiling": 0, "row_cache_bytes": 0}
        depth = self.cfg.initial_depth if initial_depth is None else initial_depth
        depth = min(depth, self.cfg.max_depth) if head_resident else 0
        self.start_reason: Reason | None = None
        if profile and profile.get("cost_s"):
            # A tuned profile: start at its best depth (policy.start_depth), logged as one
            # decision, rather than at the configured depth the priors would keep us at.
            now = self.clock()
            obs = Observation(**self._head, estimates=self.cost.estimates(now), decode_s=self.cost.decode_s)
            depth, self.start_reason = start_depth(obs, self.cfg, depth)
        # A learned profile (this machine's last run) also says where each depth was left: the
        # paired probes' verdicts, which win over a score from priors or an older tuning.
        learned = (profile or {}).get("depths") or {}
        solo = learned_solo_depth(learned, self.cfg, head_resident)
        if solo is not None:
            self.start_reason = {"decision": "start_depth", "depth_from": depth, "depth_to": solo,
                                 "sentence": f"start at depth {solo}, where this machine's last run left it "
                                             f"(learned profile)"}  # fmt: skip
            depth = solo
        heights, height_reasons = start_heights(learned, self.cfg, head_resident, (profile or {}).get("lost"))
        starts = ([self.start_reason] if self.start_reason is not None else []) + height_reasons
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT_DECISIONS)
        for reason in starts:
            self.log.info("governor.decision", **{"depth": depth, "actions": [], **reason})
            self.recent.append({"t": self.clock(), "depth": depth, "actions": [], **reason})
        self.state = State(depth=depth, heights=heights, row_learned=learned_rows(profile))
        self.last_observation: Observation | None = None
        self.last_actions: list[Action] = []
        self.last_reasons: list[Reason] = []
        self._cpu_load: float | None = None
        self._trace: IO[str] | None = None
        self._own_trace = False
        if trace is not None:
            self._trace = open(trace, "a", encoding="utf-8") if isinstance(trace, str) else trace
            self._own_trace = isinstance(trace, str)
            self._write("config", cfg=msgspec.to_builtins(self.cfg), initial_depth=self.state.depth)
            if profile:
                self._write("profile", profile=profile)

    # ------------------------------------------------------------ trace

    def _write(self, kind: str, **fields: Any) -> None:
        if self._trace is None:
            return
        rec = {"t": self.clock(), "kind": kind, **fields}
        self._trace.write(json.dumps(rec, separators=(",", ":")) + "\n")
        self._trace.flush()

    def close(self) -> None:
        if self._trace is not None and self._own_trace:
            self._trace.close()
        self._trace = None

    # ------------------------------------------------------------ inputs from the daemon

    def note_head(
        self,
        *,
        resident: bool | None = None,
        loading: bool | None = None,
        available: bool | None = None,
        head_bytes: int | None = None,
    ) -> None:
        """The daemon reports what the head really is (after applying Load/Evict)."""
        with self._lock:
            for key, v in (("head_resident", resident), ("head_loading", loading),
                           ("head_available", available), ("head_bytes", head_bytes)):  # fmt: skip
                if v is not None:
                    self._head[key] = v

    def note_prompt_cache(self, nbytes: int) -> None:
        """The daemon reports the bytes its prompt caches hold now."""
        with self._lock:
            self._head["prompt_cache_bytes"] = int(nbytes)

    def note_rows(self, **rows: int) -> None:
        """The daemon reports its rows: ``rows_active``, ``rows_waiting`` (queued or parked),
        ``row_limit`` (the scheduler's now), ``row_ceiling`` (0: pinned by the config),
        ``row_cache_bytes`` (one row's caches at its context). Any subset."""
        with self._lock:
            for key, v in rows.items():
                if key not in self._rows:
                    raise ValueError(f"unknown row field {key!r}")
                self._rows[key] = int(v)

    def record_cycle(self, t: CycleTelemetry) -> None:
        with self._lock:
            now = self.clock()
            self.cost.record(t, now, self._cpu_load)
            self._write("cycle", cycle=msgspec.to_builtins(t), load=self._cpu_load)

    # ------------------------------------------------------------ sampling

    def _memory(self) -> tuple[str, int | None, str]:
        readings: list[MemoryReading] = []
        for p in self.memory_probes:
            try:
                r = p.read()
            except Exception as e:  # a probe must not raise; if one does, it is unavailable
                r = MemoryReading(source=type(p).__name__, available=False, detail=f"raised {e!r}")
            if r.available:
                readings.append(r)
        level = worst(r.level for r in readings)
        avail = [r.available_bytes for r in readings if r.available_bytes is not None]
        detail = [f"{r.source}: {r.detail}" for r in readings]
        if self.mlx_probe is not None:
            try:
                m = self.mlx_probe.read()
                room = m.headroom_bytes() if m.available else None
            except Exception:
                room = None
            if room is not None:
                avail.append(room)
                detail.append(f"mlx: room under working set {room >> 20}MiB")
        return level if readings else NORMAL, (min(avail) if avail else None), "; ".join(detail)

    def observe(self) -> dict[str, Any]:
        """Sample every probe: the raw observation (no cost estimates), as recorded."""
        now = self.clock()
        level, avail, detail = self._memory()
        ld = None
        if self.load is not None:
            try:
                ld = self.load.read(now)
            except Exception:
                ld = None
        raw: dict[str, Any] = {"pressure": level, "pressure_detail": detail, "available_bytes": avail, **self._head,
                               **({**self._rows} if self._rows["row_ceiling"] > 0 else {})}
        if ld is not None:
            raw.update(active_streams=ld.active_streams, queued=ld.queued, arrival_rate=ld.arrival_rate,
                       cpu_load=ld.cpu_load)  # fmt: skip
        return raw

    # ------------------------------------------------------------ deciding

    def _decide(self, raw: dict[str, Any], now: float) -> list[Action]:
        self._cpu_load = raw.get("cpu_load")
        obs = Observation(**raw, estimates=self.cost.estimates(now, self._cpu_load), decode_s=self.cost.decode_s,
                          lookup=self.cost.lookup_estimate(),
                          batch_estimates=self.cost.batch_estimates(now, self._cpu_load),
                          batch_decode_s=self.cost.batch_decode_s(), acceptance=self.cost.acceptance_noise())
        self.state, actions, reasons = decide(self.state, obs, now, self.cfg)
        self.last_observation, self.last_actions, self.last_reasons = obs, actions, reasons
        names = [action_name(a) for a in actions]
        for r in reasons:
            # Ticks that change nothing log at debug: four a second would drown the log; so
            # do a paired probe's alternations (its start and verdict log at info).
            quiet = r["decision"] in ("hold", "probe_step", "height_probe_step")
            (self.log.debug if quiet else self.log.info)("governor.decision",
                                                         **{"depth": self.state.depth, "actions": names, **r})
            if not quiet:
                self.recent.append({"t": now, "depth": self.state.depth, "actions": names, **r})
        return actions

    def tick(self) -> list[Action]:
        """Sample the probes, decide, and return the actions to apply at the next safe point."""
        with self._lock:
            now = self.clock()
            raw = self.observe()
            self._write("obs", obs=raw)
            return self._decide(raw, now)

    def first_measurements(self) -> frozenset[int]:
        """The buckets of batch heights whose depth is not chosen yet but which have a booked
        cycle: their first decision (height_policy's ``height_adopt``) can be taken now. Until
        it is, their batches run at a borrowed depth (``depth_at``: a neighbour's or the solo
        one), which on a GPU's fresh council was depth 1 at heights 3-4 for a whole tick
        (0.25 s of a sub-second first round) before the first decision moved them to 0."""
        with self._lock:
            hs = self.state.heights  # shorter than the buckets until a tick fills it: the rest unchosen
            return frozenset(b for b in range(1, N_BUCKETS)
                             if (b - 1 >= len(hs) or hs[b - 1].depth is None) and self.cost.batch_measured(b))

    def override(self, action: str, depth: int | None = None) -> list[Action]:
        """Operator command (pin_depth / evict_head / load_head / auto); decides at once."""
        with self._lock:
            self.state = apply_override(self.state, action, depth)
            self._write("override", action=action, depth=depth)
            return self.tick()

    # ------------------------------------------------------------ status

    @property
    def depth(self) -> int:
        return self.state.depth

    def depth_for(self, batch_height: int) -> int:
        """The depth wanted for a cycle of ``batch_height`` rows (heights.depth_at: the solo
        depth at 1 and before any batch was measured)."""
        return depth_at(tuple(h.depth for h in self.state.heights), self.state.depth, batch_height)

    def height_table(self) -> list[dict[str, Any]]:
        """Per bucket of batch heights: the depth chosen (None: not yet) and the depth a
        batch there drafts now (heights.depth_at: the nearest chosen bucket's, else solo)."""
        rows = [{"heights": bucket_label(0), "chosen": self.state.depth, "depth": self.state.depth}]
        hs = self.state.heights
        table = tuple(h.depth for h in hs)
        for b in range(1, N_BUCKETS):
            chosen = hs[b - 1].depth if b - 1 < len(hs) else None
            probing = hs[b - 1].probe_depth is not None if b - 1 < len(hs) else False
            top = bucket_top(b)
            rows.append({"heights": bucket_label(b), "chosen": chosen, "depth": depth_at(table, self.state.depth, top),
                         "probing": probing})  # fmt: skip
        return rows

    def learned(self) -> dict[str, Any]:
        """What this governor measured and chose, for the next start on this machine
        (governor/learned.py); the daemon writes it to its cache folder."""
        with self._lock:
            pressure = self.last_observation.pressure if self.last_observation else NORMAL
            return learned_table(self.cost, self.state, pressure)

    def rows(self) -> dict[str, Any]:
        """How many requests decode at once and why: the limit (None until the first tick
        with a ceiling), the ceiling, the last decision and its sentence, a probe in flight."""
        s = self.state
        return {"limit": s.row_limit, "ceiling": self._rows["row_ceiling"] or None, "decision": s.row_decision or None,
                "why": s.row_why or None, "probing_from": s.row_probe_from}  # fmt: skip

    @property
    def shedding(self) -> bool:
        return self.state.shedding

    def reconfigure(self, cfg: GovernorConfig, memory_probes: Sequence[MemoryProbe] | None = None) -> list[str]:
        """Take new settings live (SIGHUP). Measurements survive unless the depth range
        changed, since the cost model's tables are sized by max_depth. Returns the names of
        the settings that changed."""
        with self._lock:
            old = msgspec.to_builtins(self.cfg)
            new = msgspec.to_builtins(cfg)
            changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
            if cfg.max_depth != self.cfg.max_depth:
                profile = self.cost.profile()
                decode_s = self.cost.decode_s  # the decode clock runs on (the policy's probe timing)
                self.cost = CostModel(cfg, profile if any(profile.values()) else None)
                self.cost.decode_s = decode_s
                # The height table's probes referred to the old model's samples: start it afresh.
                self.state = msgspec.structs.replace(self.state, depth=min(self.state.depth, cfg.max_depth), heights=())
            else:
                self.cost.cfg = cfg
            self.cfg = cfg
            if memory_probes is not None:
                self.memory_probes = list(memory_probes)
            self._write("reconfigure", cfg=new, changed=changed)
            return changed

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            now = self.clock()
            return {
                "depth": self.state.depth,
                "depth_by_height": self.height_table(),
                "rows": self.rows(),
                "head": {**self._head, "target": self.state.head_target},
                "override": self.state.override,
                "pin_depth": self.state.pin_depth,
                "shedding": self.state.shedding,
                "pressure": self.last_observation.pressure if self.last_observation else None,
                "available_bytes": self.last_observation.available_bytes if self.last_observation else None,
                "state": msgspec.to_builtins(self.state),
                "cost_model": self.cost.snapshot(now, self._cpu_load),
                "last_actions": [action_name(a) for a in self.last_actions],
                "last_reasons": self.last_reasons,
                # Oldest first; age_s rather than the governor's clock, which readers cannot place.
                "recent_decisions": [{"age_s": round(now - d["t"], 3), **{k: v for k, v in d.items() if k != "t"}}
                                     for d in self.recent],
            }
