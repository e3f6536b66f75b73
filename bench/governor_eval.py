"""Replay evaluation of the governor: recorded traces through cost profiles of several machines.

    python bench/governor_eval.py record      # live, ~1-2 min: acceptance from the real bundled model
    python bench/governor_eval.py             # replay (no model, ~1-2 min): tables + JSON

What is measured live and what is replayed:
- LIVE (``record``, this CPU): acceptance per draft position of the real bundled model and
  its real MTP head, on code prompts and on prose prompts (the model was trained on Python
  only, so prose is the "drift" text): every cycle of a depth-4, temperature-0 exact decode,
  as the accepted prefix length 0..4, in order. Written to
  bench/results/governor_eval_acceptance.json.
- LIVE (this CPU, committed): cycle cost per depth in CPU seconds (the interleaved
  ``councild bench spec --guard ab`` run, bench/results/spec_guard_ab_cpu_run2.json), the
  tuned profile auto starts from (``councild tune``, governor_eval_cpu_profile.json), the
  batched-step cost by streams (bench/results/batch_cpu.json, tokens per CPU second), and
  cycle-time noise (cycle / median ratios of run 7's d0 daemon, governor_cpu_run7_traces).
- FROM THE ISSUE / DESIGN.md (measured on the lent H200 by another session; not re-run here):
  the H200 verify-cost rows, and the bundled model's batched throughput on the H200
  (bench/results/batch_cuda_h200.json).
- DERIVED (stated in PROFILES below): drafting cost on the H200 rows, batched-step cost where
  none was measured, and the whole Apple-Silicon profile, from the published numbers.
- REPLAYED: everything in the tables. A discrete-event simulation runs the real Governor
  (governor/runtime.py, policy, cost model: the daemon's code) against an engine whose cycle
  cost comes from the profile and whose accepted drafts come from the recorded acceptance,
  through a schedule of regimes with council-style bursts (arrivals) and pressure events.

Arms: auto (the governor, started from a tuned profile of that machine, as a deployed daemon
is), d0..d4 (fixed depth, alone and in a batch of several streams: every row drafts k), and
the oracle (for each regime phase the best fixed arm, switching free).
Every arm keeps the same memory-safety rules (head out at critical at once, after warn_evict_s
of warn; back after the restore window): pressure regimes compare depth choices, not safety.

Cycle model: a depth-k cycle costs step_s x cycle_ratio[k] x noise and yields 1 + a tokens,
a = min(recorded accepted prefix at depth 4, k) for the current text. (At temperature 0 the
drafts d1..dk from a position, and their verdicts, do not depend on k, since a verify here is
bit-identical to serial steps; what this ignores is that another depth starts its cycles at
other positions.) A batched cycle of n rows at depth k (every row drafts k, one forward
verifies n x (k + 1) positions, each row commits its own accepted prefix) costs
step_s x batch_cost[n][k] and yields the sum over rows of 1 + a_row, each row's a drawn
from the recorded acceptance in turn. Every arm batches concurrent streams: auto at the
governor's depth for that height (HeadSlot.depth_for), dk at k.

Batched cost tables: the H200 27B-shape 4-bit rows are measured forwards
(B = 1, 4, 8 x T = 1..4 positions per row, in 27 ms steps), with B = 2 interpolated, T = 5
extrapolated and drafting added (both stated in the profile's sources line); this CPU's
B = 4 row is measured (T = 1..4), B = 2 and 8 are it scaled by batch_cpu.json's batched
serial steps. The other profiles' batched speculation is derived: priced like a verify of
n x (k + 1) tokens.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
sys.path[:0] = [str(REPO)]

from governor.config import GovernorConfig, load_config  # noqa: E402
from governor.fakes import FakeClock, FakeLoad, FakeMemoryProbe  # noqa: E402
from governor.runtime import Governor  # noqa: E402
from governor.heights import N_BUCKETS, depth_at  # noqa: E402
from governor.types import CycleTelemetry, EvictHead, LoadHead, SetDepth, SetHeightDepth  # noqa: E402

ACCEPTANCE_JSON = RESULTS / "governor_eval_acceptance.json"
CPU_PROFILE_JSON = RESULTS / "governor_eval_cpu_profile.json"
CPU_SPEC_JSON = RESULTS / "spec_guard_ab_cpu_run2.json"
MAX_DEPTH = 4
HEAD_LOAD_S = 1.0
NOISE_SLOT_S = 0.05  # contention changes on this time scale (a scheduler slice or a few)  # a LoadHead lands this long after it is decided (disk read, off the step loop)

PROSE_PROMPTS = [
    "The committee reviewed the budget and concluded that",
    "Dear Maria,\n\nThank you for your letter about the garden. I",
    "In the winter of 1887 the river froze so hard that",
    "The recipe calls for two cups of flour, a pinch of salt, and",
    "Most people who visit the museum for the first time are surprised by",
    "Summary of the meeting: the team agreed to postpone the launch because",
    "She opened the door slowly and saw that the room was",
    "Why do leaves change colour in autumn? The short answer is that",
]


# ---------------------------------------------------------------- record (live)


def record(tokens: int, out: Path) -> dict:
    """Decode each prompt at depth 4, exact, temperature 0 on the real bundled model; keep
    every cycle's accepted prefix (0..4)."""
    import platform

    import mlx.core as mx

    from daemon.engine.decoders.exactness import exact_guard
    from daemon.engine.model.loading import load_model
    from daemon.engine.model.mtp_head import load_mtp_head
    from daemon.engine.decoders.sampling import Sampler
    from daemon.engine.decoders.speculative import speculative_decode
    from daemon.engine.types import DEFAULT_GUARD, SamplingParams
    from daemon.measure.fidelity import load_prompts
    from daemon.paths import BUNDLED_MODEL

    lm = load_model(BUNDLED_MODEL)
    head = load_mtp_head(lm)
    guard = exact_guard(lm, "auto", DEFAULT_GUARD)
    kinds = {
        "code": [p for p in load_prompts() if any(m in p for m in ("def ", "import ", "for i", "SELECT", "class "))],
        "prose": PROSE_PROMPTS,
    }
    result: dict = {"model": str(BUNDLED_MODEL.name), "depth": MAX_DEPTH, "tokens_per_prompt": tokens,
                    "guard": guard, "device": str(mx.default_device()), "platform": platform.platform(),
                    "kinds": {}}  # fmt: skip
    t0 = time.perf_counter()
    for kind, prompts in kinds.items():
        per_prompt = []
        for text in prompts:
            gen = speculative_decode(lm, head, lm.encode_prompt(text, None, None), Sampler(SamplingParams()),
                                     MAX_DEPTH, exact=True, guard_margin=guard)  # fmt: skip
            accepted, got = [], 0
            for step in gen:
                if step.drafted:
                    accepted.append(int(step.accepted))
                got += len(step.tokens)
                if got >= tokens:
                    break
            gen.close()
            per_prompt.append({"prompt": text, "accepted": accepted})
        flat = [a for p in per_prompt for a in p["accepted"]]
        result["kinds"][kind] = {"prompts": per_prompt, "cycles": len(flat),
                                 "conditional_acceptance": conditional_acceptance(flat)}  # fmt: skip
        print(f"{kind}: {len(prompts)} prompts, {len(flat)} cycles, conditional acceptance "
              + " ".join(f"{a:.3f}" for a in result["kinds"][kind]["conditional_acceptance"]), flush=True)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return result


def conditional_acceptance(accepted: list[int], depth: int = MAX_DEPTH) -> list[float]:
    num, den = [0] * depth, [0] * depth
    for a in accepted:
        for i in range(depth):
            den[i] += 1
            if a > i:
                num[i] += 1
            else:
                break
    return [round(n / d, 4) if d else 0.0 for n, d in zip(num, den)]


# ---------------------------------------------------------------- cost profiles


@dataclass
class Profile:
    name: str
    step_s: float  # one serial step
    cycle_ratio: list[float]  # cost of a depth-k cycle, in serial steps, k = 0..4
    # Cost of one batched cycle of n rows at depth k (k = 0..4), in serial steps.
    batch_cost: dict[int, list[float]]
    noise: str  # "cpu" (recorded ratios) or "gpu" (lognormal, sigma 2%)
    source: str  # where each number came from
    # The tuned profile auto starts from ({"cost_s", "acceptance"}); None: this profile's own
    # costs and the recorded code acceptance, as a tune on that machine would measure them.
    tuned: dict | None = None


def _cpu_noise() -> list[float]:
    """cycle / median ratios of every cycle of run 7's d0 daemon (all regimes)."""
    p = RESULTS / "governor_cpu_run7_traces" / "d0.trace.jsonl.gz"
    ts = []
    for line in gzip.decompress(p.read_bytes()).decode().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "cycle":
            ts.append(float(rec["cycle"]["cycle_s"]))
    med = statistics.median(ts)
    return [t / med for t in ts]


def _verify_like_spec_batch(verify: list[float], per_draft: float, per_cycle: float,
                            n_max: int = 8) -> dict[int, list[float]]:
    """Batched speculation where only a verify row was measured: n rows at depth k are a
    forward of n (k + 1) tokens (linear past the measured T), plus drafting (k head forwards
    of n rows, priced per position as solo) when k > 0."""
    v = [1.0] + verify
    slope = v[-1] - v[-2]
    fwd = lambda t: v[t - 1] if t <= len(v) else v[-1] + slope * (t - len(v))  # noqa: E731
    return {n: [fwd(n * (k + 1)) + ((per_draft * k + per_cycle) if k else 0.0) for k in range(MAX_DEPTH + 1)]
            for n in range(2, n_max + 1)}  # fmt: skip


def _extend_t5(row: list[float]) -> list[float]:
    """T = 1..4 measured -> T = 5: the dearer of T = 3, 4 plus the mean step per position
    over T = 1..4 (the measured rows are not monotone at T = 4 everywhere)."""
    return row + [max(row[2], row[3]) + (row[3] - row[0]) / 3]


# Measured on the H200 (27B shape, 4-bit, MLX on CUDA), forward cost relative to
# one 27 ms step, by batch height and positions per row T = 1..4.
H200_27B_FORWARD = {1: [1.00, 1.96, 2.62, 3.26], 4: [2.75, 3.28, 3.44, 3.33], 8: [4.34, 4.66, 5.02, 5.19]}
# Measured on this CPU (bundled model): a batch of 4, T = 1..4.
CPU_B4_FORWARD = [1.52, 3.35, 4.66, 4.11]
# Drafting a position (a head forward: one layer and the shared lm_head) and per-cycle host
# work, in steps: the bundled size's calibration (the H200 run of the whole cycle) for this CPU's small
# model, the ~2B/~9B assumption for the 27B shape (its head is 1 of 64 layers). Assumed.
DRAFT_BUNDLED, DRAFT_27B = (0.25, 0.2), (0.06, 0.05)


def _h200_27b_batch() -> tuple[list[float], dict[int, list[float]]]:
    fwd = {n: _extend_t5(r) for n, r in H200_27B_FORWARD.items()}
    fwd[2] = [a + (b - a) / 3 for a, b in zip(fwd[1], fwd[4])]  # linear in B between 1 and 4
    pd, pc = DRAFT_27B
    cost = {n: [r[k] + ((pd * k + pc) if k else 0.0) for k in range(MAX_DEPTH + 1)] for n, r in fwd.items()}
    return cost.pop(1), cost


# Measured on an H100 (27B shape, 4-bit, the daemon's kernels, compiled; bench/gpu_batch_spec.py
# with oracle drafts at the seed profile): whole cycles, the batch's drafting cycles built ahead.
H100_27B_DIR = RESULTS / "h100_2026-12-07c"
# B = 8 was not measured there: a B = 8 cycle is priced as B = 4's at the same depth times the
# 8-layer stack's B = 8 / B = 4 step on the H200 (issue 49: 18.3 / 13.8 ms, MLX's path). Derived.
H100_B8_OVER_B4 = 18.3 / 13.8
# A later H100 (h100_2026-12-07d): one row's own paths (serial_decode, speculative_decode with its
# pipeline: what the daemon runs for a lone request) at depths 0-5, four and eight rows at 0-3.
H100_27B_SOLO_DIR = RESULTS / "h100_2026-12-07d"


def _cycle_ms(path: Path, decode_only: bool = False) -> dict[tuple[int, str], float]:
    """(height, arm) -> ms a cycle: rows x tokens a row a cycle / tokens a second (medians).
    ``decode_only``: the rate after each arm's first step (the solo arms prefill their context
    in their first step, the batch arms before it)."""
    out = {}
    for r in json.loads(path.read_text())["results"]:
        arm = r["arm"].split(" ", 1)[1]  # drop the kernels' name: "batch d0", "spec d2 ahead"
        rate = r["median_decode_tokens_per_s"] if decode_only else r["median_tokens_per_s"]
        out[(r["height"], arm)] = 1e3 * r["height"] * r["tokens_per_row_step"] / rate
    return out


def _h100_27b_ahead() -> tuple[float, list[float], dict[int, list[float]], str]:
    """Step seconds, solo cycle ratios, batched cycle costs (in one-row steps) and the sources
    line. Depths 0-2 measured at 2 and 4 rows (built ahead), 0 and 2 at one row (the batch
    decoder's one row: not built ahead); depth 1 at one row and depths 3-4 everywhere derived."""
    base = _cycle_ms(H100_27B_DIR / "spec27_baseline_call3.json")
    ahead = _cycle_ms(H100_27B_DIR / "spec_ahead_27b_call5.json")
    step = base[(1, "batch d0")]

    def extend(row: list[float]) -> list[float]:  # d3, d4: d2 plus d2 - d1 a depth
        return row + [row[2] + (row[2] - row[1]) * j for j in (1, 2)]

    batch = {n: extend([ahead[(n, "batch d0")] / step, ahead[(n, "spec d1 ahead")] / step,
                        ahead[(n, "spec d2 ahead")] / step]) for n in (2, 4)}  # fmt: skip
    batch[8] = [x * H100_B8_OVER_B4 for x in batch[4]]
    d2 = base[(1, "spec d2")] / step
    b2 = batch[2]
    d1 = 1.0 + (d2 - 1.0) * (b2[1] - b2[0]) / (b2[2] - b2[0])  # where d1 sits between d0 and d2 at two rows
    source = (f"measured on an H100 (h100_2026-12-07c, calls 3 and 5): one row d0 {step:.2f} ms, d2 "
              f"{base[(1, 'spec d2')]:.2f} ms (the batch decoder's one row); two and four rows d0-d2 with drafting "
              "cycles built ahead; one row's d1 placed between d0 and d2 as at two rows, d3-d4 extended by d2 - d1 "
              f"a depth, eight rows = four rows x {H100_B8_OVER_B4:.2f} (issue 49's 8-layer B=8/B=4 step): derived")
    return step / 1e3, extend([1.0, d1, d2]), batch, source


def _h100_27b_solo() -> tuple[float, list[float], dict[int, list[float]], str]:
    """As ``_h100_27b_ahead`` from h100_2026-12-07d: one row's solo paths measured at depths 0-3
    (call 2) and 4 (call 4, against that run's own solo d0), four and eight rows at depths 0-3
    built ahead (call 2, in that run's one-row step); depth 4 in a batch extended by d3 - d2, two
    rows from h100_2026-12-07c's call 5 (another machine, in its own one-row step). Decode-only
    rates throughout (after each arm's first step)."""
    main = _cycle_ms(H100_27B_SOLO_DIR / "spec_ahead_27b_call2.json", decode_only=True)
    deep = _cycle_ms(H100_27B_SOLO_DIR / "spec_solo_27b_call4.json", decode_only=True)
    step = main[(1, "solo d0")]
    solo = [main[(1, f"solo d{k}")] / step for k in range(4)] + [deep[(1, "solo d4")] / deep[(1, "solo d0")]]
    batch = {}
    for n in (4, 8):
        row = [main[(n, "batch d0")] / step] + [main[(n, f"spec d{k} ahead")] / step for k in (1, 2, 3)]
        batch[n] = row + [row[3] + (row[3] - row[2])]
    _, _, earlier, _ = _h100_27b_ahead()
    batch[2] = earlier[2]
    source = (f"measured on an H100 (h100_2026-12-07d, calls 2 and 4; decode-only rates): one row's solo paths d0 "
              f"{step:.2f} ms, d1-d4 {', '.join(f'{x:.2f}' for x in solo[1:])} steps; four and eight rows d0-d3 built "
              "ahead; a batch's d4 extended by d3 - d2; two rows from h100_2026-12-07c call 5 (another machine)")
    return step / 1e3, solo, batch, source


def _cpu_spec_batch() -> dict[int, list[float]]:
    """B = 4 measured; B = 2, 8 scaled by batch_cpu.json's batched serial step ratio to B = 4.
    Drafting a position in a batch of n costs the solo estimate times the n-row forward's
    T = 1 cost (compute-bound: the head's forward grows with its rows as the model's does)."""
    b4 = _extend_t5(CPU_B4_FORWARD)
    serial = _cpu_batch()
    pd, pc = DRAFT_BUNDLED
    out = {}
    for n in (2, 4, 8):
        scale = serial[n] / serial[4]
        row = [x * scale for x in b4]
        out[n] = [row[k] + ((pd * row[0] * k + pc) if k else 0.0) for k in range(MAX_DEPTH + 1)]
    return out


def _serial_batches(batch: dict[int, float], cycle_ratio: list[float]) -> dict[int, list[float]]:
    """Batched serial steps measured, speculation in a batch not: a depth-k batch priced as the
    serial batch times the solo depth-k cycle ratio (what a time-sliced guess would say)."""
    return {n: [c * r for r in cycle_ratio] for n, c in batch.items() if n > 1}


def _verify_like_batch(verify: list[float], n_max: int = 8) -> dict[int, float]:
    """A batch of n rows is a forward of n rows: priced like a verify of T = n tokens,
    linearly extrapolated past the measured T."""
    v = [1.0] + verify  # T = 1..len
    slope = v[-1] - v[-2]
    return {n: (v[n - 1] if n <= len(v) else v[-1] + slope * (n - len(v))) for n in range(1, n_max + 1)}


def load_profiles() -> list[Profile]:
    profiles = []
    # This CPU: seconds of CPU per cycle by depth from the interleaved spec bench (exact mode
    # as the daemon runs it now: no guard), = tokens per cycle / tokens per CPU second. Its
    # wall clock was the loaded box's (load average 8-11), so CPU time is the cleaner cost;
    # the noise of the wall clock comes back through the recorded cycle ratios.
    spec = json.loads(CPU_SPEC_JSON.read_text())["arms"]
    cpu_cycle = [1.0 / spec["serial"]["tok_per_cpu_s"]["median"]] + [
        spec[f"capture/d{k}/probe"]["tokens_per_cycle"] / spec[f"capture/d{k}/probe"]["tok_per_cpu_s"]["median"]
        for k in range(1, MAX_DEPTH + 1)
    ]
    tuned = json.loads(CPU_PROFILE_JSON.read_text())
    profiles.append(Profile(
        "cpu (this box)", cpu_cycle[0], [c / cpu_cycle[0] for c in cpu_cycle], _cpu_spec_batch(), "cpu",
        "measured: CPU ms per cycle " + ", ".join(f"d{k} {1e3 * c:.2f}" for k, c in enumerate(cpu_cycle))
        + " (spec_guard_ab_cpu_run2.json, probe arms); batched cycles: the measured B=4 forward T=1..4 "
        f"{CPU_B4_FORWARD} (T=5 extrapolated), B=2/8 scaled by batch_cpu.json's batched serial steps, drafting "
        f"{DRAFT_BUNDLED[0]} x (the n-row forward) per position + {DRAFT_BUNDLED[1]} per cycle (assumed); "
        "noise: run 7's recorded cycles; auto starts from a live `councild tune` taken on the loaded box "
        f"({tuned.get('created')}, governor_eval_cpu_profile.json)",
        tuned={"cost_s": tuned["cost_s"], "acceptance": tuned["acceptance"]},
    ))  # fmt: skip
    # H200 rows (DESIGN.md, MLX 0.32.4 on CUDA, median of 9 synced forwards).
    # Drafting: a depth-k cycle also runs k head forwards (one decoder layer + the shared
    # lm_head) and per-cycle host work. Calibrated on the one H200 run of the whole cycle
    # (spec_gpu_h200_tiny_qwen35.md: capture/d1 4.79 ms = 2.29 steps with 0.23 guard redos
    # per cycle, verify T=2 1.60 steps -> ~0.45 step of drafting and host work): bundled size
    # 0.25 step per drafted position + 0.2 per cycle; for the ~2B/~9B shapes (24-32 layers,
    # an assumption: the rows do not say) 0.06 per position + 0.05 per cycle.
    h200 = [("~2B 4-bit", 7.73e-3, [1.32, 1.50, 1.81, 2.03], 0.06, 0.05),
            ("~2B bf16", 7.26e-3, [1.61, 1.71, 2.01, 2.15], 0.06, 0.05),
            ("~9B 4-bit", 11.65e-3, [1.52, 1.99, 2.44, 2.96], 0.06, 0.05),
            ("~9B bf16", 10.85e-3, [1.48, 1.67, 1.86, 2.07], 0.06, 0.05),
            ("bundled-size 4-bit", 1.65e-3, [1.06, 1.31, 1.36, 1.69], 0.25, 0.2)]  # fmt: skip
    h200_bundled_batch = _h200_batch()
    for name, step, verify, per_draft, per_cycle in h200:
        ratios = [1.0] + [verify[k - 1] + per_draft * k + per_cycle for k in range(1, MAX_DEPTH + 1)]
        bundled = name.startswith("bundled")
        batch = (_serial_batches(h200_bundled_batch, ratios) if bundled
                 else _verify_like_spec_batch(verify, per_draft, per_cycle))  # fmt: skip
        profiles.append(Profile(
            f"H200 {name}", step, ratios, batch, "gpu",
            f"measured H200 row (verify T=2..5 {verify}); drafting {per_draft}/position + {per_cycle}/cycle (derived); "
            + ("batched serial steps measured (batch_cuda_h200.json), batched depth k priced as that times the solo "
               "cycle ratio (derived)" if bundled else "batched cycles priced like verifies of n(k+1) tokens (derived)"),
        ))  # fmt: skip
    solo, batch = _h200_27b_batch()
    profiles.append(Profile(
        "H200 27B 4-bit (batched)", 0.027, solo, batch, "gpu",
        "measured on the H200: forward cost in 27 ms steps by batch height and positions T=1..4 "
        f"{H200_27B_FORWARD}; B=2 interpolated (linear in B between 1 and 4), T=5 extrapolated, drafting "
        f"{DRAFT_27B[0]}/position + {DRAFT_27B[1]}/cycle (assumed); auto starts from these solo costs as a tune",
    ))  # fmt: skip
    step, solo, batch, source = _h100_27b_ahead()
    profiles.append(Profile("H100 27B 4-bit (cycles built ahead)", step, solo, batch, "gpu",
                            source + "; auto starts from these solo costs as a tune"))
    step, solo, batch, source = _h100_27b_solo()
    profiles.append(Profile("H100 solo paths, 27B 4-bit (eight rows measured)", step, solo, batch, "gpu",
                            source + "; auto starts from these solo costs as a tune"))
    # Apple Silicon (derived from published numbers, DESIGN.md): MTPLX, Qwen3.6-27B 4-bit on an
    # M5 Max, depth 3: 28 -> 63 tok/s (2.24x) with acceptance 0.976 / 0.952 / 0.881 (taken as
    # conditional): E(3) = 1 + .976 + .976*.952 + .976*.952*.881 = 3.71 tokens per cycle, so
    # a depth-3 cycle costs 3.71 / 2.24 = 1.66 steps; linear in depth: 1 + 0.22 k (check: the
    # seed's verify of 2 tokens on a 27B M4 Max at 1.14 steps + a ~0.06 head forward = 1.20
    # ~ 1.22 at k = 1). Batched steps priced like a verify of n rows: 1 + 0.14 (n - 1).
    # Step: 1 / 28 tok/s.
    e3 = 1 + 0.976 + 0.976 * 0.952 + 0.976 * 0.952 * 0.881
    per_depth = (e3 / 2.24 - 1) / 3
    apple = [1 + per_depth * k for k in range(MAX_DEPTH + 1)]
    profiles.append(Profile(
        "Apple M5 Max 27B (derived)", 1 / 28, apple,
        {n: [1 + 0.14 * (n * (k + 1) - 1) + 0.06 * k for k in range(MAX_DEPTH + 1)] for n in range(2, 9)}, "gpu",
        f"derived: MTPLX depth 3 2.24x with E(3) {e3:.2f} -> {per_depth:.3f} step per depth; a batch of n rows at "
        "depth k: a verify of n(k+1) tokens, 1 + 0.14 (n(k+1) - 1), plus 0.06 per drafted position",
    ))  # fmt: skip
    return profiles


def _cpu_batch() -> dict[int, float]:
    data = json.loads((RESULTS / "batch_cpu.json").read_text())
    return _batch_rows(data, cpu=True)


def _h200_batch() -> dict[int, float]:
    data = json.loads((RESULTS / "batch_cuda_h200.json").read_text())
    return _batch_rows(data, cpu=False)


def _batch_rows(data: dict, cpu: bool) -> dict[int, float]:
    """n / (batched / time-sliced throughput) per stream count, from batch_bench's JSON
    ("batch_fast": batched rows without the guard, what the daemon runs where batched rows
    are exact; per CPU second on the CPU, where the wall clock is the shared box's)."""
    out = {}
    for r in data["throughput"]:
        n = int(r["streams"])
        key = "per_cpu_second_median" if cpu else "median"
        out[n] = n / (r["batch_fast"][key] / r["serial"][key])
    out[1] = 1.0  # one stream does not batch (the daemon speculates or steps it alone)
    return out


# ---------------------------------------------------------------- schedule (arrivals, pressure)


@dataclass
class Phase:
    name: str
    seconds: float  # wall seconds
    streams: int = 1
    pressure: str = "normal"
    text: str = "code"


@dataclass
class Regime:
    name: str
    phases: list[Phase]


def schedule(seg_s: float) -> list[Regime]:
    """One continuous timeline; each regime seg_s wall seconds (the governor carries its
    state across, as a daemon does). Arrivals: council bursts, 10 s of demand then 5 s idle."""
    half = seg_s / 2
    return [
        Regime("quiet", [Phase("quiet", seg_s)]),
        Regime("council 2", [Phase("council 2", seg_s, streams=2)]),
        Regime("council 4", [Phase("council 4", seg_s, streams=4)]),
        Regime("council 8", [Phase("council 8", seg_s, streams=8)]),
        Regime("quiet again", [Phase("quiet again", seg_s)]),
        Regime("memory warn", [Phase("warn", seg_s, pressure="warn")]),
        Regime("memory critical", [Phase("critical spike", 15.0, pressure="critical"),
                                   Phase("after critical", seg_s - 15.0)]),
        Regime("drift code->prose", [Phase("code", half, text="code"), Phase("prose", seg_s - half, text="prose")]),
    ]  # fmt: skip


BURST_ON_S, BURST_OFF_S = 10.0, 5.0


def demand_on(t: float) -> bool:
    return (t % (BURST_ON_S + BURST_OFF_S)) < BURST_ON_S


# ---------------------------------------------------------------- the simulation


class Acceptance:
    """The recorded accepted prefixes of one text kind, drawn in recorded order."""

    def __init__(self, cycles: list[int]):
        self.cycles, self.i = cycles, 0

    def next(self, k: int) -> int:
        a = self.cycles[self.i % len(self.cycles)]
        self.i += 1
        return min(a, k)


@dataclass
class MemoryRules:
    """The governor's head-safety rules, for the fixed arms (same defaults as GovernorConfig)."""

    cfg: GovernorConfig
    resident: bool = True
    warn_since: float | None = None
    last_bad: float | None = None
    normal_since: float | None = 0.0
    evicted_at: float | None = None

    def update(self, pressure: str, t: float) -> None:
        c = self.cfg
        if pressure != "normal":
            self.last_bad = t
            self.warn_since = self.warn_since if self.warn_since is not None else t
            self.normal_since = None
        else:
            self.normal_since = self.normal_since if self.normal_since is not None else t
            if self.warn_since is not None and self.last_bad is not None and t - self.last_bad >= c.warn_clear_s:
                self.warn_since = None
        if self.resident and (pressure == "critical" or (self.warn_since is not None and t - self.warn_since >= c.warn_evict_s)):
            self.resident, self.evicted_at = False, t
        elif (not self.resident and pressure == "normal" and self.normal_since is not None
              and t - self.normal_since >= c.restore_window_s and t - (self.evicted_at or 0.0) >= c.min_reload_gap_s):
            self.resident = True  # fmt: skip


@dataclass
class ArmResult:
    tokens: dict = field(default_factory=dict)  # phase -> tokens
    busy_s: dict = field(default_factory=dict)  # phase -> seconds of demand
    cycles_by_depth: dict = field(default_factory=dict)
    decisions: dict = field(default_factory=dict)


def simulate(profile: Profile, arm: str, regimes: list[Regime], acceptance: dict[str, list[int]],
             noise: list[float], cfg: GovernorConfig, seed: int = 0) -> ArmResult:
    """One arm through the whole timeline. ``arm``: "auto" or "d0".."d4"."""
    rng = random.Random(seed)
    clock = FakeClock(0.0)
    acc = {kind: Acceptance(cycles) for kind, cycles in acceptance.items()}
    res = ArmResult()
    mem = FakeMemoryProbe(available_bytes=64 << 30)
    load = FakeLoad(active=0, cpu_load=0.2)
    gov = None
    fixed = None if arm == "auto" else int(arm[1:])
    rules = MemoryRules(cfg)
    head_resident, head_arrives = True, None
    depth = fixed or 0
    heights: list[int | None] = [None] * (N_BUCKETS - 1)  # auto's depth per bucket of batch heights
    if arm == "auto":
        tuned = profile.tuned or {
            "cost_s": {str(k): profile.step_s * profile.cycle_ratio[k] for k in range(MAX_DEPTH + 1)},
            "acceptance": conditional_acceptance(acceptance["code"])}  # fmt: skip
        gov = Governor(cfg, clock=clock, memory_probes=[mem], load=load, profile=tuned, head_resident=True,
                       head_bytes=850 << 20, logger=_Quiet())  # fmt: skip
        depth = gov.depth
    next_tick = 0.0

    # Contention is a property of the moment, not of the arm: the noise is a function of
    # time (one draw per NOISE_SLOT_S), the same for every arm of a seed (common random
    # numbers), so the arms' differences are not noise and the oracle's max is not biased.
    slots = int(sum(p.seconds for r in regimes for p in r.phases) / NOISE_SLOT_S) + 2
    if profile.noise == "cpu":
        table = [noise[rng.randrange(len(noise))] for _ in range(slots)]
    else:
        table = [math.exp(rng.gauss(0.0, 0.02)) for _ in range(slots)]

    def draw_noise() -> float:
        return table[min(int(clock.t / NOISE_SLOT_S), slots - 1)]

    t_end = 0.0
    for regime in regimes:
        for ph in regime.phases:
            t_end += ph.seconds
            mem.level = ph.pressure
            res.tokens.setdefault(ph.name, 0)
            res.busy_s.setdefault(ph.name, 0.0)
            while clock.t < t_end:
                on = demand_on(clock.t)
                streams = ph.streams if on else 0
                load.active = streams
                if gov is not None and clock.t >= next_tick:
                    for a in gov.tick():
                        if isinstance(a, SetDepth):
                            depth = a.depth
                        elif isinstance(a, SetHeightDepth):
                            heights[a.bucket - 1] = a.depth
                        elif isinstance(a, EvictHead):
                            head_resident = False
                            gov.note_head(resident=False)
                        elif isinstance(a, LoadHead):
                            head_arrives = clock.t + HEAD_LOAD_S
                            gov.note_head(loading=True)
                        res.decisions[type(a).__name__] = res.decisions.get(type(a).__name__, 0) + 1
                    next_tick += cfg.tick_s
                if gov is not None and head_arrives is not None and clock.t >= head_arrives:
                    head_resident, head_arrives = True, None
                    gov.note_head(resident=True, loading=False)
                if gov is None:
                    rules.update(ph.pressure, clock.t)
                    head_resident = rules.resident
                if not on:
                    # Idle: the step loop sleeps until the next tick or the next burst.
                    nxt = (clock.t // (BURST_ON_S + BURST_OFF_S) + 1) * (BURST_ON_S + BURST_OFF_S)
                    clock.t = min(nxt, t_end) if gov is None else min(nxt, next_tick, t_end)
                    continue
                k = depth if head_resident else 0
                if streams > 1:
                    # Several streams: one batched cycle of every row at the height's depth
                    # (auto: the governor's table, HeadSlot.depth_for; dk: k).
                    if gov is not None:
                        k = depth_at(tuple(heights), depth, streams) if head_resident else 0
                    rows = [acc[ph.text].next(k) if k else 0 for _ in range(streams)]
                    dt = profile.step_s * profile.batch_cost[streams][k] * draw_noise()
                    got = streams + sum(rows)
                    tel = CycleTelemetry(depth=k, cycle_s=dt, drafted=streams * k, accepted=sum(rows), emitted=got,
                                         batch=streams, row_accepted=tuple(rows) if k else None)  # fmt: skip
                    kk = f"b{streams}:{k}"
                else:
                    a = acc[ph.text].next(k) if k else 0
                    dt = profile.step_s * profile.cycle_ratio[k] * draw_noise()
                    got = 1 + a
                    tel = CycleTelemetry(depth=k, cycle_s=dt, drafted=k, accepted=a, emitted=got)
                    kk = k
                if gov is not None:
                    gov.record_cycle(tel)
                res.cycles_by_depth[kk] = res.cycles_by_depth.get(kk, 0) + 1
                clock.advance(dt)
                res.tokens[ph.name] += got
                res.busy_s[ph.name] += dt
    return res


class _Quiet:
    def debug(self, *a, **k) -> None:
        pass

    info = debug


# ---------------------------------------------------------------- evaluation


def evaluate(profile: Profile, regimes, acceptance, noise, cfg, seed: int) -> dict:
    arms = ["auto"] + [f"d{k}" for k in range(MAX_DEPTH + 1)]
    runs = {a: simulate(profile, a, regimes, acceptance, noise, cfg, seed) for a in arms}
    per_regime: dict = {}
    for rg in regimes:
        row = {}
        for a in arms:
            tok = sum(runs[a].tokens[p.name] for p in rg.phases)
            busy = sum(runs[a].busy_s[p.name] for p in rg.phases)
            row[a] = tok / busy if busy else 0.0
        # Oracle: per phase, the best fixed arm's rate, over the phase's demand time (the
        # same wall time for every arm, so rates over it add up as tokens would).
        orc_tok = orc_busy = 0.0
        for p in rg.phases:
            best = max((runs[a].tokens[p.name] / runs[a].busy_s[p.name], a) for a in arms[1:] if runs[a].busy_s[p.name])
            busy = statistics.mean(runs[a].busy_s[p.name] for a in arms[1:])
            orc_tok += best[0] * busy
            orc_busy += busy
        row["oracle"] = orc_tok / orc_busy if orc_busy else 0.0
        row["best_phase_arms"] = [max(arms[1:], key=lambda a: runs[a].tokens[p.name] / max(runs[a].busy_s[p.name], 1e-9))
                                  for p in rg.phases]  # fmt: skip
        per_regime[rg.name] = row
    overall = {a: sum(runs[a].tokens.values()) / sum(runs[a].busy_s.values()) for a in arms}
    # Overall = the mean of the regime rates (each regime weighs the same, as in the goal),
    # and the plain tokens / time (which weighs the council regimes by their larger output).
    mean_of = {a: statistics.mean(per_regime[r.name][a] for r in regimes) for a in [*arms, "oracle"]}
    return {"profile": profile.name, "source": profile.source, "step_ms": round(profile.step_s * 1e3, 3),
            "cycle_ratio": [round(x, 3) for x in profile.cycle_ratio],
            "batch_cost": {str(n): [round(x, 3) for x in v] for n, v in sorted(profile.batch_cost.items())},
            "per_regime": per_regime, "overall_tokens_per_s": overall, "mean_of_regimes": mean_of,
            "auto_cycles": {str(k): v for k, v in runs["auto"].cycles_by_depth.items()},
            "auto_actions": runs["auto"].decisions}  # fmt: skip


def markdown(results: list[dict], meta: dict) -> str:
    lines = [
        "## Governor replay evaluation (REPLAYED: a simulation; see the sources line under each profile)",
        "",
        f"Acceptance (LIVE, recorded {meta['acceptance_recorded']} on this CPU from the bundled model, depth 4, "
        f"exact, temperature 0): code {meta['acceptance']['code']} ({meta['cycles']['code']} cycles), prose "
        f"{meta['acceptance']['prose']} ({meta['cycles']['prose']} cycles), conditional by position.",
        f"Schedule: {meta['schedule']}. Seeds: {meta['seeds']} (rates are medians over seeds; auto / oracle "
        "shows the median and, in brackets, the range over seeds).",
        "",
        "Measured live for this evaluation: the acceptance above, this CPU's costs (its sources line). Everything "
        "in the tables is replayed. No GPU was used here: the H200 rows are measurements another session made "
        "on the lent H200 (DESIGN.md), not re-run; the Apple profile is derived from published numbers.",
        "",
    ]
    goal_rows = []
    for r in results:
        regs = list(r["per_regime"])
        arms = ["auto", "d0", "d1", "d2", "d3", "d4", "oracle"]
        lines += [f"### {r['profile']}", "", f"Sources: {r['source']}. Step {r['step_ms']} ms; cycle cost in steps "
                  f"by depth {r['cycle_ratio']}; batched cycle in steps by rows, then depth 0..4: "
                  + "; ".join(f"{n}: {v}" for n, v in r["batch_cost"].items()) + ".", "",
                  "| regime | " + " | ".join(arms) + " | auto / oracle | best fixed |",
                  "|---|" + "---|" * (len(arms) + 2)]  # fmt: skip
        for g in regs:
            row = r["per_regime"][g]
            ratio = row["auto"] / row["oracle"] if row["oracle"] else float("nan")
            lo, hi = r["ranges"][g]
            lines.append(f"| {g} | " + " | ".join(f"{row[a]:.1f}" for a in arms)
                         + f" | {ratio:.3f} ({lo:.3f}-{hi:.3f}) | {'/'.join(row['best_phase_arms'])} |")
        m = r["mean_of_regimes"]
        fixed_best = max(["d0", "d1", "d2", "d3", "d4"], key=lambda a: m[a])
        lines.append("| mean of regimes | " + " | ".join(f"{m[a]:.1f}" for a in arms)
                     + f" | {m['auto'] / m['oracle']:.3f} | {fixed_best} |")
        lines += ["", f"Auto's cycles by depth: {r['auto_cycles']}; its actions: {r['auto_actions']}.", ""]
        worst = min(r["per_regime"][g]["auto"] / r["per_regime"][g]["oracle"] for g in regs)
        ahead = m["auto"] / m[fixed_best]
        goal_rows.append((r["profile"], worst, min(r["ranges"][g][0] for g in regs), fixed_best, ahead,
                          worst >= 0.97, ahead > 1.0))
    lines += ["### Goals (replayed)", "",
              "| profile | worst regime auto / oracle (median) | worst over seeds | best fixed overall | auto / it | within 3% everywhere | ahead overall |",
              "|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, worst, worst_seed, fb, ahead, ok1, ok2 in goal_rows:
        lines.append(f"| {name} | {worst:.3f} | {worst_seed:.3f} | {fb} | {ahead:.3f} | {'yes' if ok1 else 'NO'} | "
                     f"{'yes' if ok2 else 'NO'} |")
    return "\n".join(lines) + "\n"


def run_eval(seg_s: float, seeds: list[int], out: Path, md: Path | None, only: str | None = None,
             governor: dict | None = None) -> dict:
    rec = json.loads(ACCEPTANCE_JSON.read_text())
    acceptance = {k: [a for p in v["prompts"] for a in p["accepted"]] for k, v in rec["kinds"].items()}
    noise = _cpu_noise()
    cfg = load_config(governor)
    regimes = schedule(seg_s)
    results = []
    t0 = time.perf_counter()
    for prof in load_profiles():
        if only and only not in prof.name:
            continue
        per_seed = [evaluate(prof, regimes, acceptance, noise, cfg, s) for s in seeds]
        mid = _median_result(per_seed)
        mid["ranges"] = {g: (min(r["per_regime"][g]["auto"] / r["per_regime"][g]["oracle"] for r in per_seed),
                             max(r["per_regime"][g]["auto"] / r["per_regime"][g]["oracle"] for r in per_seed))
                         for g in mid["per_regime"]}  # fmt: skip
        mid["seeds"] = per_seed
        results.append(mid)
        print(f"{prof.name}: done ({time.perf_counter() - t0:.0f}s)", file=sys.stderr, flush=True)
    meta = {
        "command": "python bench/governor_eval.py " + " ".join(sys.argv[1:]),
        "acceptance_recorded": rec.get("recorded_at", "?"),
        "acceptance": {k: v["conditional_acceptance"] for k, v in rec["kinds"].items()},
        "cycles": {k: v["cycles"] for k, v in rec["kinds"].items()},
        "schedule": f"{len(regimes)} regimes of {seg_s:.0f} s wall each in one timeline (quiet, council 2/4/8, quiet "
                    f"again, memory warn, critical 15 s then normal, drift code->prose at half time); demand in "
                    f"bursts of {BURST_ON_S:.0f} s on / {BURST_OFF_S:.0f} s off; GovernorConfig "
                    f"{json.dumps(governor) if governor else 'default'}",
        "seeds": seeds,
        "governor_config": governor or "default",
    }
    data = {"meta": meta, "results": results}
    out.write_text(json.dumps(data, indent=1, default=str) + "\n")
    table = markdown(results, meta)
    print(table)
    if md:
        md.write_text(table)
    return data


def _median_result(per_seed: list[dict]) -> dict:
    """Per regime and arm, the median over seeds; the rest from the median seed."""
    base = json.loads(json.dumps(per_seed[len(per_seed) // 2]))
    for g, row in base["per_regime"].items():
        for a in list(row):
            if a != "best_phase_arms":
                row[a] = statistics.median(r["per_regime"][g][a] for r in per_seed)
    for key in ("overall_tokens_per_s", "mean_of_regimes"):
        for a in base[key]:
            base[key][a] = statistics.median(r[key][a] for r in per_seed)
    return base


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", nargs="?", choices=("replay", "record"), default="replay")
    ap.add_argument("--tokens", type=int, default=128, help="record: tokens per prompt")
    ap.add_argument("--segment-s", type=float, default=90.0, help="replay: wall seconds per regime")
    ap.add_argument("--seeds", default="0,1,2", help="replay: noise seeds")
    ap.add_argument("--profile", default=None, help="replay only profiles whose name contains this")
    ap.add_argument("--out", default=str(RESULTS / "governor_eval.json"))
    ap.add_argument("--from-json", default=None, metavar="JSON", help="rewrite the markdown of an earlier replay")
    ap.add_argument("--md", default=str(RESULTS / "governor_eval.md"))
    ap.add_argument("--governor", default=None, metavar="JSON",
                    help='replay: a [governor] table for every auto arm, e.g. \'{"depth_margin": 0.05}\'')
    a = ap.parse_args(argv)
    if a.what == "record":
        rec = record(a.tokens, ACCEPTANCE_JSON)
        rec["recorded_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        ACCEPTANCE_JSON.write_text(json.dumps(rec, indent=1) + "\n")
        return 0
    if a.from_json:
        data = json.loads(Path(a.from_json).read_text())
        table = markdown(data["results"], data["meta"])
        print(table)
        if a.md:
            Path(a.md).write_text(table)
        return 0
    run_eval(a.segment_s, [int(s) for s in a.seeds.split(",")], Path(a.out), Path(a.md) if a.md else None, a.profile,
             json.loads(a.governor) if a.governor else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
