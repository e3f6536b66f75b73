"""The fidelity gate's batched arms: speculation inside the continuous batch vs serial decode.

For each mode and batch height B, temperature 0: rows of mixed prompts (and prompt
lengths) and mixed per-row depth ceilings decode together in one ``SpecBatchDecoder``;
rows join mid-stream (the batch starts half full and a new row is admitted whenever one
leaves or there is room), leave when they have their tokens, and one row per arm is
taken out and put back (``extract`` / ``add``, as parking does). With ``mixed_processors``
every third row carries the gate's logit processors. Each row's tokens are compared with
the same prompt decoded alone by serial_decode under the same sampling parameters: an exact
row must be identical (the gate fails otherwise); fast rows count flips.

fidelity.py runs these arms and owns the report; it hands in its arm record (``new_arm``,
whose ``compare`` counts a row against serial), its serial reference (``serial_tokens``)
and its processor set, so this module does not import it back.
"""

from __future__ import annotations

import itertools
import sys
import time

from collections.abc import Callable

from ..engine.batch_spec import SpecBatchDecoder
from ..engine.model import LoadedModel
from ..engine.sampling import Sampler
from ..engine.types import SamplingParams

ROW_DEPTHS = (1, 2, 3, 4, 0)  # per-row ceilings, in turn (0: a row that never drafts)


def run_batched_arms(
    lm: LoadedModel,
    head,
    prompts: list[str] | list[list[int]],
    new_arm: Callable[..., object],
    serial_tokens: Callable[[LoadedModel, list[int], int, SamplingParams], list[int]],
    processors: dict | None,
    heights=(2, 4, 8),
    max_tokens: int = 48,
    modes=("exact", "fast"),
    depth: int = 4,
    rows_per_arm: int | None = None,
) -> list:
    """One arm per (mode, height); ``processors`` (None: none) go on every third row."""
    encoded = [p if isinstance(p, list) else lm.encode_prompt(p, None, None) for p in prompts]
    plain = SamplingParams()
    procs = SamplingParams(**processors) if processors else plain
    mixed_processors = bool(processors)
    arms = []
    refs: dict[tuple[int, bool], list[int]] = {}

    def ref(pi: int, with_procs: bool) -> list[int]:
        if (pi, with_procs) not in refs:
            refs[(pi, with_procs)] = serial_tokens(lm, encoded[pi], max_tokens, procs if with_procs else plain)
        return refs[(pi, with_procs)]

    for mode, B in itertools.product(modes, heights):
        exact = mode == "exact"
        n_rows = rows_per_arm or 2 * B
        # Row r: prompt r mod len, processors on every third row, its own depth ceiling.
        plan = [(r % len(encoded), mixed_processors and r % 3 == 2, ROW_DEPTHS[r % len(ROW_DEPTHS)]) for r in range(n_rows)]
        arm = new_arm(mode=mode, depth=depth, drafting=f"batch x{B}", processors=mixed_processors, batch_rows=B)
        t0 = time.perf_counter()
        bd = SpecBatchDecoder(lm, lambda: head, lambda height: depth, max_rows=B)
        if exact and not bd.exact_ok:
            print(f"batched exact arm x{B} skipped: this backend's batched verify is not bit-identical to serial "
                  "steps, so exact rows do not batch here (the daemon decodes them alone)", file=sys.stderr)
            continue
        got: dict[int, list[int]] = {}
        next_row, parked_once = 0, False

        samplers: dict[int, Sampler] = {}

        def admit(r: int) -> None:
            pi, with_procs, ceiling = plan[r]
            samplers[r] = Sampler(procs if with_procs else plain, prompt=encoded[pi])
            bd.add(r, samplers[r], encoded[pi], exact=exact, depth=lambda c=ceiling: c)
            got[r] = []

        while next_row < max(1, B // 2):
            admit(next_row)
            next_row += 1
        while len(bd):
            for r, step in bd.step().items():
                got[r] += step.tokens
                arm.cycles += 1
                arm.drafted += step.drafted
                arm.accepted += step.accepted
            for r in [r for r in bd.row_ids if len(got[r]) >= max_tokens]:
                bd.remove(r)  # leaves mid-stream; the others go on
            if not parked_once and len(bd) >= 2 and any(len(got[r]) >= max_tokens // 3 for r in bd.row_ids):
                r = bd.row_ids[0]  # out and back in, as a parked row is
                cache, primary, hist = bd.extract(r)
                bd.add(r, samplers[r], [primary], cache=cache, history=hist, exact=exact,
                       depth=lambda c=plan[r][2]: c)
                parked_once = True
            if next_row < n_rows and len(bd) < B:
                admit(next_row)
                next_row += 1
        for r in range(n_rows):
            pi, with_procs, _ = plan[r]
            arm.compare(ref(pi, with_procs), got[r][:max_tokens], max_tokens, prompt=pi, row=r)
        arm.seconds = time.perf_counter() - t0
        arms.append(arm)
    return arms
