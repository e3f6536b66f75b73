"""Plain records the engine's generators yield and take. No mlx here."""

from __future__ import annotations

from dataclasses import dataclass, field

# Exact mode's guard: a verify position is re-decided with serial numerics when
# top1 - top2 <= DEFAULT_GUARD * max(1, |top1 logit|). 2**-5 is four bf16 ulps relative
# (bf16 keeps 8 significant bits), well above the one-or-two-ulp differences between
# batch-height kernels (M=1 vs M>=2). The one definition: speculation, the batch and the
# config default read it from here.
DEFAULT_GUARD = 2.0**-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None


@dataclass
class DecodeStep:
    """What one decode cycle committed.

    A serial step commits one token at depth 0. A speculative cycle at depth k drafts k
    tokens, accepts a prefix of them, and commits accepted + 1 tokens (the +1 is the base
    model's own token at the first rejected position, or after the last draft).
    """

    tokens: list[int]
    depth: int = 0
    drafted: int = 0
    accepted: int = 0
    # accepted_mask[i] is True when draft position i+1 was accepted (len == drafted).
    accepted_mask: list[bool] = field(default_factory=list)
    # Positions whose accept decision the exact configuration re-took with serial numerics.
    guarded: int = 0
    cycle_s: float = 0.0
