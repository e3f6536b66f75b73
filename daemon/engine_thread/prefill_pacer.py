"""How much of a prompt one engine iteration prefills while other streams decode.

An iteration is a decode phase (every decoding stream's next cycle) then a prefill phase, so
a decoding stream's gap between tokens is the whole iteration. A whole chunk (256 tokens)
costs many decode phases where prefill is compute-bound (this CPU: ~2 ms a prompt token
against a ~20 ms decode phase of the bundled model), so a long prompt stretched the others'
gaps ~20x. The pacer keeps an iteration within ``bound`` quiet iterations
(``scheduler.decode_gap_bound``, default 3): it measures

- the quiet iteration: one that decoded and prefilled nothing (a running mean: it follows
  the batch's height and depth);
- the iteration that decoded and prefilled n tokens, fitted as ``c + b * n`` (c: the decode
  phase plus a forward's fixed cost; b: per prompt token), with the fit's error;

and gives the prefill phase the n for which ``c + b * n`` stays within ``bound`` quiet
iterations, less two standard deviations of the fit's error (so most iterations, not the
average one, keep the bound), at least ``MIN_PIECE`` and the forward's fixed part in tokens
(``fixed_piece``: where a forward costs mostly its fixed part, as on a GPU, a smaller piece
buys the rows nothing) and at most a chunk. Whole iterations
are timed, not the phases: the decode phase's forward is issued ahead and runs while the
prefill's is evaluated (MLX evaluates lazily, one stream after another), so a phase's own
clock would hand the decode's cost to the prefill. With nobody decoding, prompts prefill
whole chunks as before; decoding with nothing fitted yet, a ``MIN_PIECE`` piece measures.

The piece caps one forward: the prefill cuts its chunk there. Where that cut changes the
numbers (a backend whose off-grid splits are not bit-identical, the prefix cache's split
probe), exact requests keep whole chunks (decode_paths marks which prompts may be cut).

Pure bookkeeping: no mlx, no clock of its own (the worker times the iterations).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# A piece never goes below this: past some point a smaller forward costs its fixed part and
# little else, and the prompt would crawl (the bound then holds as well as it can).
MIN_PIECE = 4
# Weight of the older samples in the running estimates: a council's decode phase changes
# with its batch height and speculation depth, so old samples fade within ~10 iterations.
DECAY = 0.8
# The piece leaves this many standard deviations of the fit's error unspent: an iteration's
# time scatters (other processes on the cores, the allocator), and a gap's p95 is what a
# streaming client feels.
MARGIN_SD = 2.0


@dataclass
class PrefillPacer:
    bound: float  # an iteration's time in quiet iterations; 0 turns pacing off
    min_piece: int = MIN_PIECE
    quiet_s: float | None = None  # an iteration that decoded and prefilled nothing
    # Exponentially weighted sums for the least-squares fit of a decoding iteration's
    # seconds on the prompt tokens it prefilled.
    _w: float = 0.0
    _n: float = 0.0
    _nn: float = 0.0
    _s: float = 0.0
    _ns: float = 0.0
    _err: float | None = None  # running mean of the fit's squared error, seconds^2
    last_piece: int | None = None  # the latest allowance given (None: whole chunks)
    paced_iterations: int = 0

    def iteration_done(self, seconds: float, prefilled: int, decoding: bool) -> None:
        """An iteration took ``seconds``: it decoded (``decoding``) and prefilled
        ``prefilled`` prompt tokens. Iterations that decoded nothing say nothing of a gap."""
        if not decoding or seconds <= 0:
            return
        if prefilled <= 0:
            self.quiet_s = seconds if self.quiet_s is None else DECAY * self.quiet_s + (1 - DECAY) * seconds
            return
        cost = self.cost()
        if cost is not None:  # how far the fit so far was off: the margin the piece keeps
            miss = (seconds - cost[0] - cost[1] * prefilled) ** 2
            self._err = miss if self._err is None else DECAY * self._err + (1 - DECAY) * miss
        self._w = DECAY * self._w + 1.0
        self._n = DECAY * self._n + prefilled
        self._nn = DECAY * self._nn + prefilled * prefilled
        self._s = DECAY * self._s + seconds
        self._ns = DECAY * self._ns + prefilled * seconds

    def cost(self) -> tuple[float, float] | None:
        """(c, b): a decoding iteration costs about ``c + b * n`` seconds when it prefills n
        tokens; None before the first such iteration. From pieces of one size the quiet
        iteration is the intercept where known (else all of it counts per token)."""
        if self._w == 0.0:
            return None
        spread = self._w * self._nn - self._n * self._n
        if spread > 1e-9 * self._w * self._nn:  # pieces of several sizes: fit c + b * n
            b = (self._w * self._ns - self._n * self._s) / spread
            c = (self._s - b * self._n) / self._w
            if b > 0 and c >= 0:
                return c, b
        mean_s, mean_n = self._s / self._w, self._n / self._w
        c = self.quiet_s if self.quiet_s is not None and self.quiet_s < mean_s else 0.0
        return c, (mean_s - c) / mean_n

    def allowance(self, decoding: bool, chunk: int) -> int | None:
        """Tokens the prefill phase may forward this iteration, at most ``chunk``; None for
        a whole chunk (pacing off, or nobody decoding)."""
        if self.bound <= 0 or not decoding:
            self.last_piece = None
            return None
        cost = self.cost()
        if cost is None:
            piece = self.min_piece  # nothing fitted yet: a small piece measures
        else:
            c, b = cost
            quiet, error = self._quiet(c), math.sqrt(self._err or 0.0)
            room = self.bound * quiet - c - MARGIN_SD * error
            piece = int(room / b + 1e-6) if room > 0 else 0  # 47.99999 from float sums is 48
            piece = max(piece, self.fixed_piece(c, b, quiet, error))
        piece = max(min(self.min_piece, chunk), min(piece, chunk))
        self.last_piece = piece
        self.paced_iterations += 1
        return piece

    def _quiet(self, c: float) -> float:
        """The quiet iteration, or the fit's intercept before one was seen."""
        return self.quiet_s if self.quiet_s is not None else c

    @staticmethod
    def fixed_piece(c: float, b: float, quiet: float, error: float) -> int:
        """The tokens whose cost equals a prefill forward's fixed part (``c`` less the quiet
        iteration: what the forward costs before its first token), the smallest piece worth
        cutting to, where that part stands out of the fit's error (``error``, seconds: more
        than MARGIN_SD of it; a scattered fit's intercept is no measure of it); else 0. A
        smaller piece spends most of the decoding rows' wait on the fixed part: the rows wait
        about as long an iteration and the prompt takes more of them. On this project's CPU
        it is 2-3 tokens (a fixed ~10 ms against ~4.6 ms a token, within an error of ~30 ms):
        no floor; on a GPU a forward's fixed part is most of its cost, and an H100's council
        of 8 prefilled ~300-token tails in 24-54 forwards of a few tokens
        (bench/results/h100_2026-12-08)."""
        fixed = c - quiet
        if fixed <= MARGIN_SD * error or b <= 0:
            return 0
        return int(fixed / b)

    def to_dict(self) -> dict:
        cost = self.cost()
        return {"bound": self.bound, "quiet_ms": None if self.quiet_s is None else round(self.quiet_s * 1e3, 3),
                "iteration_ms": None if cost is None else round(cost[0] * 1e3, 3),
                "prefill_token_ms": None if cost is None else round(cost[1] * 1e3, 4),
                "error_ms": None if self._err is None else round(math.sqrt(self._err) * 1e3, 3),
                "last_piece": self.last_piece, "paced_iterations": self.paced_iterations,
                "fixed_piece": None if cost is None else self.fixed_piece(*cost, self._quiet(cost[0]),
                                                                          math.sqrt(self._err or 0.0))}
