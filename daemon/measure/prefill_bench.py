"""Prefill before/after: token-by-token GatedDeltaNet recurrence vs the chunked form, by length.

``councild bench prefill [--model PATH] [--lengths 256,1024,2048] [--rounds N] [--json OUT]``

Arms: the engine's prefill (``prefill.prefill``: the prompt but its last token, in chunks of
PREFILL_CHUNK) followed by the first decode step (logits at the last position only, argmax
read back): what a request waits for before its first token. "token loop" runs every
GatedDeltaNet layer through mlx-lm's recurrence (``lm.chunked_prefill = False``); "chunked"
through ``chunked_prefill.py``. Same weights, same process; only that switch differs.
Every round runs both arms at every length; the order reverses on alternate rounds
(ABAB / BABA); one warm-up round is discarded. Reported per length: tok/s median and range
per arm, and chunked/token-loop as the median (min-max) of per-round ratios.

Exactness: in the warm-up round the chunked prefill also runs as speculation runs it
(``prefill_with_hidden``) and the caches are compared bit for bit with serial decode's.

Agreement: in the warm-up round each arm also decodes ``--continuation`` greedy tokens after
its prefill; the table says where (if anywhere) the chunked arm's continuation first differs
from the token loop's, with the token loop's top-2 logit margin there (a near-tie: see
tests/daemon/test_chunked_prefill.py for the stated numerics).
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import time
from pathlib import Path

import mlx.core as mx

from .bench_io import spread, write_results
from .progress import Progress, Quiet

ARMS = ("token loop", "chunked")


def make_prompt(lm, length: int, seed: int = 0) -> list[int]:
    """``length`` tokens: the fixed fidelity prompts cycled (natural text) where the model has
    a tokenizer, else seeded random ids."""
    if lm.tokenizer is not None:
        from .fidelity import load_prompts

        text = sum((lm.encode_prompt(p, None, None) for p in load_prompts()), [])
        return (text * (length // len(text) + 1))[:length]
    rng = random.Random(seed)
    V = lm.text_args.vocab_size
    return [rng.randrange(V) for _ in range(length)]


def prefill_and_first_token(lm, prompt: list[int]) -> tuple[float, mx.array, list]:
    """Seconds for prefill + the first token (argmax read back); that step's logits [V]; the
    cache (for a continuation)."""
    from ..engine.prefill.prefill import prefill

    cache = lm.make_cache()
    t = time.perf_counter()
    last = prefill(lm, prompt, cache)
    logits = lm.logits(lm.hidden(last[None], cache))[0, -1]
    mx.argmax(logits).item()
    return time.perf_counter() - t, logits, cache


def _top(logits: mx.array) -> tuple[int, float]:
    top2 = mx.sort(logits.astype(mx.float32))[-2:].tolist()
    return mx.argmax(logits).item(), top2[1] - top2[0]


def greedy_continuation(lm, logits: mx.array, cache: list, n: int) -> tuple[list[int], list[float]]:
    """n greedy tokens from the first step's logits on (the decode path, unchanged), and the
    top-2 margin at each."""
    toks, margins = [], []
    for i in range(n):
        if i:
            logits = lm.logits(lm.hidden(mx.array([[toks[-1]]], dtype=mx.uint32), cache))[0, -1]
        tok, margin = _top(logits)
        toks.append(tok)
        margins.append(margin)
    return toks, margins


def prefill_paths_identical(lm, prompt: list[int], head=None) -> bool:
    """Do serial decode's prefill and speculation's (``prefill_with_hidden``, which also
    evaluates the hiddens and feeds the head) leave bit-identical caches? Exact mode needs it."""
    from ..engine.kernels.forward import cache_arrays
    from ..engine.prefill.prefill import prefill
    from ..engine.caches.head_history import HeadHistory
    from ..engine.decoders.speculative import prefill_with_hidden

    a, b = lm.make_cache(), lm.make_cache()
    prefill(lm, prompt, a)
    prefill_with_hidden(lm, prompt, b, HeadHistory(head))
    return all(mx.array_equal(x, y).item() for x, y in zip(cache_arrays(a), cache_arrays(b), strict=True))


def run_prefill_ab(lm, lengths, rounds: int = 3, continuation: int = 32, log=print,
                   progress: Progress | None = None) -> dict:
    saved = lm.chunked_prefill
    raw = {(L, a): [] for L in lengths for a in ARMS}
    agreement: dict = {}
    identical: dict = {}
    prompts = {L: make_prompt(lm, L) for L in lengths}
    progress = progress or Quiet()
    progress.add((rounds + 1) * len(lengths) * len(ARMS))
    try:
        for r in range(rounds + 1):  # round 0: warm-up (traces, allocator), plus agreement
            order = ARMS if r % 2 == 0 else tuple(reversed(ARMS))
            for L in lengths:
                conts = {}
                for arm in order:
                    progress.step(f"round {r}/{rounds}{' (warm-up)' if r == 0 else ''}, {L}-token prompt, arm {arm}")
                    lm.chunked_prefill = arm == "chunked"
                    dt, logits, cache = prefill_and_first_token(lm, prompts[L])
                    if r == 0:
                        log(f"warm-up {L} tokens, {arm}: {dt:.2f} s")
                    if r == 0 and continuation > 0:
                        conts[arm] = greedy_continuation(lm, logits, cache, continuation)
                    del cache
                    mx.clear_cache()
                    if r > 0:
                        raw[(L, arm)].append(L / dt)
                if r == 0:
                    lm.chunked_prefill = True
                    identical[L] = prefill_paths_identical(lm, prompts[L])
                if r == 0 and continuation > 0:
                    (ref, margins), (got, _) = conts["token loop"], conts["chunked"]
                    first = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), None)
                    agreement[L] = {"tokens": continuation, "first_difference": first,
                                    "margin_there": None if first is None else margins[first]}
            if r > 0:
                log(f"round {r}/{rounds}: " + ", ".join(
                    f"{L}: {raw[(L, 'token loop')][-1]:.0f} -> {raw[(L, 'chunked')][-1]:.0f} tok/s" for L in lengths))
    finally:
        lm.chunked_prefill = saved
    res: dict = {"rounds": rounds, "lengths": list(lengths), "by_length": {}, "agreement": agreement,
                 "serial_and_speculative_prefill_identical": identical}
    for L in lengths:
        base, new = raw[(L, "token loop")], raw[(L, "chunked")]
        res["by_length"][L] = {"token_loop_tok_s": spread(base), "chunked_tok_s": spread(new),
                               "ratio": spread([b / a for a, b in zip(base, new)]),
                               "raw": {"token_loop": base, "chunked": new}}
    return res


def format_prefill_ab(res: dict, title: str) -> str:
    lines = [f"## {title}", "",
             f"{res['rounds']} rounds (+1 warm-up), interleaved ABAB/BABA; prefill + first token; "
             "ratio = median (min-max) of per-round chunked / token loop.", "",
             "| prompt tokens | token loop tok/s (min-max) | chunked tok/s (min-max) | chunked / token loop | "
             "greedy continuation |", "|---|---|---|---|---|"]
    for L, r in res["by_length"].items():
        a, b, q = r["token_loop_tok_s"], r["chunked_tok_s"], r["ratio"]
        ag = res["agreement"].get(L)
        if ag is None:
            agree = "not checked"
        elif ag["first_difference"] is None:
            agree = f"same {ag['tokens']} tokens"
        else:
            agree = f"differs at {ag['first_difference']} (top-2 margin there {ag['margin_there']:.3g})"
        lines.append(f"| {L} | {a['median']:.0f} ({a['min']:.0f}-{a['max']:.0f}) | "
                     f"{b['median']:.0f} ({b['min']:.0f}-{b['max']:.0f}) | "
                     f"{q['median']:.2f}x ({q['min']:.2f}-{q['max']:.2f}) | {agree} |")
    ident = res.get("serial_and_speculative_prefill_identical", {})
    if ident:
        lines += ["", "Chunked prefill, serial decode's vs speculation's (hiddens + head fed): caches "
                  + ", ".join(f"{L}: {'bit-identical' if ok else '**DIFFER**'}" for L, ok in ident.items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="councild bench prefill", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model folder (default: the bundled model)")
    ap.add_argument("--lengths", default="256,1024,2048", help="prompt lengths (comma list)")
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds (>= 1), after one warm-up")
    ap.add_argument("--continuation", type=int, default=32, help="greedy tokens compared after the prefill (0: none)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--markdown", help="also write the markdown table here")
    args = ap.parse_args(argv)
    try:
        lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    except ValueError:
        print(f"councild bench prefill: --lengths wants a comma list of integers, got {args.lengths!r}", file=sys.stderr)
        return 2
    if args.rounds < 1 or not lengths or min(lengths) < 2:
        print("councild bench prefill: --rounds >= 1 and lengths >= 2, please", file=sys.stderr)
        return 2

    from ..engine.model.loading import load_model
    from .fidelity import default_model_path

    path = Path(args.model) if args.model else default_model_path()
    lm = load_model(path)
    if not lm.supports_mtp:
        print(f"councild bench prefill: {lm.model_type!r} has no GatedDeltaNet layers to chunk", file=sys.stderr)
        return 1
    progress = Progress("bench prefill", 0)
    res = run_prefill_ab(lm, lengths, args.rounds, args.continuation,
                         log=lambda m: print(m, file=sys.stderr, flush=True), progress=progress)
    res["model"] = str(path)
    res["machine"] = {"platform": platform.platform(), "device": str(mx.default_device()), "mlx": mx.__version__}
    res["command"] = "councild bench prefill " + " ".join(argv if argv is not None else sys.argv[1:])
    md = format_prefill_ab(res, f"prefill, token loop vs chunked: {path.name}, {res['machine']['device']}")
    progress.finish(f"{len(lengths)} prompt lengths x {args.rounds} rounds")
    print(md)
    write_results(res, md, args.json, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
