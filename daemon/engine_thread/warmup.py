"""Start-up warm-up: run the shapes the daemon will serve before it says it is ready.

Why: the first use of a forward's shape pays one-time costs (on a GPU, MLX compiles kernels
and plans matmuls per shape and dtype; ``mx.compile``d decode layers trace per input shape;
everywhere, the first allocations of each size). Measured on the H200 without warm-up: the
first council round after start-up had 15.8 s TTFT per seat against 0.07-0.35 s steady. So
the engine thread runs each path once, after the start-up probes (exactness, batch) and
before ``ready`` (the first Pong), logging one ``warmup.<stage>`` event per stage with its
time, then ``warmup.done``.

Stages (``full``; ``light`` runs the first shape of each):
- ``prefill``: a chunked prefill of a whole ``scheduler.prefill_chunk`` chunk and of short
  remainders (a prefix-cache hit's tail is one), with a head history when the head is
  resident (the speculative prefill's extra work);
- ``decode``: serial decode steps (the compiled decode path where it is kept);
- ``speculate``: speculative cycles at every depth 1..``governor.max_depth`` (the verify's
  widths and the head's drafts), when the head is resident;
- ``batch``: a continuous-batch step at every height 2..``scheduler.batch_rows`` (max_active,
  or its ceiling with "auto"), with the head resident at every depth 0..``governor.max_depth``
  (the governor picks a depth per height from measurement, and a depth's first cycle at a
  height traces the compiled step for its verify's shape), a depth a piece. What that first
  cycle costs on a GPU was not measured apart: the first-round stall first blamed on it (a
  fresh H100, bench/results/h100_2026-12-06g) was a row leaving a batch of two, whose gather
  MLX compiled (now in the kernel prebuild).

Every stage runs the same forwards in the same order on every rank of a tensor-parallel
group (its collectives must line up), so nothing here depends on timing or on rank-0-only
state (the governor's live depth, for one).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import mlx.core as mx

from ..engine.pieces import pause
from ..engine.prefill.prefill import ChunkedPrefill
from ..engine.decoders.sampling import Sampler
from ..engine.decoders.serial import serial_decode
from ..engine.caches.head_history import HeadHistory
from ..engine.decoders.speculative import speculative_decode
from ..engine.types import SamplingParams

# Decode cycles per shape: the first pays the one-time costs, the second shows they are paid.
CYCLES = 2


def resolve(level: str, on_gpu: bool) -> str:
    """``auto`` is ``full`` on a GPU, ``light`` on the CPU (nothing compiles per shape there).
    In a group, rank 0 resolves it and the other ranks adopt its answer (lockstep.py)."""
    if level != "auto":
        return level
    return "full" if on_gpu else "light"


def _tokens(lm, n: int, salt: int = 0) -> list[int]:
    """n ordinary token ids (deterministic, inside the vocabulary, away from id 0)."""
    span = max(2, min(lm.text_args.vocab_size, 4096) - 1)
    return [1 + (salt * 7919 + 31 * i) % span for i in range(n)]


def _greedy() -> Sampler:
    return Sampler(SamplingParams(temperature=0.0, seed=0))


def _take(gen, n: int) -> None:
    try:
        for _ in range(n):
            next(gen)
    finally:
        gen.close()


# ``light``'s one prefill: the path once, not a whole chunk (on this project's 2-core CPU a
# 256-token chunk of the bundled model took 4 s of a 5.3 s light warm-up; nothing there
# compiles per shape, so the whole chunk bought nothing a short one does not).
LIGHT_PREFILL = 16


def prefill_lengths(level: str, chunk: int) -> list[int]:
    """Prompt lengths to prefill (each one token more than it forwards: the last is left
    for decode): ``full``, one whole chunk and short remainders (a hit's tail) of a few
    sizes; ``light``, one short prompt."""
    if level == "light":
        return [min(chunk, LIGHT_PREFILL) + 1]
    return [s + 1 for s in sorted({chunk, max(1, chunk // 2 + 1), min(chunk, 17), 1}, reverse=True)]


def prefill_prompt(lm, prompt: list[int], chunk: int, head, pause_each: bool = False) -> int:
    """Prefill ``prompt`` on an empty cache of its own, with the head's history where a head
    is given (the speculative prefill's extra work), to its end, a chunk a piece where
    ``pause_each``; return the tokens forwarded."""
    history = HeadHistory(head) if head is not None else None
    p = ChunkedPrefill(lm, prompt, chunk, lm.make_cache(), history)
    while not p.done:
        if pause_each:
            pause()
        p.step()
    return p.pos


def remaining_lengths(level: str, chunk: int) -> list[int]:
    """Every token count a lone prompt's forward can have (1..``chunk``: a remainder, a
    prefix-cache hit's tail, a paced piece) that ``level``'s prefill stage did not run."""
    ran = {n - 1 for n in prefill_lengths(level, chunk)} if level != "off" else set()
    return [n for n in range(1, chunk + 1) if n not in ran]


def prefill_each_length(lm, lengths: list[int], *, chunk: int, head) -> None:
    """Forward a prompt piece of each of ``lengths`` tokens once, each on an empty cache of
    its own, a length a piece (the ``prefill_lengths`` start-up part). Why: on CUDA a forward
    of a token count never run before pays per-shape costs (cuBLASLt picks each projection's
    algorithm per problem size; a new CUDA graph), 1.71x the same count again on an H100
    (bench/probes/prefill_length_first_use.py), and nearly every request's last prompt piece
    has a count of its own. ``head``: the resident MTP head (its history's forwards have the
    same counts), or None."""
    for i, n in enumerate(lengths):
        pause()
        prefill_prompt(lm, _tokens(lm, n + 1, 100 + i), max(chunk, n), head)
    mx.synchronize()


# Whole chunks of the ``prefill_depths`` part's prompt: 4,096 tokens at the default chunk of 256,
# the depth a council's shared system prompt and first turns reach.
DEPTH_CHUNKS = 16


def prefill_depths(lm, chunks: int, *, chunk: int, head) -> int:
    """Prefill one prompt of ``chunks`` whole chunks on an empty cache of its own, a chunk a
    piece (the ``prefill_depths`` start-up part); return the tokens forwarded. Why: the other
    warm-ups forward at depth 0 only, and a fresh H100's first council round ran a cold
    prompt's 256-token chunks at depths 256-1,024 in 41-54 ms against 17-22 ms for the same
    chunks in the rounds after it (bench/results/h100_2026-12-08), as if what grows with depth
    (the cache's buffers, attention's key lengths) were first met there. ``head``: the resident MTP
    head (its history grows with the prompt), or None."""
    tokens = prefill_prompt(lm, _tokens(lm, chunks * chunk + 1, 300), chunk, head, pause_each=True)
    mx.synchronize()
    return tokens


def run(level: str, lm, *, chunk: int, head, depths: list[int], batch, max_rows: int,
        emit: Callable[..., None], spec_options: dict | None = None) -> dict[str, float]:
    """Run the stages of ``level`` ("full" or "light"); return each stage's seconds. ``head``:
    the resident MTP head (None: no speculate stage); ``batch``: the BatchDecoder (None: no
    batch stage); ``emit(event, **fields)`` logs; ``spec_options``: speculative_decode's keyword
    arguments as the worker passes them (rollback, guard_margin, pipeline)."""
    out: dict[str, float] = {}

    def timed(name: str, fn, pause_first: bool = True) -> float:
        # Run at idle (warming.py), a stage is at least one piece: it leaves the engine as it
        # found it. Its seconds then include the requests served between its pieces. The batch
        # stage is one piece: its rows sit in the daemon's own batch while it runs.
        if pause_first:
            pause()
        t0 = time.perf_counter()
        fn()
        mx.synchronize()
        out[name] = round(time.perf_counter() - t0, 3)
        return out[name]

    lengths = prefill_lengths(level, chunk)

    def prefill() -> None:
        for i, n in enumerate(lengths):
            prefill_prompt(lm, _tokens(lm, n, i), chunk, head)
            pause()  # a prefill a piece: each holds its own cache

    emit("warmup.prefill", mode=level, seconds=timed("prefill", prefill), tokens=[n - 1 for n in lengths],
         chunk=chunk)

    def decode() -> None:
        _take(serial_decode(lm, _tokens(lm, 8, 1), _greedy()), CYCLES + 1)

    emit("warmup.decode", mode=level, seconds=timed("decode", decode), steps=CYCLES + 1)

    if head is not None and depths:
        run_depths = depths if level == "full" else depths[:1]

        def speculate() -> None:
            for k in run_depths:
                gen = speculative_decode(lm, head, _tokens(lm, 8, 2 + k), _greedy(), depth=k, exact=True,
                                         **(spec_options or {}))
                _take(gen, CYCLES + 1)
                pause()  # a depth a piece: the generator is closed

        emit("warmup.speculate", mode=level, seconds=timed("speculate", speculate), depths=run_depths)

    pause()
    # The batch stage adds its rows to the daemon's own batch and steps it: run at idle between
    # requests (warming.py), it must find the batch empty, or it would step requests' rows (and
    # the batch may be full). Requests already batching have paid those heights' first use.
    if batch is not None and max_rows >= 2 and len(batch) == 0:
        heights = list(range(2, max_rows + 1)) if level == "full" else [2]
        # None: the depth the batch would take (depth 0 without a head). Fixed by the config,
        # never by the governor's live depths: every rank of a group runs the same.
        batch_depths: list[int | None] = [None]
        if level == "full" and head is not None and depths and hasattr(batch, "depth_for"):
            batch_depths = [0, *depths]

        def batched(depth: int | None) -> None:
            rows = []
            if depth is not None:
                live_depth_for = batch.depth_for
                batch.depth_for = lambda _height: depth
            try:
                for h in range(1, heights[-1] + 1):
                    key = ("__warmup__", h)
                    batch.add(key, _greedy(), _tokens(lm, 4 + h, 10 + h))
                    rows.append(key)
                    if h in heights:
                        for _ in range(CYCLES):
                            batch.step()
            finally:
                if depth is not None:
                    batch.depth_for = live_depth_for
                for key in rows:
                    if key in batch:
                        batch.remove(key)

        seconds, warmed = 0.0, []
        for i, depth in enumerate(batch_depths):
            if i:
                pause()  # a depth a piece: its rows have left the batch
            # No pause between the emptiness check and the piece: a request could fill the batch.
            # Rows that came meanwhile pay their own shapes' first use, as before the stage.
            if len(batch) != 0:
                break
            seconds += timed("batch", lambda d=depth: batched(d), pause_first=False)
            warmed.append(depth)
        out["batch"] = round(seconds, 3)
        emit("warmup.batch", mode=level, seconds=out["batch"], heights=heights,
             depths=[d for d in warmed if d is not None])
    return out
