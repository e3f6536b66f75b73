"""Before/after for the compiled decode step: eager vs compiled, interleaved, same process.

``councild bench compile [--model PATH] [--rounds N] [--tokens N] [--depths 1,2] [--json OUT]``

Arms: serial decode and speculation at each depth (capture rollback, exact mode), each
once with every one-token forward eager and once compiled (``compiled.py``). The two
paths share the weights: an arm swaps ``lm.compiled_decode`` in or out, so nothing but the
decode path differs. Every round runs every arm over the same prompts; the order reverses
on alternate rounds (ABAB / BABA); one warm-up round is discarded (it also pays the trace).
Reported: tok/s median and spread per arm, and compiled/eager as the median of per-round
ratios (with min and max), per depth; then single forwards of T = 1..5 tokens (a decode
step, verifies), eager and compiled alternately, synced, per-pair ratios. Tokens are compared as well: the compiled path is
kept only where it is bit-identical, so a mismatch here is a bug and is reported as one.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx

from .bench_io import spread, write_results
from .progress import Progress, Quiet
from .fidelity import default_model_path, load_prompts
from ..engine.decoders.sampling import Sampler
from ..engine.decoders.serial import serial_decode
from ..engine.decoders.speculative import speculative_decode
from ..engine.types import SamplingParams


@contextmanager
def decode_path(lm, compiled):
    """Run the body with ``lm.compiled_decode`` set to ``compiled`` (None = eager)."""
    saved = lm.compiled_decode
    lm.compiled_decode = compiled
    try:
        yield
    finally:
        lm.compiled_decode = saved


def _run(lm, head, prompts: list[list[int]], tokens: int, depth: int) -> tuple[float, list[list[int]]]:
    import time

    outs = []
    t0 = time.perf_counter()
    for prompt in prompts:
        sampler = Sampler(SamplingParams())
        gen = serial_decode(lm, prompt, sampler) if depth == 0 else \
            speculative_decode(lm, head, prompt, sampler, depth, exact=True, rollback="capture")
        got: list[int] = []
        for step in gen:
            got += step.tokens
            if len(got) >= tokens:
                break
        gen.close()
        outs.append(got[:tokens])
    return len(prompts) * tokens / (time.perf_counter() - t0), outs


def run_compile_ab(lm, head, prompts, depths=(1,), rounds: int = 5, tokens: int = 48, log=print,
                   progress: Progress | None = None) -> dict:
    """``lm.compiled_decode`` must be set (the compiled arm); the eager arm unsets it."""
    compiled = lm.compiled_decode
    if compiled is None:
        raise ValueError(f"no compiled decode step to compare ({lm.decode_path})")
    ks = [0] + ([k for k in depths if k > 0] if head is not None else [])
    arms = [(f"{'serial' if k == 0 else f'd{k}'}/{p}", k, p) for k in ks for p in ("eager", "compiled")]
    raw: dict[str, list[float]] = {name: [] for name, _, _ in arms}
    mismatches: list[str] = []
    progress = progress or Quiet()
    progress.add((rounds + 1) * len(arms))
    for r in range(rounds + 1):  # round 0: warm-up (and the compiled arm's traces)
        order = arms if r % 2 == 0 else list(reversed(arms))
        outs: dict[str, list] = {}
        for name, k, path in order:
            progress.step(f"round {r}/{rounds}{' (warm-up)' if r == 0 else ''}, arm {name}, "
                          f"{len(prompts)} prompts x {tokens} tokens")
            with decode_path(lm, compiled if path == "compiled" else None):
                tps, outs[name] = _run(lm, head, prompts, tokens, k)
            if r > 0:
                raw[name].append(tps)
        for k in ks:
            base = "serial" if k == 0 else f"d{k}"
            if outs[f"{base}/eager"] != outs[f"{base}/compiled"]:
                mismatches.append(f"round {r}: {base} compiled tokens differ from eager")
        if r > 0:
            log(f"round {r}/{rounds}: " + ", ".join(f"{n} {raw[n][-1]:.1f}" for n, _, _ in arms))
    res: dict = {"rounds": rounds, "tokens_per_prompt": tokens, "prompts": len(prompts), "arms": {}, "ratio": {},
                 "token_mismatches": mismatches}
    for name, _, _ in arms:
        res["arms"][name] = {"tok_s": spread(raw[name]), "raw_tok_s": raw[name]}
    for k in ks:
        base = "serial" if k == 0 else f"d{k}"
        res["ratio"][base] = spread([c / e for c, e in zip(raw[f"{base}/compiled"], raw[f"{base}/eager"])])
    return res


def paired_forward_times(lm, compiled, Ts=(1, 2, 3, 4), pairs: int = 20, context: int = 64, capture: bool = True) -> dict:
    """Forward (+ logits) of T tokens at a fixed context, eager and compiled alternately
    (order flipped every pair), each synced; per T the median time of each path and the
    median of per-pair compiled/eager ratios. Steps at a finer grain than tok/s, for noisy
    machines: drift lands on both paths within a pair."""
    import time

    from ..engine.model.capture import capture_hidden
    from ..engine.decoders.rollback import Snapshot

    cache = lm.make_cache()
    with decode_path(lm, None):
        lm.hidden(mx.array([[i % 97 + 3 for i in range(context)]], dtype=mx.uint32), cache)
    mx.eval([c.state for c in cache])

    def once(T: int, use: bool) -> float:
        toks = mx.array([[5 + i for i in range(T)]], dtype=mx.uint32)
        snap = Snapshot.take(cache)
        with decode_path(lm, compiled if use else None):
            t = time.perf_counter()
            h = capture_hidden(lm, toks, cache, []) if (capture and T > 1) else lm.hidden(toks, cache)
            mx.eval(lm.logits(h), [c.state for c in cache])
            dt = time.perf_counter() - t
        snap.restore()
        return dt

    out: dict = {"context": context, "pairs": pairs, "capture": capture, "T": {}}
    for T in Ts:
        once(T, False), once(T, True)  # warm both (traces, kernel builds)
        e, c = [], []
        for i in range(pairs):
            for use in ((False, True) if i % 2 == 0 else (True, False)):
                (c if use else e).append(once(T, use))
        out["T"][T] = {"eager_s": statistics.median(e), "compiled_s": statistics.median(c),
                       "ratio": spread([b / a for a, b in zip(e, c)])}
    return out


def format_paired(res: dict) -> str:
    lines = [f"Forward + logits of T tokens at context {res['context']} ({'capturing' if res['capture'] else 'plain'} "
             f"verify for T > 1), {res['pairs']} interleaved pairs:", "",
             "| T | eager ms | compiled ms | compiled / eager per pair: median (min-max) |", "|---|---|---|---|"]
    for T, r in res["T"].items():
        q = r["ratio"]
        lines.append(f"| {T} | {1000 * r['eager_s']:.2f} | {1000 * r['compiled_s']:.2f} | "
                     f"{q['median']:.3f} ({q['min']:.3f}-{q['max']:.3f}) |")
    return "\n".join(lines)


def format_compile_ab(res: dict, title: str) -> str:
    lines = [f"## {title}", "",
             f"{res['rounds']} rounds (+1 warm-up), {res['prompts']} prompts x {res['tokens_per_prompt']} tokens, "
             "temperature 0, exact, interleaved ABAB/BABA; ratio = median of per-round compiled/eager.", "",
             "| arm | eager tok/s (min-max) | compiled tok/s (min-max) | compiled / eager (min-max) |",
             "|---|---|---|---|"]
    for base, ratio in res["ratio"].items():
        e, c = res["arms"][f"{base}/eager"]["tok_s"], res["arms"][f"{base}/compiled"]["tok_s"]
        lines.append(f"| {base} | {e['median']:.1f} ({e['min']:.1f}-{e['max']:.1f}) | "
                     f"{c['median']:.1f} ({c['min']:.1f}-{c['max']:.1f}) | "
                     f"{ratio['median']:.3f}x ({ratio['min']:.3f}-{ratio['max']:.3f}) |")
    lines += ["", "Tokens: " + ("compiled = eager in every round and arm." if not res["token_mismatches"]
                                else "**MISMATCH**: " + "; ".join(res["token_mismatches"]))]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="councild bench compile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model folder (default: the bundled model)")
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds (>= 5), after one warm-up")
    ap.add_argument("--tokens", type=int, default=48, help="tokens per prompt per arm")
    ap.add_argument("--prompts", type=int, default=3, help="how many of the fixed prompts")
    ap.add_argument("--depths", default="1", help="speculation depths to compare as well (comma list; 0 = none)")
    ap.add_argument("--pairs", type=int, default=30, help="interleaved eager/compiled forward pairs per T (1-5)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--markdown", help="also write the markdown table here")
    args = ap.parse_args(argv)
    if args.rounds < 5:
        print("councild bench compile: --rounds must be >= 5", file=sys.stderr)
        return 2
    for name in ("tokens", "prompts", "pairs"):
        if getattr(args, name) < 1:
            print(f"councild bench compile: --{name} must be >= 1", file=sys.stderr)
            return 2
    try:
        depths = [int(d) for d in args.depths.split(",") if d.strip()]
    except ValueError:
        print(f"councild bench compile: --depths wants a comma list of integers, got {args.depths!r}", file=sys.stderr)
        return 2

    from ..engine.model.loading import load_model
    from ..engine.model.mtp_head import NoMTPHead, load_mtp_head

    path = Path(args.model) if args.model else default_model_path()
    lm = load_model(path)
    if lm.compiled_decode is None:
        print(f"councild bench compile: nothing to compare, the decode path is {lm.decode_path}", file=sys.stderr)
        return 1
    head = None
    if any(depths):
        try:
            head = load_mtp_head(lm)
        except NoMTPHead as exc:
            print(f"councild bench compile: serial only ({exc})", file=sys.stderr)
    prompts = [lm.encode_prompt(p, None, None) for p in load_prompts()[: args.prompts]]
    progress = Progress("bench compile", 0)
    res = run_compile_ab(lm, head, prompts, depths, args.rounds, args.tokens,
                         log=lambda m: print(m, file=sys.stderr, flush=True), progress=progress)
    res["paired"] = paired_forward_times(lm, lm.compiled_decode, Ts=(1, 2, 3, 4, 5), pairs=args.pairs)
    res["model"] = str(path)
    res["machine"] = {"platform": platform.platform(), "device": str(mx.default_device()), "mlx": mx.__version__}
    res["command"] = "councild bench compile " + " ".join(argv if argv is not None else sys.argv[1:])
    md = format_compile_ab(res, f"compiled vs eager decode: {path.name}, {res['machine']['device']}") \
        + "\n\n" + format_paired(res["paired"])
    progress.finish(f"{len(res['arms'])} arms x {args.rounds} rounds")
    print(md)
    write_results(res, md, args.json, args.markdown)
    return 1 if res["token_mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
