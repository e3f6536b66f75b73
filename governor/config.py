"""Every threshold and window the governor uses, with its default and why.

The daemon's config file carries a free-form ``governor`` table; ``load_config`` turns it
into a ``GovernorConfig`` (unknown keys are an error, so a typo does not silently fall back
to a default).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
from msgspec import Struct

MiB = 1 << 20


class LinuxThresholds(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Where the Linux signals turn warn / critical. Each signal is optional; the worst wins."""

    # PSI "some" avg10 is the % of the last 10 s in which at least one task stalled on
    # memory. 10% is when reclaim starts to show up in latency; 40% is thrashing.
    psi_some_warn: float = 10.0
    psi_some_critical: float = 40.0
    # "full" means every runnable task stalled at once: far more serious per point.
    psi_full_warn: float = 2.0
    psi_full_critical: float = 10.0
    # cgroup v2 headroom as a fraction of the effective limit (min of memory.high and
    # memory.max). Past memory.high the kernel throttles us; past memory.max it OOM-kills.
    # 10% of a 64 GB limit is ~6 GB: about one MTP head plus a long prompt's caches.
    cgroup_warn_frac: float = 0.10
    cgroup_critical_frac: float = 0.03
    # MemAvailable as a fraction of MemTotal. Below 5% the kernel is about to reclaim hard
    # (and with no swap, the OOM killer is next).
    memavail_warn_frac: float = 0.10
    memavail_critical_frac: float = 0.05
    # Absolute MemAvailable thresholds; when set they replace the fractions. Needed where
    # the other signals stay silent (no swap: PSI reads 0 until the end; cgroup v1), and by
    # tests that set them relative to the memory free when they start.
    memavail_warn_bytes: int | None = None
    memavail_critical_bytes: int | None = None


class GovernorConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    # ---------------------------------------------------------------- cadence
    # 250 ms: four looks a second catches a pressure spike well before the kernel's
    # 10 s PSI window fills, and costs nothing next to a decode cycle (tens of ms).
    tick_s: float = 0.25

    # ---------------------------------------------------------------- depth
    # Matches daemon SpeculationConfig.max_depth: the seed measured depth 4 as a regression
    # (0.85-0.97x), so deeper is never worth a slot.
    max_depth: int = 4
    # Depth used before there are measurements (daemon SpeculationConfig.depth), when no
    # tuned profile (`councild tune`) matches: a profile's best depth replaces it
    # (policy.start_depth), since the profile measured this machine and this is a guess.
    initial_depth: int = 1
    # The margin a depth change needs is noise-aware (depth_rules.margin_for): a depth must
    # score max(depth_margin_min, exp(depth_noise_z x noise) - 1) better, where noise is the
    # standard error of the two scores' log ratio, measured live (the spread of each depth's
    # recent cycle costs, the sampling noise of the acceptance). A fixed 10% was too much
    # where costs are steady (GPU tables: neighbouring depths 3-6% apart, the governor stuck
    # 6% below the best fixed depth in councils) and too little where they swing (a
    # contended CPU: a fixed 3% let noise start moves and probes that cost 8% in a council
    # of 8): bench/results/governor_eval_noise_2026-12-01/README.md.
    #
    # depth_margin: the edge needed where no live spread stands behind a score (a tuned
    # profile's numbers or the prior: the start depth, the head's predicted gain, an
    # estimate not yet measured), since its noise is unknown: the measured gains are 6-20%
    # and a prior's error is of that order, so 10%.
    depth_margin: float = 0.10
    # The floor with the noise measured: the error the spread cannot see. The window's spread
    # sees only noise faster than the window (32 GPU cycles are 50-100 ms: they share one
    # moment's clocks and heat), and E(k) is a model (the recorded acceptance's conditional
    # rates differ by a few % between texts): below a 3% edge, being right gains no more
    # than that error.
    depth_margin_min: float = 0.03
    # How many standard errors an edge must clear: 2 is a one-sided test at ~98%, so two
    # equally good depths pass for different in about 1 comparison of 40; a wrong verdict
    # costs a probe interval (30 s of decoding) at a worse depth, a missed small edge costs
    # less than the edge, so err on the side of staying.
    depth_noise_z: float = 2.0
    # After a depth change, wait this long before the next one, so the new depth collects
    # samples (20-50 cycles at 20-50 tok/s) before it is judged.
    depth_dwell_s: float = 1.0
    # With this many active streams, batch them at depth 0: speculation buys latency at
    # batch 1, not throughput.
    batch_streams: int = 2
    # Probe a stale neighbouring depth at most this often, for probe_s. Both count seconds
    # of decoding (the cost model's sum of cycle times), not wall-clock seconds: idle time
    # between bursts does not move costs, and on the wall clock every burst after a gap
    # began with a probe (bench/results/README_governor.md, finding 2). 30 s of decoding is
    # long enough for load to have changed the costs; 2 s is ~50-100 cycles, enough to
    # re-anchor a depth's cost, short enough that a bad probe costs < 2 s of 10-20%.
    probe_interval_s: float = 30.0
    probe_s: float = 2.0
    # A probe alternates the probed and the current depth tick by tick (paired, so a change
    # of load, council or text during it lands on both sides) and ends once both depths
    # have cost_window new cycles (their medians then hold only the probe's cycles) and
    # probe_s of decoding passed, or after this many probe_s at most, whichever comes first.
    probe_max_factor: float = 4.0
    # A head that left because it did not pay (idle at depth 0) is loaded again on trial
    # after this many seconds of decoding, under the normal reload conditions (calm
    # pressure for the restore window, headroom, anti-thrash gap, one stream), and depth 1
    # is probed against serial once: kept if it scores depth_margin better, else the head
    # leaves at once. Each failed trial doubles the wait, up to head_trial_backoff_max times
    # it, so a machine where speculation never pays loads the head about once every
    # 120 x 8 s of decoding. 0 turns trials off (the head then returns only on a predicted gain).
    head_trial_interval_s: float = 120.0
    head_trial_backoff_max: int = 8

    # ---------------------------------------------------------------- rows at once
    # With scheduler.max_active = "auto" (governor/row_limit.py): after a change of the
    # limit, wait this long before the next, so the new height collects cycles (a batched
    # cycle is 20-100 ms: tens of them) before it is judged; a step up or down is one row.
    row_dwell_s: float = 2.0
    # Critical memory pressure takes the limit straight down to this many rows (warn steps
    # down one row per row_dwell_s, to it at most); requests above it finish, none is dropped.
    row_floor: int = 1
    # One more row is admitted only while the memory headroom holds its caches at the
    # context a request may reach plus this margin (MLX's allocator rounding, a prompt's
    # transient activations).
    row_margin_bytes: int = 256 * MiB

    # ---------------------------------------------------------------- head residency
    # Warn sustained this long evicts the head (~850 MB for a 27B): shed fast.
    warn_evict_s: float = 30.0
    # A warn episode ends only after this much continuous normal, so a signal flapping
    # between normal and warn counts as sustained warn rather than restarting the clock.
    warn_clear_s: float = 10.0
    # The head unused (depth 0) this long is evicted: five minutes of batching or of
    # "speculation does not pay" is not a blip.
    idle_evict_s: float = 300.0
    # Restore slowly: reload only after this much continuous normal pressure.
    restore_window_s: float = 60.0
    # And never sooner than this after an eviction (anti-thrash: a load costs seconds of
    # disk reads and ~850 MB; two per minute would cost more than speculation earns).
    min_reload_gap_s: float = 120.0
    # Headroom must cover the head plus this margin: 512 MB is room for the head's KV and
    # for MLX's allocator rounding, on top of the weights.
    head_margin_bytes: int = 512 * MiB
    # A LoadHead that has not produced a resident head after this long is taken as failed.
    load_timeout_s: float = 120.0
    # When true, critical pressure beats operator overrides (pin/force_load). Off: the
    # operator's word wins until released, as documented; the decision log shows the risk.
    critical_beats_override: bool = False

    # ---------------------------------------------------------------- admissions
    # Under critical pressure new requests are refused with this retry hint: about the time
    # an eviction plus a cache clear takes to show in the pressure signal.
    shed_retry_after_s: float = 5.0
    # Release shedding after this long below critical: long enough not to toggle on
    # every tick of a noisy signal, short enough that clients barely notice.
    shed_release_s: float = 5.0
    # While critical, clear MLX's buffer cache at most this often (it refills as we run).
    clear_cache_interval_s: float = 5.0

    # ---------------------------------------------------------------- cost model
    # EWMA weight of a new cycle's cost: ~10 cycles of memory (a fraction of a second), so a
    # change of council load shows within the dwell time.
    cost_alpha: float = 0.1
    # Cycle cost is the median of this many recent cycles per depth: robust to the preempted
    # cycles of a contended machine (bench/results/README_governor.md: the mean picked the
    # worse of two neighbouring depths 30-41% of the time there, the median 9-16%).
    cost_window: int = 32
    # Acceptance is a property of the head and the text, not of load: a longer memory. Its
    # samples are draft outcomes, one per row: a batched cycle of 8 rows gives 8, so 0.05
    # (~40 outcomes) was a few batched cycles, and its sampling noise (7-8% on a_2..a_4,
    # CostModel.acceptance_noise) was the largest term of the noise-aware margin on the GPU
    # tables. 0.01 is ~200 outcomes (about 3% on an a of 0.8): 4-10 s of solo decoding at
    # 20-50 cycles a second, well under a second in a batch, so a change of text still shows
    # within a burst (the replay's code->prose drift regime did not lose by it).
    accept_alpha: float = 0.01
    # Below this many samples an estimate is blended with its prior, and not "trusted".
    trust_samples: int = 8
    # A depth's cost not sampled for this many seconds of decoding (at other depths: idle
    # time does not count), or sampled under a CPU load this different, is stale: the policy
    # probes it when it is a neighbour, and a new sample restarts its window.
    stale_after_s: float = 30.0
    stale_load_delta: float = 0.25
    # Measurements older than this (wall clock) are forgotten in favour of the prior, so a head evicted
    # because "speculation did not pay" gets another try once the council has changed.
    forget_after_s: float = 900.0
    # Prior when neither a tuned profile nor data exist: a depth-k cycle costs
    # (1 + 0.5 k) serial steps (the seed: 1.15-1.20x at depth 1 with a1 = 0.83 means a
    # depth-1 cycle is ~1.5 steps) and each position is accepted with 0.8 (seed: 0.83,
    # 0.79, 0.77, 0.76).
    prior_cost_per_depth: float = 0.5
    prior_acceptance: float = 0.8

    # ---------------------------------------------------------------- signals
    linux: LinuxThresholds = LinuxThresholds()
    # Arrival-rate EWMA time constant: 30 s smooths one council round without hiding a
    # change of phase.
    arrival_tau_s: float = 30.0


    def __post_init__(self) -> None:
        # Raised here, msgspec.convert reports it as a ValidationError naming the config.
        checks = [
            (self.tick_s > 0, "tick_s must be > 0"),
            (1 <= self.max_depth <= 16, "max_depth must be in 1..16"),
            (0 <= self.initial_depth <= self.max_depth, "initial_depth must be in 0..max_depth"),
            (self.depth_margin >= 0, "depth_margin must be >= 0"),
            (self.depth_margin_min >= 0, "depth_margin_min must be >= 0"),
            (self.depth_noise_z >= 0, "depth_noise_z must be >= 0"),
            (self.batch_streams >= 1, "batch_streams must be >= 1"),
            (0 < self.probe_s < self.probe_interval_s, "need 0 < probe_s < probe_interval_s"),
            (0 < self.cost_alpha <= 1 and 0 < self.accept_alpha <= 1, "EWMA alphas must be in (0, 1]"),
            (1 <= self.cost_window <= 4096, "cost_window must be in [1, 4096]"),
            (self.restore_window_s >= self.warn_clear_s,
             "restore_window_s must be >= warn_clear_s: a reload inside a warn episode that has not "
             "cleared would be evicted again at once"),
            (self.trust_samples >= 1, "trust_samples must be >= 1"),
            (self.probe_max_factor >= 1, "probe_max_factor must be >= 1"),
            (self.head_trial_interval_s >= 0, "head_trial_interval_s must be >= 0 (0: no trials)"),
            (self.head_trial_backoff_max >= 1, "head_trial_backoff_max must be >= 1"),
            (0 <= self.prior_acceptance <= 1, "prior_acceptance must be in [0, 1]"),
            (self.head_margin_bytes >= 0, "head_margin_bytes must be >= 0"),
            (self.row_dwell_s >= 0, "row_dwell_s must be >= 0"),
            (1 <= self.row_floor <= 256, "row_floor must be in 1..256"),
            (self.row_margin_bytes >= 0, "row_margin_bytes must be >= 0"),
            (self.arrival_tau_s > 0, "arrival_tau_s must be > 0"),
        ]
        windows = ("depth_dwell_s", "warn_evict_s", "warn_clear_s", "idle_evict_s", "restore_window_s",
                   "min_reload_gap_s", "load_timeout_s", "shed_retry_after_s", "shed_release_s",
                   "clear_cache_interval_s", "stale_after_s", "stale_load_delta", "forget_after_s",
                   "prior_cost_per_depth")  # fmt: skip
        checks += [(getattr(self, w) >= 0, f"{w} must be >= 0") for w in windows]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)


def load_config(table: dict[str, Any] | None) -> GovernorConfig:
    """The daemon's ``[governor]`` table -> GovernorConfig; raises msgspec.ValidationError."""
    return msgspec.convert(table or {}, GovernorConfig)


def config_option(text: str | None) -> GovernorConfig | None:
    """A command's ``--config JSON`` (a governor table) as a config, None when not given; a
    ValueError names what is wrong (bad JSON, an unknown key, a value out of range)."""
    if not text:
        return None
    try:
        return load_config(json.loads(text))
    except (ValueError, msgspec.ValidationError) as e:
        raise ValueError(f"bad --config: {e}") from None
