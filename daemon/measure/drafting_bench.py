"""Drafting benchmark: MTP head only vs + prompt lookup vs per-request depth, against serial.

``councild bench drafting [--model PATH] [--rounds N] [--tokens N] [--prompts N] [--json OUT]``

Two prompt sets: prompts that quote their context (measure/quoting_prompts.json: edit a given
function, continue a listed table), where the output copies context and prompt-lookup
blocks fire, and the fixed fidelity prompts, which do not quote. Arms (temperature 0):

- ``serial``: serial_decode;
- ``mtp/d1``: the head at depth 1 (what the governor picks on most machines today);
- ``lookup/d0``: prompt-lookup blocks only, serial steps elsewhere (no head drafts);
- ``mtp+lookup/d1``: the head at depth 1 and lookup blocks where they match;
- ``adaptive/c3``: lookup, and the head under a ceiling of 3 with the per-request early stop;
each speculative arm in exact and in fast mode. Every round runs every arm once over both
sets; the order is reversed on alternate rounds (ABAB / BABA); one warm-up round is run
and discarded. Speed is decode speed: each prompt's prefill and first cycle are off the
clock (the prefill is the same for every arm and dominates a long quoting prompt). Reported
per arm and set: tokens/s median and spread over rounds, the
median of per-round ratios to that round's serial run, tokens per cycle, and the share of
cycles that verified a lookup block with its acceptance.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import mlx.core as mx

from ..engine.decoders.lookup import DraftStopConfig, LookupConfig
from ..engine.decoders.sampling import Sampler
from ..engine.decoders.serial import serial_decode
from ..engine.decoders.speculative import speculative_decode
from ..engine.types import SamplingParams
from .bench_io import spread, write_results
from .progress import Progress, Quiet
from .fidelity import default_model_path, load_prompts, load_quoting_prompts

# name -> (depth ceiling, options); None: serial_decode
ARMS: dict[str, tuple[int, dict] | None] = {
    "serial": None,
    "mtp/d1": (1, {}),
    "lookup/d0": (0, {"lookup": LookupConfig()}),
    "mtp+lookup/d1": (1, {"lookup": LookupConfig()}),
    "adaptive/c3": (3, {"lookup": LookupConfig(), "draft_stop": DraftStopConfig()}),
}


def run_arm(lm, head, prompts, tokens: int, arm: tuple[int, dict] | None, exact: bool) -> dict:
    """Decode speed after the first cycle: the prefill (the same for every arm, and most of
    the time on a long quoting prompt) and the first cycle are left out of the clock."""
    produced = cycles = lookup_cycles = lookup_drafted = lookup_accepted = drafted = accepted = 0
    dt = cpu = 0.0
    for prompt in prompts:
        sampler = Sampler(SamplingParams())
        if arm is None:
            gen = serial_decode(lm, prompt, sampler)
        else:
            depth, options = arm
            gen = speculative_decode(lm, head, prompt, sampler, depth, exact=exact, **options)
        got = 0
        first = True
        for step in gen:
            if first:  # prefill + first cycle: off the clock
                first = False
                t0, c0, skipped = time.perf_counter(), time.process_time(), len(step.tokens)
                got += len(step.tokens)
                continue
            got += len(step.tokens)
            cycles += 1
            drafted += step.drafted
            accepted += step.accepted
            if step.draft_source == "lookup":
                lookup_cycles += 1
                lookup_drafted += step.drafted
                lookup_accepted += step.accepted
            if got >= tokens:
                break
        dt += time.perf_counter() - t0
        cpu += time.process_time() - c0
        gen.close()
        produced += got - skipped
    return {"tok_s": produced / dt, "cpu_tok_s": produced / max(cpu, 1e-9), "tokens": produced, "cycles": cycles, "drafted": drafted, "accepted": accepted,
            "lookup_cycles": lookup_cycles, "lookup_drafted": lookup_drafted, "lookup_accepted": lookup_accepted}


def run_bench(lm, head, sets: dict[str, list[list[int]]], rounds: int = 5, tokens: int = 64,
              modes=("exact", "fast"), log=print, progress: Progress | None = None) -> dict:
    arms = [("serial", None, True)] + [
        (f"{name} {mode}", spec, mode == "exact") for name, spec in ARMS.items() if spec is not None for mode in modes
    ]
    cells = [(set_name, arm) for set_name in sets for arm in arms]
    raw: dict[tuple[str, str], list[dict]] = {(s, a[0]): [] for s, a in cells}
    progress = progress or Quiet()
    progress.add((rounds + 1) * len(cells))
    for r in range(rounds + 1):  # round 0 is the warm-up
        order = cells if r % 2 == 0 else list(reversed(cells))
        for set_name, (name, spec, exact) in order:
            progress.step(f"round {r}/{rounds}{' (warm-up)' if r == 0 else ''}, {set_name} prompts, arm {name}")
            res = run_arm(lm, head, sets[set_name], tokens, spec, exact)
            if r > 0:
                raw[(set_name, name)].append(res)
        if r > 0:
            log(f"round {r}/{rounds}: " + ", ".join(
                f"{s}:{n} {raw[(s, n)][-1]['tok_s']:.0f}" for s, (n, _, _) in cells))
    out: dict = {"rounds": rounds, "tokens_per_prompt": tokens, "sets": {}}
    for set_name in sets:
        serial_tps = [x["tok_s"] for x in raw[(set_name, "serial")]]
        table = {}
        for name, _, _ in arms:
            runs = raw[(set_name, name)]
            tps = [x["tok_s"] for x in runs]
            tot = {k: sum(x[k] for x in runs) for k in runs[0] if k not in ("tok_s", "cpu_tok_s")}
            cpu = [x["cpu_tok_s"] for x in runs]
            serial_cpu = [x["cpu_tok_s"] for x in raw[(set_name, "serial")]]
            table[name] = {
                "tok_s": spread(tps), "raw_tok_s": tps,
                "ratio_to_serial": spread([a / b for a, b in zip(tps, serial_tps)]),
                # Tokens per CPU second of this process: on a box other work loads, the wall
                # clock measures the neighbours too; CPU time mostly measures the work.
                "cpu_tok_s": spread(cpu),
                "cpu_ratio_to_serial": spread([a / b for a, b in zip(cpu, serial_cpu)]),
                "tokens_per_cycle": tot["tokens"] / max(1, tot["cycles"]),
                "acceptance": tot["accepted"] / max(1, tot["drafted"]),
                "lookup_cycle_share": tot["lookup_cycles"] / max(1, tot["cycles"]),
                "lookup_acceptance": tot["lookup_accepted"] / max(1, tot["lookup_drafted"]),
                "lookup_tokens_per_cycle": (tot["lookup_accepted"] + tot["lookup_cycles"]) / max(1, tot["lookup_cycles"]),
            }
        out["sets"][set_name] = {"prompts": len(sets[set_name]), "arms": table}
    return out


def format_bench(res: dict, title: str) -> str:
    lines = [f"## {title}", "",
             f"{res['rounds']} rounds (+1 warm-up), {res['tokens_per_prompt']} tokens per prompt, temperature 0, "
             "interleaved ABAB/BABA over arms and prompt sets."]
    for set_name, s in res["sets"].items():
        lines += ["", f"### {set_name} prompts ({s['prompts']})", "",
                  "| arm | tok/s median | min-max | ratio to serial (median) | ratio min-max | CPU-time ratio (median, min-max) | tokens/cycle | acceptance | lookup cycles | lookup acceptance | tokens per lookup cycle |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for name, a in s["arms"].items():
            t, r, c = a["tok_s"], a["ratio_to_serial"], a["cpu_ratio_to_serial"]
            lk = a["lookup_cycle_share"]
            cr = f"{c['median']:.3f}x ({c['min']:.2f}-{c['max']:.2f})"
            lines.append(
                f"| {name} | {t['median']:.1f} | {t['min']:.1f}-{t['max']:.1f} | {r['median']:.3f}x | "
                f"{r['min']:.2f}-{r['max']:.2f} | {cr} | {a['tokens_per_cycle']:.2f} | {a['acceptance']:.2f} | "
                f"{100 * lk:.0f}% | {a['lookup_acceptance']:.2f} | {a['lookup_tokens_per_cycle']:.2f} |"
                if lk else
                f"| {name} | {t['median']:.1f} | {t['min']:.1f}-{t['max']:.1f} | {r['median']:.3f}x | "
                f"{r['min']:.2f}-{r['max']:.2f} | {cr} | {a['tokens_per_cycle']:.2f} | {a['acceptance']:.2f} | - | - | - |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="councild bench drafting", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model folder (default: the bundled model, else the random one)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64, help="tokens per prompt per arm")
    ap.add_argument("--prompts", type=int, default=3, help="prompts per set")
    ap.add_argument("--modes", default="exact,fast")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--markdown", help="also write the markdown table here")
    args = ap.parse_args(argv)
    if args.rounds < 3:
        print("councild bench drafting: --rounds must be >= 3", file=sys.stderr)
        return 2

    from ..engine.model.loading import load_model
    from ..engine.model.mtp_head import NoMTPHead, load_mtp_head

    path = Path(args.model) if args.model else default_model_path()
    lm = load_model(path)
    try:
        head = load_mtp_head(lm)
    except NoMTPHead as exc:
        print(f"councild bench drafting: {exc}", file=sys.stderr)
        return 1
    enc = lambda texts: [lm.encode_prompt(p, None, None) for p in texts[: args.prompts]]  # noqa: E731
    sets = {"quoting": enc(load_quoting_prompts()), "plain": enc(load_prompts())}
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    progress = Progress("bench drafting", 0)
    res = run_bench(lm, head, sets, args.rounds, args.tokens, tuple(args.modes.split(",")), log=log, progress=progress)
    res["model"] = str(path)
    res["decode_path"] = lm.decode_path
    res["machine"] = {"platform": platform.platform(), "device": str(mx.default_device()), "mlx": mx.__version__}
    res["command"] = "councild bench drafting " + " ".join(argv if argv is not None else sys.argv[1:])
    title = f"drafting bench: {path.name}, {res['machine']['device']}"
    md = format_bench(res, title)
    progress.finish(f"{len(res['sets'])} prompt sets x {args.rounds} rounds")
    print(md)
    write_results(res, md, args.json, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
