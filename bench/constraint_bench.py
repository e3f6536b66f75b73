"""Constrained vs unconstrained decode (daemon/engine/decoders/constraint.py), interleaved.

    .venv/bin/python bench/constraint_bench.py                      # bundled model, every path
    .venv/bin/python bench/constraint_bench.py --rounds 5 --tokens 128

For each decode path (serial; exact speculation at depths 1 and 2; fast at depth 2; sampled
T=0.8 at depth 2; speculation with prompt lookup on, as the daemon runs it) and each
constraint, one round runs the unconstrained request, then the same request under the
constraint (A B A B ...), ``--tokens`` tokens each, prefill outside the timed region. Per
round the ratio constrained / unconstrained tok/s, by wall time and by this process's CPU
time (on a box shared with other jobs every host sync can cost a scheduler slice, which wall
time charges to the side that syncs more; CPU time counts the work done); the table gives
the median and range over rounds, acceptance (accepted / drafted) of both, and the constraint's host time per token
(the matcher's mask computation, TokenConstraint.mask_s / tokens).

The constraints never end within ``--tokens`` (a JSON array of at least 64 objects; a Lark
grammar of assignment lines), so both sides decode the same number of tokens. Under those
two the constrained output differs from the unconstrained one (the grammar steers the text),
so their acceptances are of different texts: that comparison says what a client pays for
asking for structure. ``permissive`` (any text) decodes the same tokens as the unconstrained
run: its ratio is the mask machinery's own cost.
Prints markdown; writes JSON (default bench/results/constraint_cpu.json).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from daemon.engine.decoders.constraint import compile_constraint  # noqa: E402
from daemon.engine.model.loading import load_model  # noqa: E402
from daemon.engine.decoders.lookup import LookupConfig  # noqa: E402
from daemon.engine.model.mtp_head import load_mtp_head  # noqa: E402
from daemon.engine.decoders.sampling import Sampler  # noqa: E402
from daemon.engine.decoders.serial import serial_decode  # noqa: E402
from daemon.engine.decoders.speculative import speculative_decode  # noqa: E402
from daemon.engine.types import SamplingParams  # noqa: E402
from daemon.paths import BUNDLED_MODEL  # noqa: E402

ITEM = {"type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "color": {"enum": ["red", "green", "blue"]}},
        "required": ["name", "age", "color"], "additionalProperties": False}
CONSTRAINTS = {
    # Allows any text (special tokens but EOS aside): the constrained run decodes the very
    # tokens the unconstrained one does, so its ratio is the constraint's pure overhead
    # (matcher, masks, one host read per draft) at equal acceptance.
    "permissive": ("regex", r"[\s\S]*"),
    "json_schema": ("json_schema", json.dumps({"type": "array", "items": ITEM, "minItems": 64})),
    "lark": ("lark", 'start: line+\nline: NAME " = " NUM "\\n"\nNAME: /[a-z_]{1,8}/\nNUM: /[0-9]{1,4}/'),
}
# (name, speculation mode or None for serial, depth, temperature)
PATHS = [("serial", None, 0, 0.0), ("exact d1", "exact", 1, 0.0), ("exact d2", "exact", 2, 0.0),
         ("fast d2", "fast", 2, 0.0), ("sampled d2 T=0.8", "exact", 2, 0.8)]
PROMPT = "def fibonacci(n):\n"


def run_once(lm, head, prompt, path, n, constraint):
    _, mode, depth, temperature = path
    c = compile_constraint(lm, *constraint) if constraint else None
    sampler = Sampler(SamplingParams(temperature=temperature, seed=11), prompt, constraint=c)
    if mode is None:
        gen = serial_decode(lm, prompt, sampler)
    else:
        gen = speculative_decode(lm, head, prompt, sampler, depth, exact=mode == "exact", guard_margin=None,
                                 lookup=LookupConfig())
    out, drafted, accepted = [], 0, 0
    first = next(gen)  # prefill and the first token: outside the timed region
    out += first.tokens
    t0, cpu0 = time.perf_counter(), time.process_time()
    mask_s0 = c.mask_s if c else 0.0
    for step in gen:
        out += step.tokens
        drafted += step.drafted
        accepted += step.accepted
        if len(out) >= n:
            break
    dt, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    gen.close()
    timed = len(out) - len(first.tokens)
    return {"tokens": timed, "seconds": dt, "tok_s": timed / dt, "cpu_s": cpu, "cpu_tok_s": timed / cpu, "drafted": drafted, "accepted": accepted,
            "mask_s_per_token": ((c.mask_s - mask_s0) / timed) if c else 0.0,
            "eos": sum(t in lm.eos_token_ids for t in out)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(BUNDLED_MODEL))
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--constraints", default=",".join(CONSTRAINTS))
    ap.add_argument("--json", default=str(ROOT / "bench/results/constraint_cpu.json"))
    args = ap.parse_args(argv)
    lm = load_model(args.model)
    head = load_mtp_head(lm)
    prompt = lm.encode_prompt(PROMPT, None, None)
    kinds = [k for k in args.constraints.split(",") if k]
    for path in PATHS:  # warm-up: compile, caches
        run_once(lm, head, prompt, path, 16, None)
        run_once(lm, head, prompt, path, 16, CONSTRAINTS[kinds[0]])
    raw: dict = {}
    for r in range(args.rounds):
        for path in PATHS:
            for kind in kinds:
                base = run_once(lm, head, prompt, path, args.tokens, None)
                con = run_once(lm, head, prompt, path, args.tokens, CONSTRAINTS[kind])
                raw.setdefault(f"{path[0]} | {kind}", []).append({"unconstrained": base, "constrained": con})
                print(f"round {r} {path[0]} {kind}: {base['tok_s']:.1f} vs {con['tok_s']:.1f} tok/s", file=sys.stderr)
    rows = []
    for key, runs in raw.items():
        ratios = [x["constrained"]["tok_s"] / x["unconstrained"]["tok_s"] for x in runs]
        cpu_ratios = [x["constrained"]["cpu_tok_s"] / x["unconstrained"]["cpu_tok_s"] for x in runs]

        def acc(side):
            d = sum(x[side]["drafted"] for x in runs)
            return sum(x[side]["accepted"] for x in runs) / d if d else None

        rows.append({
            "arm": key,
            "unconstrained_tok_s": statistics.median(x["unconstrained"]["tok_s"] for x in runs),
            "constrained_tok_s": statistics.median(x["constrained"]["tok_s"] for x in runs),
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "cpu_ratio_median": statistics.median(cpu_ratios), "cpu_ratio_min": min(cpu_ratios),
            "cpu_ratio_max": max(cpu_ratios),
            "acceptance_unconstrained": acc("unconstrained"), "acceptance_constrained": acc("constrained"),
            "mask_us_per_token": 1e6 * statistics.median(x["constrained"]["mask_s_per_token"] for x in runs),
            "constrained_eos_tokens": max(x["constrained"]["eos"] for x in runs),
        })
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    print(f"constrained vs unconstrained, {args.tokens} tokens per run, {args.rounds} rounds interleaved, "
          f"{platform.machine()} CPU, model {Path(args.model).name}\n")
    print("| path \\| constraint | unconstrained tok/s | constrained tok/s | ratio median (min-max) | "
          "CPU-time ratio median (min-max) | acceptance unconstrained | acceptance constrained | mask µs/token |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['arm']} | {row['unconstrained_tok_s']:.1f} | {row['constrained_tok_s']:.1f} | "
              f"{row['ratio_median']:.3f} ({row['ratio_min']:.3f}-{row['ratio_max']:.3f}) | "
              f"{row['cpu_ratio_median']:.3f} ({row['cpu_ratio_min']:.3f}-{row['cpu_ratio_max']:.3f}) | "
              f"{fmt(row['acceptance_unconstrained'])} | {fmt(row['acceptance_constrained'])} | "
              f"{row['mask_us_per_token']:.0f} |")
    out = {"model": str(args.model), "machine": platform.machine(), "tokens": args.tokens, "rounds": args.rounds,
           "command": "bench/constraint_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "constraints": {k: CONSTRAINTS[k] for k in kinds}, "rows": rows, "raw": raw}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
