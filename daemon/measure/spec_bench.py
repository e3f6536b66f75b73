"""Speculation benchmark: serial vs speculative at each depth, interleaved.

``councild bench spec [--model PATH] [--rounds N] [--tokens N] [--json OUT]``

- Arms: serial, and speculative at depths 1..4 under each rollback strategy (capture,
  snapshot). Every round runs every arm once over the same fixed prompts; the order is
  reversed on alternate rounds (ABAB / BABA) so slow drift (thermal, other processes on the
  box) lands on both sides. One warm-up round is run and discarded.
- Reported per arm: tokens/s median and spread (min, max, IQR) over rounds; speedup as the
  median of per-round ratios against that round's serial run; acceptance per draft
  position (unconditional, and conditional on the previous position being accepted);
  mean committed tokens per cycle; guarded positions.
- Verify cost: a base forward of k+1 tokens vs one serial (1-token) step at the same
  context, for the plain forward and for the capturing forward, medians of repeated runs.
- Rollback: which strategy won, per depth and overall, by how much.

``--head copy`` swaps in the synthetic copy head (mtp_head.copy_head_tensors) so that a
random model's acceptance is high and every accept length is exercised; its acceptance
says nothing about real heads. The default is the checkpoint's own head.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

from .bench_io import spread, write_results
from .fidelity import default_model_path, load_prompts
from ..engine.model import LoadedModel
from ..engine.forward import capture_hidden
from ..engine.rollback import STRATEGIES, Snapshot
from ..engine.sampling import Sampler
from ..engine.serial import serial_decode
from ..engine.speculative import speculative_decode
from ..engine.types import DEFAULT_GUARD, SamplingParams


def run_arm(lm, head, prompts, tokens, depth, strategy, exact, guard_margin=DEFAULT_GUARD) -> dict:
    produced = 0
    cycles = 0
    guarded = 0
    mask_counts: list[int] = [0] * max(depth, 0)
    cond_den: list[int] = [0] * max(depth, 0)
    t0, c0 = time.perf_counter(), time.process_time()
    for prompt in prompts:
        sampler = Sampler(SamplingParams())
        if depth == 0:
            gen = serial_decode(lm, prompt, sampler)
        else:
            gen = speculative_decode(lm, head, prompt, sampler, depth, exact=exact, rollback=strategy,
                                     guard_margin=guard_margin)
        got = 0
        for step in gen:
            got += len(step.tokens)
            cycles += 1
            guarded += step.guarded
            if step.drafted:
                prev = True
                for i, ok in enumerate(step.accepted_mask):
                    if prev:
                        cond_den[i] += 1
                    mask_counts[i] += ok
                    prev = prev and ok
            if got >= tokens:
                break
        gen.close()
        produced += tokens
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "tok_s": produced / dt,
        # Tokens per CPU second of this process (all its threads): on a shared machine the
        # wall clock also counts the time other processes held the cores; CPU time does not.
        "tok_per_cpu_s": produced / cpu if cpu > 0 else 0.0,
        "cpu_s": cpu,
        "seconds": dt,
        "tokens": produced,
        "cycles": cycles,
        "guarded": guarded,
        "accepted_by_position": mask_counts,
        "cond_denominator": cond_den,
    }


def median_time(fn, reps: int) -> float:
    fn()  # warm
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def verify_cost(lm: LoadedModel, depths, context: int = 64, reps: int = 15) -> dict:
    """Median time of a base forward (+ logits) of k+1 tokens vs 1 token, same context."""
    cache = lm.make_cache()
    lm.hidden(mx.array([[i % 97 + 3 for i in range(context)]]), cache)
    mx.eval([c.state for c in cache])

    def fwd(T: int, capture: bool):
        def run():
            snap = Snapshot.take(cache)
            toks = mx.array([[5 + i for i in range(T)]])
            h = capture_hidden(lm, toks, cache, []) if capture else lm.hidden(toks, cache)
            out = lm.logits(h)
            mx.eval(out, [c.state for c in cache])
            snap.restore()

        return run

    one = median_time(fwd(1, False), reps)
    out = {"context": context, "serial_step_s": one, "plain": {}, "capture": {}}
    for k in depths:
        out["plain"][k] = median_time(fwd(k + 1, False), reps) / one
        out["capture"][k] = median_time(fwd(k + 1, True), reps) / one
    return out


def run_bench(lm, head, prompts, depths=(1, 2, 3, 4), rounds=5, tokens=48, strategies=STRATEGIES, exact=True, log=print,
              guards: dict[str, float | None] | None = None) -> dict:
    """``guards``: label -> exact mode's guard margin (None: no guard). One variant (the
    default: the configured guard) keeps the arm names "strategy/dk"; several give every
    speculative arm once per variant, "strategy/dk/label", interleaved like the rest."""
    guards = guards or {"": DEFAULT_GUARD}
    arms = [("serial", 0, None, None)] + [
        (f"{s}/d{k}" + (f"/{g}" if len(guards) > 1 else ""), k, s, m)
        for k in depths for s in strategies for g, m in guards.items()
    ]  # fmt: skip
    raw: dict[str, list[dict]] = {name: [] for name, *_ in arms}
    for r in range(rounds + 1):  # round 0 is the warm-up
        order = arms if r % 2 == 0 else list(reversed(arms))
        for name, k, s, m in order:
            res = run_arm(lm, head, prompts, tokens, k, s, exact, m)
            if r > 0:
                raw[name].append(res)
        if r > 0:
            log(f"round {r}/{rounds}: " + ", ".join(f"{n} {raw[n][-1]['tok_s']:.0f}" for n, *_ in arms))
    result = {"arms": {}, "rounds": rounds, "tokens_per_prompt": tokens, "prompts": len(prompts), "exact": exact,
              "guards": guards}
    serial_tps = [x["tok_s"] for x in raw["serial"]]
    for name, k, s, _ in arms:
        runs = raw[name]
        tps = [x["tok_s"] for x in runs]
        arm = {"depth": k, "strategy": s, "tok_s": spread(tps), "raw_tok_s": tps,
               "tok_per_cpu_s": spread([x["tok_per_cpu_s"] for x in runs])}
        arm["speedup"] = spread([a / b for a, b in zip(tps, serial_tps)])
        if k:
            acc = [sum(x["accepted_by_position"][i] for x in runs) for i in range(k)]
            den = [sum(x["cond_denominator"][i] for x in runs) for i in range(k)]
            cyc = sum(x["cycles"] for x in runs)
            arm["acceptance_by_position"] = [a / max(1, cyc) for a in acc]
            arm["conditional_acceptance"] = [a / max(1, d) for a, d in zip(acc, den)]
            arm["tokens_per_cycle"] = sum(x["tokens"] for x in runs) / max(1, cyc)
            arm["guarded_per_cycle"] = sum(x["guarded"] for x in runs) / max(1, cyc)
        result["arms"][name] = arm
    if len(guards) == 2:
        # The guard before/after: per round, the second variant's tok/s over the first's.
        (ga, _), (gb, _) = guards.items()
        per = {}
        for k in depths:
            for s in strategies:
                ra = [x["tok_s"] for x in raw[f"{s}/d{k}/{ga}"]]
                rb = [x["tok_s"] for x in raw[f"{s}/d{k}/{gb}"]]
                ca = [x["tok_per_cpu_s"] for x in raw[f"{s}/d{k}/{ga}"]]
                cb = [x["tok_per_cpu_s"] for x in raw[f"{s}/d{k}/{gb}"]]
                per[f"{s}/d{k}"] = {"wall": spread([y / x for x, y in zip(ra, rb)]),
                                    "cpu": spread([y / x for x, y in zip(ca, cb)])}
        result["guard_ab"] = {"ratio": f"{gb}/{ga} tokens per wall second and per CPU second (paired per round)",
                              "per_arm": per}
    # Rollback: which strategy won (paired per round and depth).
    if len(strategies) == 2 and len(guards) == 1:
        a, b = strategies
        per_depth = {}
        ratios_all = []
        for k in depths:
            ra = [x["tok_s"] for x in raw[f"{a}/d{k}"]]
            rb = [x["tok_s"] for x in raw[f"{b}/d{k}"]]
            ratios = [x / y for x, y in zip(ra, rb)]
            ratios_all += ratios
            per_depth[k] = statistics.median(ratios)
        overall = statistics.median(ratios_all)
        result["rollback"] = {
            "ratio": f"{a}/{b} tokens/s",
            "per_depth": per_depth,
            "overall": overall,
            "winner": a if overall >= 1.0 else b,
            "margin": overall - 1.0 if overall >= 1.0 else 1.0 / overall - 1.0,
        }
    return result


def format_bench(res: dict, title: str) -> str:
    lines = [f"## {title}", ""]
    lines.append(f"{res['rounds']} rounds (+1 warm-up), {res['prompts']} prompts x {res['tokens_per_prompt']} tokens, "
                 f"temperature 0, {'exact' if res['exact'] else 'fast'} mode, interleaved ABAB/BABA; guard "
                 + ", ".join(f"{g or 'all'}: {'off' if m is None else f'{m:g}'}" for g, m in res.get("guards", {}).items()) + ".")
    lines += ["", "| arm | tok/s median | min-max | IQR | speedup vs serial (median) | tok per CPU s (median, min-max) | tokens/cycle | acceptance by position | conditional | guarded/cycle |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for name, a in res["arms"].items():
        t = a["tok_s"]
        acc = " ".join(f"{x:.2f}" for x in a.get("acceptance_by_position", [])) or "-"
        cond = " ".join(f"{x:.2f}" for x in a.get("conditional_acceptance", [])) or "-"
        lines.append(
            f"| {name} | {t['median']:.1f} | {t['min']:.1f}-{t['max']:.1f} | {t['iqr']:.1f} | {a['speedup']['median']:.3f}x | "
            + (f"{a['tok_per_cpu_s']['median']:.1f} ({a['tok_per_cpu_s']['min']:.1f}-{a['tok_per_cpu_s']['max']:.1f}) | "
               if "tok_per_cpu_s" in a else "- | ")
            + f"{a.get('tokens_per_cycle', 1.0):.2f} | {acc} | {cond} | {a.get('guarded_per_cycle', 0.0):.3f} |"
        )
    if "verify_cost" in res:
        vc = res["verify_cost"]
        lines += ["", f"Verify cost (forward of k+1 tokens / one serial step, context {vc['context']}, "
                      f"serial step {1000 * vc['serial_step_s']:.2f} ms):", "",
                  "| depth k | plain forward | capturing forward |", "|---|---|---|"]
        for k in vc["plain"]:
            lines.append(f"| {k} | {vc['plain'][k]:.2f}x | {vc['capture'][k]:.2f}x |")
    if "guard_ab" in res:
        ga = res["guard_ab"]
        lines += ["", f"Guard before/after: {ga['ratio']}:", "",
                  "| arm | wall median | wall min-max | CPU median | CPU min-max |", "|---|---|---|---|---|"]
        for name, v in ga["per_arm"].items():
            w, c = v["wall"], v["cpu"]
            lines.append(f"| {name} | {w['median']:.3f} | {w['min']:.3f}-{w['max']:.3f} | {c['median']:.3f} | "
                         f"{c['min']:.3f}-{c['max']:.3f} |")
    if "rollback" in res:
        rb = res["rollback"]
        per = ", ".join(f"d{k}: {v:.3f}" for k, v in rb["per_depth"].items())
        lines += ["", f"Rollback: {rb['ratio']} = {rb['overall']:.3f} overall ({per}); "
                      f"winner **{rb['winner']}** by {100 * rb['margin']:.1f}%."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="councild bench spec", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model folder (default: the bundled model, else the random one)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=48, help="tokens per prompt per arm")
    ap.add_argument("--prompts", type=int, default=3, help="how many of the fixed prompts")
    ap.add_argument("--depths", default="1,2,3,4")
    ap.add_argument("--head", choices=("native", "copy"), default="native")
    ap.add_argument("--mode", choices=("exact", "fast"), default="exact")
    ap.add_argument("--rollbacks", default=",".join(STRATEGIES), help="rollback strategies to compare")
    ap.add_argument("--guard", choices=("probe", "on", "off", "ab"), default="probe",
                    help="exact mode's near-tie guard: probe (default) = as the daemon runs it (off where the "
                         "start-up probe finds verify bit-identical to serial steps); on; off; ab = guarded and "
                         "the probe's choice as two interleaved arms per depth (the guard change before/after)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--markdown", help="also write the markdown table here")
    args = ap.parse_args(argv)
    if args.rounds < 5:
        print("councild bench spec: --rounds must be >= 5", file=sys.stderr)
        return 2

    from ..engine.loading import load_model
    from ..engine.mtp_head import NoMTPHead, copy_head_tensors, load_mtp_head

    path = Path(args.model) if args.model else default_model_path()
    lm = load_model(path)
    try:
        if args.head == "copy":
            tmp = Path(tempfile.mkdtemp(prefix="copyhead-"))
            text_cfg = lm.config.get("text_config", lm.config)
            mx.save_safetensors(str(tmp / "mtp.safetensors"), copy_head_tensors(text_cfg), metadata={"format": "pt"})
            head = load_mtp_head(lm, folder=tmp)
        else:
            head = load_mtp_head(lm)
    except NoMTPHead as exc:
        print(f"councild bench spec: {exc}", file=sys.stderr)
        return 1
    depths = [int(d) for d in args.depths.split(",")]
    prompts = [lm.encode_prompt(p, None, None) for p in load_prompts()[: args.prompts]]
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    from ..engine.exactness import exact_guard

    strategies = tuple(args.rollbacks.split(","))
    probed = {s: exact_guard(lm, s, DEFAULT_GUARD) for s in strategies}
    if args.guard == "ab" and len(set(probed.values())) != 1:
        print("councild bench spec: --guard ab needs one probe verdict for every rollback compared", file=sys.stderr)
        return 2
    guards = {"on": {"": DEFAULT_GUARD}, "off": {"": None}, "probe": {"": probed[strategies[0]]},
              "ab": {"guard": DEFAULT_GUARD, "probe": probed[strategies[0]]}}[args.guard]
    if args.guard == "probe" and len(set(probed.values())) != 1:
        guards = {"": DEFAULT_GUARD}  # the strategies disagree: keep the guard for all (safe)
    res = run_bench(lm, head, prompts, depths, args.rounds, args.tokens, strategies=strategies,
                    exact=args.mode == "exact", log=log, guards=guards)
    res["guard_probe"] = {s: ("off: verify bit-identical" if g is None else g) for s, g in probed.items()}
    res["verify_cost"] = verify_cost(lm, depths)
    res["model"] = str(path)
    res["head"] = args.head
    res["machine"] = {"platform": platform.platform(), "device": str(mx.default_device()), "mlx": mx.__version__}
    res["command"] = "councild bench spec " + " ".join(argv or sys.argv[1:])
    title = f"spec bench: {path.name}, head={args.head}, {res['machine']['device']}"
    md = format_bench(res, title)
    print(md)
    write_results(res, md, args.json, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
