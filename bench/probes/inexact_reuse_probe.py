"""What an inexact prefix-cache hit costs (prefix_cache.inexact_reuse, OPERATIONS.md).

For each of ``--prompts`` random prompts, two states of the same tokens (turn 1's prompt,
its greedy answer, a new message), then ``--tokens`` greedy tokens from each:
- cold: the whole turn-2 prompt prefilled in ``--chunk``-token chunks (what a cold run does);
- hit: the state a continuation hit resumes from (turn 1 prefilled in chunks, its answer
  decoded one token at a time), then the new message prefilled in chunks from there.
Reported: whether the states are bit-identical, the largest |logit difference| at the first
decode step, and how many prompts' greedy continuations differ (and where they first do).

    .venv/bin/python bench/probes/inexact_reuse_probe.py --json bench/results/inexact_reuse_cpu.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from daemon.engine.model.loading import load_model  # noqa: E402
from daemon.engine.prefill.prefill import ChunkedPrefill  # noqa: E402
from daemon.paths import BUNDLED_MODEL  # noqa: E402


def prefill(lm, cache, tokens: list[int], chunk: int) -> None:
    """Forward all of ``tokens`` into ``cache`` in chunks (ChunkedPrefill leaves the last
    token for decode, so give it one more)."""
    pre = ChunkedPrefill(lm, tokens + [0], chunk, cache)
    while not pre.done:
        pre.step()


def greedy(lm, cache, last: int, n: int) -> tuple[list[int], mx.array]:
    out, tok, first = [], last, None
    for _ in range(n):
        logits = lm.logits(lm.hidden(mx.array([[tok]], dtype=mx.uint32), cache))[0, -1]
        if first is None:
            first = logits
        tok = int(mx.argmax(logits).item())
        out.append(tok)
    return out, first


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(BUNDLED_MODEL))
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--answer-tokens", type=int, default=24)
    ap.add_argument("--message-tokens", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--json")
    args = ap.parse_args()
    lm = load_model(args.model)
    vocab = lm.text_args.vocab_size
    rows = []
    for i in range(args.prompts):
        rng = random.Random(i)
        turn1 = [rng.randrange(1, min(vocab, 50000)) for _ in range(args.prompt_tokens)]
        c1 = lm.make_cache()
        prefill(lm, c1, turn1[:-1], args.chunk)
        answer, _ = greedy(lm, c1, turn1[-1], args.answer_tokens)  # c1: turn1 + answer[:-1]
        message = [rng.randrange(1, min(vocab, 50000)) for _ in range(args.message_tokens)]
        turn2 = turn1 + answer + message
        cold = lm.make_cache()
        prefill(lm, cold, turn2[:-1], args.chunk)
        hit = c1  # resumes after answer[:-1]: the continuation as a decoder leaves it
        prefill(lm, hit, turn2[len(turn1) + len(answer) - 1 : -1], args.chunk)
        same_state = all(mx.array_equal(a, b).item() for a, b in zip(
            [x for c in cold for x in c.state if isinstance(x, mx.array)],
            [x for c in hit for x in c.state if isinstance(x, mx.array)]))
        cold_out, cold_logits = greedy(lm, cold, turn2[-1], args.tokens)
        hit_out, hit_logits = greedy(lm, hit, turn2[-1], args.tokens)
        first_diff = next((j for j, (a, b) in enumerate(zip(cold_out, hit_out)) if a != b), None)
        rows.append({"prompt": i, "state_bit_identical": same_state,
                     "max_abs_logit_diff": float(mx.max(mx.abs(cold_logits - hit_logits)).item()),
                     "tokens_identical": cold_out == hit_out, "first_difference_at": first_diff})
        print(rows[-1], flush=True)
    summary = {"prompts": len(rows), "states_bit_identical": sum(r["state_bit_identical"] for r in rows),
               "continuations_identical": sum(r["tokens_identical"] for r in rows),
               "max_abs_logit_diff": max(r["max_abs_logit_diff"] for r in rows)}
    print(summary)
    if args.json:
        Path(args.json).write_text(json.dumps({"command": "python bench/probes/inexact_reuse_probe.py " + " ".join(sys.argv[1:]),
                                               "args": vars(args), "summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
