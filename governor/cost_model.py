"""Online cost model: what one decode cycle costs and yields, per depth.

  E(k)     = 1 + sum_{i<=k} prod_{j<=i} a_j     expected tokens per cycle at depth k
  score(k) = E(k) / cost(k)                     tokens per second at depth k

a_j is the conditional acceptance of draft position j (accepted, given 1..j-1 were).
cost(k) is the median of a depth-k cycle's recent seconds; cost(0) is one serial step.

Council load shows up as cost, not as acceptance (DESIGN.md), so costs use a short memory
and go stale (age, or CPU load moved) while acceptance uses a long one. Age is counted on
the decode clock (``decode_s``: the seconds of the cycles recorded so far), not the wall
clock: an idle gap between bursts changes nothing the cost describes, so it does not make
an estimate stale (bench/results/README_governor.md, proposal B). Forgetting
(``forget_after_s``) stays on the wall clock: it is about the council having changed. Until a depth has
``trust_samples`` samples its cost is shrunk towards a prior: a tuned profile's ratio to
cost(0) when one was given, else (1 + prior_cost_per_depth * k) serial steps, scaled by the
live cost of the nearest measured depth so the prior moves with load too.

Profile format (from a tuning run): {"cost_s": {"0": 0.049, "1": 0.074, ...},
"acceptance": [0.83, 0.79, 0.77, 0.76], "batch_cost_s": {"4": {"0": 0.021, "1": 0.025}}};
every key optional. ``batch_cost_s`` is seconds per row of a batched cycle, by batch height
then depth: a prior for that height's bucket (where it has two depths or more, also the
line a depth it lacks is priced on). A learned profile's ``lost`` (governor/learned.py)
adds the costs its probe verdicts measured, where ``batch_cost_s`` has none.

Batched cycles (``batch`` > 1) are learned apart, per bucket of batch height
(governor/heights.py) and per depth, as seconds per row (cycle_s / rows), so a bucket's
heights (3 and 4) share one table and its score, E(k) / cost_per_row(b, k), is the batch's
tokens per second over its rows. Acceptance is one table for all: it is the head's and the
text's, not the batch's. Each bucket has its own decode clock (the seconds of its cycles):
a bucket the council has left does not go stale while it is not running, nor is a probe of
it due.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from .config import GovernorConfig
from .heights import N_BUCKETS, bucket_label, bucket_of, bucket_top
from .types import CycleTelemetry, DepthEstimate, LookupEstimate


def expected_tokens(acceptance, k: int) -> float:
    """E(k) = 1 + sum_{j<=k} prod_{l<=j} a_l: the tokens a depth-k cycle commits on average,
    from the per-position acceptance rates a_1, a_2, ... (the first k are used)."""
    total, run = 1.0, 1.0
    for a in list(acceptance)[:k]:
        run *= a
        total += run
    return total


class _Ewma:
    """EWMA with a bias-corrected start: the n-th sample weighs max(alpha, 1/n), so the
    first samples average plainly and no arbitrary initial value leaks in."""

    __slots__ = ("value", "n", "last_at", "load_at", "w2")

    def __init__(self) -> None:
        self.value: float = 0.0
        self.n = 0
        # The sum of the squared weights of the samples in ``value``: a mean of iid samples
        # of variance v has variance v * w2 (1/n while the weights are 1/n, alpha / (2 -
        # alpha) in the steady state: 39 samples' worth at alpha 0.05). The acceptance's
        # noise (CostModel.acceptance_noise) comes from it.
        self.w2: float = 0.0
        self.last_at: float | None = None
        self.load_at: float | None = None

    def add(self, x: float, alpha: float, now: float, load: float | None = None) -> None:
        self.n += 1
        w = max(alpha, 1.0 / self.n)
        self.value += w * (x - self.value)
        self.w2 = (1.0 - w) ** 2 * self.w2 + w * w
        self.last_at = now
        if load is not None:
            self.load_at = load if self.load_at is None else self.load_at + w * (load - self.load_at)


def _at_rank(ordered: list[float], r: float) -> float:
    """The value at fractional rank r (0-based) of a sorted list, linearly interpolated."""
    r = min(max(r, 0.0), len(ordered) - 1.0)
    i = int(r)
    if i + 1 >= len(ordered):
        return ordered[i]
    return ordered[i] + (ordered[i + 1] - ordered[i]) * (r - i)


def median_rse(ordered: list[float], median: float) -> float | None:
    """The relative standard error of a sample median, from the samples alone (sorted).

    The number of samples below the true median is Binomial(n, 1/2), whose standard
    deviation is sqrt(n)/2 ranks: the order statistics sqrt(n)/2 ranks either side of the
    middle bracket the true median about as often as one standard error either side would,
    whatever the distribution (the heavy-tailed, two-humped cycle times of a contended CPU
    included). Half their distance, over the median, is the relative standard error.
    Checked by simulation against the spread of medians (normal, lognormal, exponential and
    the recorded CPU cycle ratios, windows of 8-32): the mean estimate is within 3% of the
    true value (bench/results/governor_eval_noise_2026-12-01/README.md). None below 4
    samples (too few ranks to bracket anything)."""
    n = len(ordered)
    if n < 4 or median <= 0:
        return None
    mid, half = (n - 1) / 2, 0.5 * math.sqrt(n)
    return (_at_rank(ordered, mid + half) - _at_rank(ordered, mid - half)) / 2 / median


class _RecentMedian:
    """Cycle cost as the median of the last ``window`` samples. Cycle times on a contended
    machine are heavy-tailed (a preempted cycle takes 10-20x the median); one such cycle
    moves a mean by as much as the difference between two depths, so the policy compared
    noise. The median ignores the tail; the window keeps it as responsive as the EWMA it
    replaces (32 cycles is about a second at these models' cycle times)."""

    __slots__ = ("samples", "window", "value", "n", "last_at", "last_decode_at", "load_at", "rse")

    def __init__(self, window: int = 32) -> None:
        self.samples: list[float] = []
        self.window = window
        self.value: float = 0.0
        self.n = 0
        self.last_at: float | None = None  # wall clock (forgetting)
        self.last_decode_at: float | None = None  # decode clock (staleness)
        self.load_at: float | None = None
        # The median's relative standard error over the window (median_rse); None until
        # there are samples enough to say.
        self.rse: float | None = None

    def add(self, x: float, alpha: float, now: float, load: float | None = None, decode_at: float | None = None) -> None:
        self.n += 1
        self.last_decode_at = decode_at
        self.samples.append(x)
        if len(self.samples) > self.window:
            del self.samples[0]
        ordered = sorted(self.samples)
        mid = len(ordered) // 2
        self.value = ordered[mid] if len(ordered) % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])
        self.rse = median_rse(ordered, self.value)
        self.last_at = now
        if load is not None:
            w = max(alpha, 1.0 / self.n)
            self.load_at = load if self.load_at is None else self.load_at + w * (load - self.load_at)


class _Bucket:
    """One bucket of batch heights: per-row cycle cost by depth, on its own decode clock."""

    __slots__ = ("cost", "decode_s", "cycles", "kept")

    def __init__(self, max_depth: int, window: int) -> None:
        self.cost = [_RecentMedian(window) for _ in range(max_depth + 1)]
        self.decode_s = 0.0
        self.cycles = 0
        self.kept: dict[int, float] = {}  # as CostModel._kept, per row


class CostModel:
    def __init__(self, cfg: GovernorConfig | None = None, profile: dict[str, Any] | None = None):
        self.cfg = cfg or GovernorConfig()
        k = self.cfg.max_depth
        self._cost = [_RecentMedian(self.cfg.cost_window) for _ in range(k + 1)]
        # The last trusted cost of each depth whose window a staleness reset replaced
        # (``measured`` only): the learned profile keeps it until the new window is trusted.
        # Without it a CPU load that moved at the end of a run (a CI box's other tests) left
        # the saved profile with no costs at all, and the next start back at the priors.
        self._kept: dict[int, float] = {}
        # Batched cycles, per bucket of batch height (index b - 1 for bucket b >= 1).
        self._buckets = [_Bucket(k, self.cfg.cost_window) for _ in range(N_BUCKETS - 1)]
        self._profile_batch: dict[int, dict[int, float]] = {}
        self._emitted = [_Ewma() for _ in range(k + 1)]
        self._accept = [_Ewma() for _ in range(k + 1)]  # index 1..k; 0 unused
        self._profile_cost: dict[int, float] = {}
        self._profile_accept: list[float] = []
        self.batched_cycles = 0
        self.transition_cycles = 0  # cycles whose cost was not booked (CycleTelemetry.transition)
        # Prompt-lookup cycles, apart from the depths (their width is the block's, not a depth).
        self._lookup_cost = _RecentMedian(self.cfg.cost_window)
        self._lookup_emitted = _Ewma()
        self.lookup_cycles = self.lookup_drafted = self.lookup_accepted = 0
        # The decode clock: seconds of every cycle recorded (batched ones too), i.e. the time
        # the engine spent decoding. Staleness and the policy's probe timing run on it.
        self.decode_s = 0.0
        if profile:
            self.seed(profile)

    # ------------------------------------------------------------ input

    def seed(self, profile: dict[str, Any]) -> None:
        """Take a tuned profile as the prior (never as measurements: live data wins)."""
        self._profile_cost = {int(d): float(s) for d, s in (profile.get("cost_s") or {}).items() if float(s) > 0}
        self._profile_accept = [min(1.0, max(0.0, float(a))) for a in (profile.get("acceptance") or [])]
        self._profile_batch = {}
        for height, by_depth in sorted((profile.get("batch_cost_s") or {}).items(), key=lambda kv: int(kv[0])):
            b = bucket_of(int(height))
            if b > 0:  # height 1 is cost_s's
                self._profile_batch[b] = {int(d): float(v) for d, v in by_depth.items() if float(v) > 0}
        # A learned profile's probe verdicts (governor/learned.py): a depth that lost a paired
        # probe was measured, if by fewer than trust_samples cycles; its cost then is a better
        # prior than a ratio guessed from the solo depths (which priced it best on the H200, so
        # a restart's first round probed it again). A cost with more cycles behind it wins.
        for height, by_depth in (profile.get("lost") or {}).items():
            try:
                b, costs = bucket_of(int(height)), {int(d): float(v["cost_s"]) for d, v in by_depth.items()}
            except (TypeError, ValueError, KeyError, AttributeError):
                continue  # a hint: a malformed entry costs a probe, never the start
            if b > 0:
                for d, c in costs.items():
                    if c > 0 and 0 <= d <= self.cfg.max_depth:
                        self._profile_batch.setdefault(b, {}).setdefault(d, c)

    def profile(self) -> dict[str, Any]:
        """What was seeded, in the profile's format (to rebuild the model on a reconfigure)."""
        return {"cost_s": {str(k): v for k, v in self._profile_cost.items()},
                "acceptance": list(self._profile_accept),
                "batch_cost_s": {str(bucket_top(b)): {str(k): v for k, v in t.items()} for b, t in self._profile_batch.items()}}

    def measured(self) -> dict[str, Any]:
        """What this model measured itself, never its priors, in the profile's format: each
        cost with ``trust_samples`` cycles or more behind it (the median of its window, or of
        the last such window before a staleness reset), the acceptance of each position up
        to the first with fewer samples. A later start on the
        same machine seeds a model with it (the daemon's learned profile), so it starts where
        this one ended instead of from the config's priors."""
        trust = self.cfg.trust_samples
        acceptance: list[float] = []
        for e in self._accept[1:]:
            if e.n < trust:
                break
            acceptance.append(round(e.value, 4))
        batch = {}
        for b, bk in enumerate(self._buckets, start=1):
            by_depth = self._trusted(bk.cost, bk.kept)
            if by_depth:
                batch[str(bucket_top(b))] = by_depth
        return {"cost_s": self._trusted(self._cost, self._kept), "acceptance": acceptance, "batch_cost_s": batch}

    def _trusted(self, windows: list[_RecentMedian], kept: dict[int, float]) -> dict[str, float]:
        """Each depth's cost with ``trust_samples`` cycles behind it: its window's median, else
        the one a staleness reset replaced (measured under another load or long ago in decode
        time, but on this machine and model: a better start than the config's prior)."""
        out = {}
        for k, e in enumerate(windows):
            value = e.value if e.n >= self.cfg.trust_samples and e.value > 0 else kept.get(k)
            if value:
                out[str(k)] = value
        return out

    def _restart(self, windows: list[_RecentMedian], kept: dict[int, float], k: int) -> None:
        """A staleness reset of depth k's window: a trusted median moves to ``kept`` first."""
        if windows[k].n >= self.cfg.trust_samples and windows[k].value > 0:
            kept[k] = windows[k].value
        windows[k] = _RecentMedian(self.cfg.cost_window)

    def record(self, t: CycleTelemetry, now: float, load: float | None = None) -> None:
        k = min(max(t.depth, 0), self.cfg.max_depth)
        if t.batch > 1:
            # A batched cycle: its cost per row goes to its height's bucket, its rows'
            # accepted prefixes to the one acceptance table.
            self.batched_cycles += 1
            self.decode_s += max(t.cycle_s, 0.0)
            if t.source == "lookup":
                # Rows' prompt-lookup blocks (batch_spec.py): a verify as wide as the longest
                # block and no head forward, so neither a depth's cost at this height nor the
                # head's acceptance.
                self.lookup_cycles += 1
                self.lookup_drafted += max(t.drafted, 0)
                self.lookup_accepted += max(t.accepted, 0)
                return
            self._record_batched(t, k, now, load)
            return
        if t.source == "lookup":
            self.lookup_cycles += 1
            self.lookup_drafted += max(t.drafted, 0)
            self.lookup_accepted += t.accepted_prefix()
            if t.cycle_s > 0:
                self.decode_s += t.cycle_s
                self._lookup_cost.add(t.cycle_s, self.cfg.cost_alpha, now, load, decode_at=self.decode_s)
            self._lookup_emitted.add(float(t.emitted), self.cfg.cost_alpha, now)
            return
        if t.transition:
            # The first cycle at its depth costs what the change cost (the head catching up
            # on queued pairs; on a GPU, shapes seen for the first time), not what the depth
            # costs: booked, it made a depth look 2-10x dearer than its steady cycles.
            self.transition_cycles += 1
            self.decode_s += max(t.cycle_s, 0.0)
        elif t.cycle_s > 0:
            if self._cost[k].n and self.stale(k, now, load):
                # Measured long ago (in decode time) or under another load: that history
                # describes another machine state, so the new samples start a fresh average.
                self._restart(self._cost, self._kept, k)
            self.decode_s += t.cycle_s
            self._cost[k].add(t.cycle_s, self.cfg.cost_alpha, now, load, decode_at=self.decode_s)
        self._emitted[k].add(float(t.emitted), self.cfg.cost_alpha, now)
        drafted = min(t.drafted or k, self.cfg.max_depth)
        m = t.accepted_prefix() if t.drafted else min(t.accepted, drafted)
        self._learn_acceptance(m, drafted, now)

    def _record_batched(self, t: CycleTelemetry, k: int, now: float, load: float | None) -> None:
        b = bucket_of(t.batch)
        bk = self._buckets[b - 1]
        bk.cycles += 1
        if t.transition:  # as in record: the change's cost, not the depth's
            self.transition_cycles += 1
            bk.decode_s += max(t.cycle_s, 0.0)
        elif t.cycle_s > 0:
            if bk.cost[k].n and self.batch_stale(b, k, load):
                self._restart(bk.cost, bk.kept, k)
            bk.decode_s += t.cycle_s
            bk.cost[k].add(t.cycle_s / t.batch, self.cfg.cost_alpha, now, load, decode_at=bk.decode_s)
        for m in t.row_accepted or ():
            self._learn_acceptance(min(max(m, 0), k), k, now)

    def _learn_acceptance(self, m: int, drafted: int, now: float) -> None:
        # Positions 1..m were accepted; m+1 was tried and rejected; later ones unseen.
        for i in range(1, min(m, drafted) + 1):
            self._accept[i].add(1.0, self.cfg.accept_alpha, now)
        if m < drafted:
            self._accept[m + 1].add(0.0, self.cfg.accept_alpha, now)

    # ------------------------------------------------------------ estimates

    def _fresh(self, e: _Ewma, now: float) -> bool:
        return e.n > 0 and e.last_at is not None and now - e.last_at <= self.cfg.forget_after_s

    def _blend(self, e: _Ewma, fresh: bool, prior: float | None) -> tuple[float | None, str]:
        trust = self.cfg.trust_samples
        if fresh and e.n >= trust:
            return e.value, "measured"
        if fresh and prior is not None:
            return (e.n * e.value + (trust - e.n) * prior) / trust, "blend"
        if fresh:
            return e.value, "blend"
        return prior, "none" if prior is None else "prior"

    def _ratio(self, k: int) -> float:
        p = self._profile_cost
        if 0 in p and k in p:
            return p[k] / p[0]
        return 1.0 + self.cfg.prior_cost_per_depth * k

    def _live_base(self, j: int) -> float:
        """Depth j's cost as an anchor for the others: its samples, shrunk towards the
        profile's value for j until trusted, as j's own estimate is. Anchoring on the raw
        samples instead made the first few (fast) cycles at j price every other depth lower
        than j itself, so a profile that ranks j first was overturned by a probe after a
        tenth of a second (bench smoke run: depth 1 "146.8 vs 120.1 at 0" against the
        profile's 107 vs 116)."""
        e, trust = self._cost[j], self.cfg.trust_samples
        if e.n < trust and j in self._profile_cost:
            return (e.n * e.value + (trust - e.n) * self._profile_cost[j]) / trust
        return e.value

    def _anchor(self, k: int, now: float, load: float | None) -> tuple[float | None, str]:
        """The prior for cost(k): the live cost of the nearest other measured depth j (one measured
        recently and under this load, when there is one), scaled by ratio(k)/ratio(j), so the
        prior moves with load; else the profile's absolute value."""
        live = [j for j, e in enumerate(self._cost) if j != k and self._fresh(e, now)]
        if live:
            j = min(live, key=lambda j: (self.stale(j, now, load), abs(j - k), j))
            return self._live_base(j) * self._ratio(k) / self._ratio(j), "prior"
        if k in self._profile_cost:
            return self._profile_cost[k], "profile"
        if 0 in self._profile_cost:
            return self._profile_cost[0] * self._ratio(k), "prior"
        return None, "none"

    def acceptance(self, i: int) -> float:
        """a_i, shrunk towards its prior until trusted (acceptance does not go stale)."""
        e = self._accept[i]
        prior = self._profile_accept[i - 1] if i - 1 < len(self._profile_accept) else self.cfg.prior_acceptance
        v, _ = self._blend(e, e.n > 0, prior)
        return float(v)

    def acceptance_noise(self) -> tuple[tuple[float, float], ...]:
        """Per draft position 1..max_depth: (a_i as the estimates use it, its variance).

        A mean of Bernoulli outcomes: a(1 - a) times the EWMA's sum of squared weights
        (_Ewma.w2). While an estimate is still shrunk towards its prior (fewer than
        trust_samples outcomes) it counts as trust_samples outcomes' worth, as the blend
        weighs it. For the variance, a is moved one outcome's worth off 0 and 1 (Laplace's
        rule of succession), so a short run of all-accepted does not claim to be exact.
        The policy turns these into the noise of E(p) / E(b) (depth_rules.score_noise)."""
        trust = self.cfg.trust_samples
        out = []
        for i in range(1, self.cfg.max_depth + 1):
            e, a = self._accept[i], self.acceptance(i)
            w2 = e.w2 if e.n >= trust else 1.0 / trust
            m = 1.0 / w2  # effective outcomes
            shrunk = (a * m + 1.0) / (m + 2.0)
            out.append((a, shrunk * (1.0 - shrunk) * w2))
        return tuple(out)

    def _cost_rse(self, table: list[_RecentMedian], k: int, now: float) -> float | None:
        """The relative standard error of cost(k) in ``table`` (the solo depths, or one
        bucket's): its own window's (median_rse) once the estimate is its own median
        (trust_samples or more fresh samples); else, since a prior is priced from the live
        costs of the other depths (_anchor, _batch_anchor), the noisiest of those (a price
        scaled from a live cost is at least as uncertain as that cost); None when no live
        cost stands behind it (a profile's or the config's prior: its noise is unknown)."""
        trust = self.cfg.trust_samples
        e = table[k]
        if e.n >= trust and self._fresh(e, now) and e.rse is not None:
            return e.rse
        live = [x.rse for j, x in enumerate(table) if j != k and x.n >= trust and self._fresh(x, now)
                and x.rse is not None]  # fmt: skip
        return max(live) if live else None

    def expected_tokens(self, k: int) -> float:
        return expected_tokens([self.acceptance(i) for i in range(1, k + 1)], k)

    def cost(self, k: int, now: float, load: float | None = None) -> tuple[float | None, str]:
        prior, src = self._anchor(k, now, load)
        e = self._cost[k]
        v, how = self._blend(e, self._fresh(e, now), prior)
        return v, (src if how == "prior" else how)

    def stale(self, k: int, now: float, load: float | None = None) -> bool:
        """Not measured, measured more than ``stale_after_s`` decode seconds ago (idle time
        does not count), or under a CPU load more than ``stale_load_delta`` away."""
        e = self._cost[k]
        if e.n == 0 or e.last_decode_at is None or self.decode_s - e.last_decode_at > self.cfg.stale_after_s:
            return True
        return load is not None and e.load_at is not None and abs(load - e.load_at) > self.cfg.stale_load_delta

    def estimate(self, k: int, now: float, load: float | None = None) -> DepthEstimate:
        c, src = self.cost(k, now, load)
        et = self.expected_tokens(k)
        return DepthEstimate(
            depth=k,
            expected_tokens=et,
            cost_s=c,
            score=(et / c) if c else None,
            samples=self._cost[k].n,
            source=src,
            stale=self.stale(k, now, load),
            load_at=self._cost[k].load_at if src in ("measured", "blend") else None,
            cost_rse=self._cost_rse(self._cost, k, now),
        )

    def score(self, k: int, now: float, load: float | None = None) -> float | None:
        """E(k) / cost(k): tokens per second at depth k; None while nothing is known."""
        return self.estimate(k, now, load).score

    def estimates(self, now: float, load: float | None = None) -> tuple[DepthEstimate, ...]:
        return tuple(self.estimate(k, now, load) for k in range(self.cfg.max_depth + 1))

    # ------------------------------------------------------------ batched estimates

    def batch_stale(self, b: int, k: int, load: float | None = None) -> bool:
        """As ``stale``, on bucket b's own decode clock."""
        bk = self._buckets[b - 1]
        e = bk.cost[k]
        if e.n == 0 or e.last_decode_at is None or bk.decode_s - e.last_decode_at > self.cfg.stale_after_s:
            return True
        return load is not None and e.load_at is not None and abs(load - e.load_at) > self.cfg.stale_load_delta

    def _profile_line(self, b: int, k: int) -> float | None:
        """The profile's cost(b, k): its own value, else, where it has two or more depths at
        this bucket, the line through the two nearest to k (floored as _batch_anchor's live
        line): this bucket's shape as the last run measured it, where the solo ratio would
        guess (with the prior acceptance it priced an unmeasured depth best on the H200 and
        on the CPU-like replay, so a restart's first round probed it)."""
        p = self._profile_batch.get(b, {})
        if k in p:
            return p[k]
        if len(p) < 2:
            return None
        j1, j2 = sorted(sorted(p, key=lambda j: (abs(j - k), j))[:2])
        v = p[j1] + (p[j2] - p[j1]) * (k - j1) / (j2 - j1)
        return max(v, 0.5 * min(p[j1], p[j2]))

    def _batch_ratio(self, b: int, k: int, j: int, now: float) -> float:
        """cost(b, k) / cost(b, j): the profile's for this bucket when it has both depths or
        two others to draw its line through (_profile_line), else the nearest other bucket's
        measured ratio (learned: batches of neighbouring heights share their shape, a
        near-flat verify on a GPU, a steep one on a CPU), else the solo ratio (a guess, and
        too steep on a GPU, where extra verify positions are nearly free in a batch: such a
        guess is only ever a reason to probe)."""
        pk, pj = self._profile_line(b, k), self._profile_line(b, j)
        if pk is not None and pj:
            return pk / pj
        trust = self.cfg.trust_samples
        for o in sorted(range(1, N_BUCKETS), key=lambda o: (abs(o - b), o)):
            if o == b:
                continue
            ck, cj = self._buckets[o - 1].cost[k], self._buckets[o - 1].cost[j]
            if ck.n >= trust and cj.n >= trust and self._fresh(ck, now) and self._fresh(cj, now) and cj.value > 0:
                return ck.value / cj.value
        return self._ratio(k) / self._ratio(j)

    def _batch_anchor(self, b: int, k: int, now: float, load: float | None) -> tuple[float | None, str]:
        """The prior for cost(b, k). With two or more depths measured in this bucket, the
        line through the two nearest to k (the bucket's own cost per depth, learned: a GPU
        batch's near-flat verify and this CPU's steep one both show in two points), never
        below the cheaper of them when extrapolating down nor above... only floored; else
        the nearest measured depth scaled by the profile's (or the solo) ratio; else the
        profile's value (or its line: _profile_line)."""
        bk = self._buckets[b - 1]
        live = [j for j, e in enumerate(bk.cost) if j != k and self._fresh(e, now) and e.n >= self.cfg.trust_samples]
        if len(live) >= 2:
            j1, j2 = sorted(sorted(live, key=lambda j: (abs(j - k), j))[:2])
            c1, c2 = bk.cost[j1].value, bk.cost[j2].value
            v = c1 + (c2 - c1) * (k - j1) / (j2 - j1)
            return max(v, 0.5 * min(c1, c2)), "prior"
        live = [j for j, e in enumerate(bk.cost) if j != k and self._fresh(e, now)]
        if live:
            j = min(live, key=lambda j: (self.batch_stale(b, j, load), abs(j - k), j))
            e, trust, p = bk.cost[j], self.cfg.trust_samples, self._profile_batch.get(b, {})
            base = (e.n * e.value + (trust - e.n) * p[j]) / trust if e.n < trust and j in p else e.value
            return base * self._batch_ratio(b, k, j, now), "prior"
        p, line = self._profile_batch.get(b, {}), self._profile_line(b, k)
        if k in p:
            return p[k], "profile"
        if line is not None:
            return line, "prior"
        return None, "none"

    def batch_estimate(self, b: int, k: int, now: float, load: float | None = None) -> DepthEstimate:
        """Depth k at bucket b (>= 1): cost is seconds per row, score the batch's tokens/s."""
        e = self._buckets[b - 1].cost[k]
        prior, src = self._batch_anchor(b, k, now, load)
        c, how = self._blend(e, self._fresh(e, now), prior)
        src = src if how == "prior" else how
        et = self.expected_tokens(k)
        return DepthEstimate(depth=k, expected_tokens=et, cost_s=c, score=(et / c) if c else None, samples=e.n,
                             source=src, stale=self.batch_stale(b, k, load),
                             load_at=e.load_at if src in ("measured", "blend") else None,
                             cost_rse=self._cost_rse(self._buckets[b - 1].cost, k, now),
                             profiled=k in self._profile_batch.get(b, {}),
                             sample_cost_s=e.value if e.n and e.value > 0 else None)  # fmt: skip

    def batch_estimates(self, now: float, load: float | None = None) -> tuple[tuple[DepthEstimate, ...], ...]:
        """Per batched bucket (index b - 1), per depth 0..max_depth."""
        return tuple(tuple(self.batch_estimate(b, k, now, load) for k in range(self.cfg.max_depth + 1))
                     for b in range(1, N_BUCKETS))  # fmt: skip

    def batch_measured(self, b: int) -> bool:
        """Has bucket b (>= 1) a booked cycle at any depth (a transition's is not booked)?"""
        return any(c.n > 0 for c in self._buckets[b - 1].cost)

    def batch_decode_s(self) -> tuple[float, ...]:
        """Each batched bucket's decode clock (seconds of its cycles)."""
        return tuple(bk.decode_s for bk in self._buckets)

    def lookup_estimate(self) -> LookupEstimate | None:
        if not self.lookup_cycles:
            return None
        cost = self._lookup_cost.value if self._lookup_cost.n else None
        tpc = self._lookup_emitted.value
        return LookupEstimate(
            cycles=self.lookup_cycles, drafted=self.lookup_drafted, accepted=self.lookup_accepted,
            acceptance=self.lookup_accepted / max(1, self.lookup_drafted), tokens_per_cycle=tpc,
            cost_s=cost, score=(tpc / cost) if cost else None,
        )

    def snapshot(self, now: float, load: float | None = None) -> dict[str, Any]:
        return {
            "depths": [
                {
                    "depth": e.depth,
                    "cost_s": e.cost_s,
                    "expected_tokens": round(e.expected_tokens, 4),
                    "observed_tokens": round(self._emitted[e.depth].value, 4) if self._emitted[e.depth].n else None,
                    "score": e.score,
                    "samples": e.samples,
                    "source": e.source,
                    "stale": e.stale,
                }
                for e in self.estimates(now, load)
            ],
            "acceptance": [round(self.acceptance(i), 4) for i in range(1, self.cfg.max_depth + 1)],
            "acceptance_samples": [self._accept[i].n for i in range(1, self.cfg.max_depth + 1)],
            "batched_cycles": self.batched_cycles,
            "transition_cycles": self.transition_cycles,
            # cost(B, k) by bucket of batch height: seconds per row, the batch's tokens/s.
            "heights": [
                {
                    "heights": bucket_label(b),
                    "cycles": self._buckets[b - 1].cycles,
                    "decode_s": round(self._buckets[b - 1].decode_s, 3),
                    "depths": [{"depth": e.depth, "cost_s_per_row": e.cost_s, "score": e.score, "samples": e.samples,
                                "source": e.source, "stale": e.stale} for e in ests],
                }
                for b, ests in enumerate(self.batch_estimates(now, load), start=1)
            ],
            "decode_s": round(self.decode_s, 3),
            "lookup": msgspec.to_builtins(self.lookup_estimate()),
        }
