"""Does the prefill chunk size change the numerics? (OPERATIONS.md, Chunked prefill.)

Prefills one random prompt with ``prefill.prefill`` at 2,048-token chunks and at each size
given, then compares every cache array bit for bit and 40 greedy tokens decoded after it.

    .venv/bin/python bench/probes/prefill_chunk_numerics.py daemon/assets/tiny-qwen35 600 512,256,128,64,32,16
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from daemon.engine.model.loading import load_model  # noqa: E402
from daemon.engine.decoders.sampling import Sampler  # noqa: E402
from daemon.engine.decoders.serial import serial_decode  # noqa: E402
from daemon.engine.prefill.prefill import prefill  # noqa: E402
from daemon.engine.types import SamplingParams  # noqa: E402


def main() -> None:
    model, n, sizes = sys.argv[1], int(sys.argv[2]), [int(x) for x in sys.argv[3].split(",")]
    lm = load_model(model)
    rng = random.Random(0)
    prompt = [rng.randrange(1, lm.text_args.vocab_size) for _ in range(n)]

    def run(chunk: int):
        cache = lm.make_cache()
        t0 = time.perf_counter()
        last = prefill(lm, prompt, cache, chunk)
        dt = time.perf_counter() - t0
        gen = serial_decode(lm, [last.item()], Sampler(SamplingParams()), cache=cache)
        toks = [next(gen).tokens[0] for _ in range(40)]
        gen.close()
        return toks, [a for _, a in tree_flatten([c.state for c in cache])], dt

    ref, ref_state, dt = run(2048)
    print(f"2048: {dt:.2f} s (reference)")
    for c in sizes:
        toks, state, dt = run(c)
        same = len(state) == len(ref_state) and all(
            (a is None and b is None) or mx.array_equal(a, b).item() for a, b in zip(state, ref_state))
        print(f"{c}: tokens same {toks == ref}, state bit-identical {same}, {dt:.2f} s")


if __name__ == "__main__":
    main()
