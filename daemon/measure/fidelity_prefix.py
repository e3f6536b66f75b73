"""The fidelity gate's prefix-cache arms: exact requests that resume off the chunk grid.

Where the start-up split probe says splitting a prefill leaves a cold run's state bit for
bit (engine/caches/prefix_cache.py ``splits_agree``: on this CPU, at every chunk), exact requests
resume from snapshots at any token. These arms prove what that promises, with the engine's
own pieces (``PrefixCache``, ``ChunkedPrefill`` with its snapshot stops, the head history a
hit restores) and speculative decode in exact mode, against serial decode of the whole
prompt from scratch, token for token: a cold prefill of it in the same chunks then serial
steps (what the request gets on a miss; on this CPU the same tokens as one forward of the
whole prompt, on CUDA not where that forward is longer than the invariant kernels take):
- "prompt end": prompt i is prefilled (a snapshot at its exact end, mid-chunk); a later
  prompt (prompt i then prompt i+1) resumes there;
- "continuation": prompt i is decoded speculatively and its finished state (prompt plus
  every committed token) kept as the seat's continuation; the next turn (that transcript
  then prompt i+1) resumes there;
- "paced pieces": a prompt (prompt i then prompt i+1) prefilled cold in pieces of random
  sizes cut out of its chunks, as the engine step's prefill pacer cuts them while other
  streams decode (engine_thread/prefill_pacer.py; it cuts exact requests only where this
  probe passes);
- "prefilled together": two prompts (prompt i then i+1, resumed from the first's snapshot,
  and i+1 then i, cold) prefilled in one forward per piece, pieces of random sizes
  (engine/prefill/batched_prefill.py, as the engine step runs prompts' tails together); only where
  ``together_matches_solo`` passes too, as the engine lets exact requests join only then.
Where the probe says no, exact requests reuse on the chunk grid only and no arm runs (the
report says so).
"""

from __future__ import annotations

import random
import time
from typing import Callable

from ..engine.prefill.batched_prefill import prefill_together, together_matches_solo
from ..engine.model.model import LoadedModel
from ..engine.prefill.prefill import ChunkedPrefill
from ..engine.caches.prefix_cache import PrefixCache, splits_agree
from ..engine.decoders.sampling import Sampler
from ..engine.caches.head_history import HeadHistory
from ..engine.decoders.speculative import DEFAULT_ROLLBACK, speculative_decode
from ..engine.types import SamplingParams

KINDS = ("prompt end", "continuation", "paced pieces", "prefilled together")
LABELS = {"paced pieces": "mtp, prefilled in paced pieces", "prefilled together": "mtp, prefilled together"}


def run_prefix_arms(
    lm: LoadedModel,
    head,
    prompts: list[str] | list[list[int]],
    new_arm: Callable[..., object],
    serial_tokens: Callable[..., list[int]],
    chunk: int = 32,
    max_tokens: int = 48,
    depth: int = 2,
    rollback: str = DEFAULT_ROLLBACK,
    guard_margin: float | None = None,
    splits_exact: bool | None = None,
) -> tuple[list, bool]:
    """One exact arm per kind of off-grid hit, and whether splits are exact here (None:
    probe ``splits_agree`` at ``chunk``); no arms where they are not. Each arm's
    ``resumed_at`` lists the prompt tokens every hit reused."""
    exact_here = splits_agree(lm, chunk) if splits_exact is None else splits_exact
    if not exact_here:
        return [], False
    encoded = [p if isinstance(p, list) else lm.encode_prompt(p, None, None) for p in prompts]
    pc = PrefixCache(1 << 40, chunk, make_cache=lm.make_cache, splits_exact=True)

    def opened(tokens: list[int], arm=None) -> ChunkedPrefill:
        """The engine's prefill of ``tokens`` (snapshot stops at its exact end, as _start sets
        them), cold, or with ``arm`` from the longest snapshot it starts with (noted in the
        arm's ``resumed_at``)."""
        cache, history, start = None, None, 0
        if arm is not None:
            snap, start = pc.lookup(tokens, want_head=True)
            arm.resumed_at.append(start)
            if snap is not None:
                cache, history = pc.restore(snap, tokens[start], head)
        return ChunkedPrefill(lm, tokens, chunk, cache if cache is not None else lm.make_cache(),
                              history if history is not None else HeadHistory(head), start=start,
                              stops=pc.boundaries(len(tokens), start))

    def prefill(pre: ChunkedPrefill, pieces=None) -> ChunkedPrefill:
        """Run ``pre`` to its end, storing a snapshot at each of its snapshot points (its
        prompt's exact end among them); ``pieces``: a random source cutting each step to a
        piece of 1..chunk tokens."""
        stops = pc.boundaries(len(pre.prompt), pre.start)
        while not pre.done:
            pre.step(None if pieces is None else pieces.randint(1, chunk))
            if pre.pos in stops:
                pc.store(pre.prompt[: pre.pos], pre.cache, pre.history)
        return pre

    def missed(tokens: list[int]) -> list[int]:
        """The reference: what the same exact request gets on a miss (a cold prefill of the
        whole prompt in ``chunk`` pieces, then serial steps). Not one forward of the whole
        prompt: on CUDA a forward of more rows than the invariant kernels take runs MLX's,
        whose rounding differs from the chunks' (a miss never runs that forward either)."""
        pre = ChunkedPrefill(lm, tokens, chunk, lm.make_cache(), start=0)
        while not pre.done:
            pre.step(None)
        return serial_tokens(lm, [pre.last_token], max_tokens, cache=pre.cache, context=tokens)

    def decode(pre: ChunkedPrefill, arm) -> list[int]:
        got: list[int] = []
        gen = speculative_decode(lm, head, [pre.last_token], Sampler(SamplingParams(), prompt=pre.prompt), depth,
                                 exact=True, guard_margin=guard_margin, rollback=rollback, cache=pre.cache,
                                 history=pre.history, context=pre.prompt)
        for step in gen:
            got += step.tokens
            arm.cycles += 1
            arm.drafted += step.drafted
            arm.accepted += step.accepted
            if len(got) >= max_tokens:
                break
        gen.close()
        return got

    def together(prompts: list[list[int]], arm, pieces: random.Random) -> list[list[int]]:
        """Each prompt from its longest snapshot (or cold), prefilled together piece by piece;
        then each decoded."""
        rows = [opened(tokens, arm) for tokens in prompts]
        while not all(r.done for r in rows):
            prefill_together([r for r in rows if not r.done], pieces.randint(1, chunk))
        return [decode(r, arm) for r in rows]

    kinds = KINDS if together_matches_solo(lm) else tuple(k for k in KINDS if k != "prefilled together")
    arms = []
    for kind in kinds:
        arm = new_arm(mode="exact", depth=depth, drafting=LABELS.get(kind, f"mtp, resumed at a {kind}"))
        t0 = time.perf_counter()
        for pi, first in enumerate(encoded):
            nxt = encoded[(pi + 1) % len(encoded)]
            if kind == "paced pieces":
                later = first + nxt
                got = decode(prefill(opened(later), pieces=random.Random(pi)), arm)
                arm.resumed_at.append(0)
                arm.compare(missed(later), got[:max_tokens], max_tokens, prompt=pi)
                continue
            if kind == "prefilled together":
                pair = [first + nxt, nxt + first]
                for tokens, got in zip(pair, together(pair, arm, random.Random(pi))):
                    arm.compare(missed(tokens), got[:max_tokens], max_tokens, prompt=pi)
                continue
            if kind == "prompt end":
                prefill(opened(first))
                later = first + nxt
            else:
                pre = prefill(opened(first))
                said = decode(pre, arm)  # every committed token (a cycle may pass max_tokens)
                pc.store_final(first + said, pre.cache, pre.history, seat=f"seat-{pi}")
                later = first + said + nxt
            got = decode(prefill(opened(later, arm)), arm)  # resumed from the snapshot just taken
            arm.compare(missed(later), got[:max_tokens], max_tokens, prompt=pi)
        arm.seconds = time.perf_counter() - t0
        arms.append(arm)
    return arms, True
