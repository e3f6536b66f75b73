"""How much of a prompt one engine iteration prefills while other streams decode.

An iteration is a decode phase (every decoding stream's next cycle) then a prefill phase, so
a decoding stream's gap between tokens is the decode phase plus whatever prefill ran beside
it. A whole chunk (256 tokens) costs many decode steps where prefill is compute-bound (this
CPU: ~2 ms a prompt token against a ~20-60 ms decode step), so a long prompt stretched the
others' gaps ~20x. The pacer keeps an iteration within ``bound`` decode phases
(``scheduler.decode_gap_bound``, default 3): it measures the decode phase and the prefill's
cost per forward (a + b * tokens: a forward's fixed cost, then per token) and gives the
prefill phase the tokens that fit in the rest, ``(bound - 1) * decode``, less a margin for
how much a forward's time scatters around the fit. With nobody
decoding, or before anything was measured, prompts prefill whole chunks as before.

The piece it allows is a cap on one forward: the prefill cuts its chunk there. Where that
cut changes the numbers (a backend whose off-grid splits are not bit-identical, the prefix
cache's split probe), exact requests keep whole chunks and the bound does not hold for them
(decode_paths marks which prompts may be cut).

Pure bookkeeping: no mlx, no clock of its own (the worker times the phases).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# A piece never goes below this: past some point a smaller forward costs its fixed part and
# little else, and the prompt would crawl (the bound then holds as well as it can).
MIN_PIECE = 16
# Weight of the newest sample in the running estimates: a council's decode phase changes with
# its batch height and speculation depth, so old samples fade within ~10 iterations.
DECAY = 0.8
# The piece leaves this many standard deviations of the fit's error unspent, so that most
# iterations (not just the average one) stay within the bound: a forward's time scatters
# (other processes on the cores, the allocator), and the benchmark reads the gaps' p95.
MARGIN_SD = 2.0


@dataclass
class PrefillPacer:
    bound: float  # an iteration's time in decode phases; 0 turns pacing off
    min_piece: int = MIN_PIECE
    decode_s: float | None = None
    # Exponentially weighted sums for the least-squares fit of a forward's seconds on its tokens.
    _w: float = 0.0
    _n: float = 0.0
    _nn: float = 0.0
    _s: float = 0.0
    _ns: float = 0.0
    _err: float | None = None  # running mean of the fit's squared error, seconds^2
    last_piece: int | None = None  # the latest allowance given (None: whole chunks)
    paced_iterations: int = 0

    def decode_done(self, seconds: float) -> None:
        """A decode phase took ``seconds`` (one cycle of the decoding streams)."""
        if seconds <= 0:
            return
        self.decode_s = seconds if self.decode_s is None else DECAY * self.decode_s + (1 - DECAY) * seconds

    def prefill_done(self, tokens: int, seconds: float) -> None:
        """One prefill forward of ``tokens`` tokens took ``seconds``."""
        if tokens <= 0 or seconds <= 0:
            return
        cost = self.cost()
        if cost is not None:  # how far the fit so far was off: the margin the piece keeps
            miss = (seconds - cost[0] - cost[1] * tokens) ** 2
            self._err = miss if self._err is None else DECAY * self._err + (1 - DECAY) * miss
        self._w = DECAY * self._w + 1.0
        self._n = DECAY * self._n + tokens
        self._nn = DECAY * self._nn + tokens * tokens
        self._s = DECAY * self._s + seconds
        self._ns = DECAY * self._ns + tokens * seconds

    def cost(self) -> tuple[float, float] | None:
        """(seconds a forward costs whatever its size, seconds per token), or None before the
        first prefill sample. From samples of one size only, all of it is per token."""
        if self._w == 0.0:
            return None
        spread = self._w * self._nn - self._n * self._n
        if spread > 1e-9 * self._w * self._nn:  # pieces of several sizes: fit a + b * n
            b = (self._w * self._ns - self._n * self._s) / spread
            a = (self._s - b * self._n) / self._w
            if b > 0 and a >= 0:
                return a, b
        return 0.0, self._s / self._n

    def allowance(self, decoding: bool, chunk: int) -> int | None:
        """Tokens the prefill phase may forward this iteration, at most ``chunk``; None for
        a whole chunk (pacing off, nobody decoding, or nothing measured yet)."""
        cost = self.cost()
        if self.bound <= 0 or not decoding or self.decode_s is None or cost is None:
            self.last_piece = None
            return None
        a, b = cost
        room = (self.bound - 1.0) * self.decode_s - a - MARGIN_SD * math.sqrt(self._err or 0.0)
        piece = int(room / b + 1e-6) if room > 0 else 0  # 47.99999 from float sums is 48
        piece = max(min(self.min_piece, chunk), min(piece, chunk))
        self.last_piece = piece
        self.paced_iterations += 1
        return piece

    def to_dict(self) -> dict:
        cost = self.cost()
        return {"bound": self.bound, "decode_ms": None if self.decode_s is None else round(self.decode_s * 1e3, 3),
                "prefill_forward_ms": None if cost is None else round(cost[0] * 1e3, 3),
                "prefill_token_ms": None if cost is None else round(cost[1] * 1e3, 4),
                "prefill_error_ms": None if self._err is None else round(math.sqrt(self._err) * 1e3, 3),
                "last_piece": self.last_piece, "paced_iterations": self.paced_iterations}
