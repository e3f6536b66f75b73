"""The fidelity gate's batched arms: speculation inside the continuous batch vs serial decode.

For each mode and batch height B, temperature 0: rows of mixed prompts (and prompt
lengths) and mixed per-row depth ceilings decode together in one ``SpecBatchDecoder``;
rows join mid-stream (the batch starts half full and a new row is admitted whenever one
leaves or there is room), leave when they have their tokens, and one row per arm is
taken out and put back (``extract`` / ``add``, as parking does). With ``mixed_processors``
every third row carries the gate's logit processors. With ``lookup``, every other row drafts
prompt-lookup blocks too (batch_spec.py's lookup cycles: those rows verify their blocks, the
others their head's drafts, in one forward). Each row's tokens are compared with
the same prompt decoded alone by serial_decode under the same sampling parameters: an exact
row must be identical (the gate fails otherwise); fast rows count flips.

With ``riding``, each (mode, height) also runs a "pieces riding" arm (scheduler.mixed_steps,
engine/prefill/mixed_forward.py): the depth alternates between 0 and the arm's every four cycles,
and meanwhile prompts are prefilled one after another in pieces of random size (1-8 tokens)
that the batch's depth-0 forwards carry (a drafting cycle's piece runs alone, as the engine
step runs it); each rider then decodes alone from the cache its pieces built, and is compared
with serial decode like a row. Exact riding arms run only where ``mixed_matches_alone``
passes, as the engine lets exact requests ride only then.

fidelity.py runs these arms and owns the report; it hands in its arm record (``new_arm``,
whose ``compare`` counts a row against serial), its serial reference (``serial_tokens``)
and its processor set, so this module does not import it back.
"""

from __future__ import annotations

import itertools
import random
import sys
import time

from collections.abc import Callable

from ..engine.decoders.batch_spec import SpecBatchDecoder
from ..engine.decoders.lookup import LookupConfig
from ..engine.prefill.mixed_forward import Ride, mixed_matches_alone
from ..engine.model.model import LoadedModel
from ..engine.prefill.prefill import ChunkedPrefill
from ..engine.caches.prefix_cache import splits_agree
from ..engine.decoders.sampling import Sampler
from ..engine.decoders.serial import serial_decode
from ..engine.types import SamplingParams

ROW_DEPTHS = (1, 2, 3, 4, 0)  # per-row ceilings, in turn (0: a row that never drafts)
RIDER_CHUNK = 64  # the riders' prefill chunk, cut into pieces of 1-8 tokens


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
    riding: bool = False,
    lookup: LookupConfig | None = None,
) -> list:
    """One arm per (mode, height), and with ``riding`` a "pieces riding" arm per (mode, height);
    ``processors`` (None: none) go on every third row, ``lookup`` (None: none) on every other."""
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

    # Riders are cut in random pieces: exact only where off-grid splits are too (as the
    # engine cuts exact prompts only then).
    ride_exact = riding and mixed_matches_alone(lm) and splits_agree(lm, RIDER_CHUNK)
    for mode, B, rides in itertools.product(modes, heights, (False, True) if riding else (False,)):
        exact = mode == "exact"
        if rides and exact and not ride_exact:
            print(f"riding exact arm x{B} skipped: mixed forwards or off-grid splits are not bit-identical here, "
                  "so exact requests' pieces do not ride (the daemon runs them alone)", file=sys.stderr)
            continue
        n_rows = rows_per_arm or 2 * B
        # Row r: prompt r mod len, processors on every third row, its own depth ceiling.
        plan = [(r % len(encoded), mixed_processors and r % 3 == 2, ROW_DEPTHS[r % len(ROW_DEPTHS)]) for r in range(n_rows)]
        arm = new_arm(mode=mode, depth=depth, drafting=f"batch x{B}" + (", pieces riding" if rides else "")
                      + (", lookup" if lookup is not None else ""), processors=mixed_processors, batch_rows=B)
        t0 = time.perf_counter()
        cycle = [0]
        depth_for = (lambda height: depth if (cycle[0] // 4) % 2 else 0) if rides else (lambda height: depth)
        bd = SpecBatchDecoder(lm, lambda: head, depth_for, max_rows=B)
        if exact and not bd.exact_ok:
            print(f"batched exact arm x{B} skipped: this backend's batched verify is not bit-identical to serial "
                  "steps, so exact rows do not batch here (the daemon decodes them alone)", file=sys.stderr)
            continue
        got: dict[int, list[int]] = {}
        next_row, parked_once = 0, False
        riders = _Riders(lm, encoded, random.Random(B)) if rides else None

        samplers: dict[int, Sampler] = {}

        def admit(r: int) -> None:
            pi, with_procs, ceiling = plan[r]
            samplers[r] = Sampler(procs if with_procs else plain, prompt=encoded[pi])
            bd.add(r, samplers[r], encoded[pi], exact=exact, depth=lambda c=ceiling: c,
                   lookup=lookup if r % 2 else None)
            got[r] = []

        while next_row < max(1, B // 2):
            admit(next_row)
            next_row += 1
        while len(bd):
            ride = riders.offer() if riders is not None else None
            for r, step in bd.step(ride).items():
                got[r] += step.tokens
                arm.cycles += 1
                if step.draft_source == "lookup":
                    arm.lookup_cycles += 1
                    arm.lookup_drafted += step.drafted
                    arm.lookup_accepted += step.accepted
                    continue
                arm.drafted += step.drafted
                arm.accepted += step.accepted
            if riders is not None:
                riders.after(ride, max_tokens)
            cycle[0] += 1
            for r in [r for r in bd.row_ids if len(got[r]) >= max_tokens]:
                bd.remove(r)  # leaves mid-stream; the others go on
            if not parked_once and len(bd) >= 2 and any(len(got[r]) >= max_tokens // 3 for r in bd.row_ids):
                r = bd.row_ids[0]  # out and back in, as a parked row is
                cache, primary, hist = bd.extract(r)
                bd.add(r, samplers[r], [primary], cache=cache, history=hist, exact=exact,
                       depth=lambda c=plan[r][2]: c, lookup=lookup if r % 2 else None,
                       context=encoded[plan[r][0]] + got[r][:-1])
                parked_once = True
            if next_row < n_rows and len(bd) < B:
                admit(next_row)
                next_row += 1
        for r in range(n_rows):
            pi, with_procs, _ = plan[r]
            arm.compare(ref(pi, with_procs), got[r][:max_tokens], max_tokens, prompt=pi, row=r)
        if riders is not None:
            riders.finish(max_tokens)  # the prompt in flight, to its end alone
            if not riders.carried:
                raise RuntimeError(f"the riding arm x{B} carried no piece in a decode forward")
            for pi, tokens in riders.decoded:
                arm.compare(ref(pi, False), tokens, max_tokens, prompt=pi, row="rider")
        arm.seconds = time.perf_counter() - t0
        arms.append(arm)
    return arms


class _Riders:
    """The riding arm's prompts: prefilled one after another in random pieces offered to the
    batch's forwards (run alone where no forward carried them), each decoded alone from the
    cache they built once its prefill is done."""

    def __init__(self, lm: LoadedModel, encoded: list[list[int]], rng: random.Random):
        self.lm, self.rng = lm, rng
        self.queue = list(range(len(encoded)))
        self.encoded = encoded
        self.pre: ChunkedPrefill | None = None
        self.pi = -1
        self.n = 0
        self.carried = 0
        self.decoded: list[tuple[int, list[int]]] = []

    def offer(self) -> Ride | None:
        while self.pre is None or self.pre.done:
            if not self.queue:
                return None
            self.pi = self.queue.pop(0)
            if len(self.encoded[self.pi]) > 1:
                self.pre = ChunkedPrefill(self.lm, self.encoded[self.pi], RIDER_CHUNK, self.lm.make_cache())
        self.n = self.pre.next_piece(self.rng.randint(1, 8))
        return Ride(self.pre.piece_ids(self.n)[None], self.pre.cache)

    def after(self, ride: Ride | None, max_tokens: int) -> None:
        if ride is None:
            return
        if ride.hidden is not None:
            self.pre.ridden(ride.hidden, self.n)
            self.carried += 1
        else:
            self.pre.step(self.n)
        if self.pre.done:
            self._decode(max_tokens)

    def finish(self, max_tokens: int) -> None:
        if self.pre is not None and not self.pre.done:
            while self.pre.step():
                pass
            self._decode(max_tokens)

    def _decode(self, max_tokens: int) -> None:
        steps = serial_decode(self.lm, [self.pre.last_token], Sampler(SamplingParams()), cache=self.pre.cache)
        self.decoded.append((self.pi, [s.tokens[0] for s in itertools.islice(steps, max_tokens)]))
