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
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    # Report each output token's logprob (and this many alternatives) in DecodeStep.logprobs.
    logprobs: bool = False
    top_logprobs: int = 0

    @property
    def processes_logits(self) -> bool:
        """Whether the logits are changed before the distribution is built (at any temperature)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or bool(self.logit_bias))


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
    # Only when the request asked for logprobs: per committed token, (its logprob,
    # [(token id, logprob), ...] of the top alternatives), same length as tokens.
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    # Who proposed the drafts: "head" (the MTP head; a serial step too) or "lookup" (a
    # prompt-lookup block, lookup.py). A lookup cycle's depth is its block's length.
    draft_source: str = "head"
    # The head stopped drafting below the depth ceiling (per-request depth, lookup.DraftStop).
    stopped_early: bool = False
    # Decoded under the loop guard's penalty (a sampled request caught looping, loop_guard.py).
    penalised: bool = False
    # The first cycle at this depth after another (or a stream's first): it feeds the head
    # the pairs queued meanwhile, or follows a cycle built ahead and thrown away, so its
    # cost is not what the depth costs; the governor learns its acceptance, not its cost.
    transition: bool = False

