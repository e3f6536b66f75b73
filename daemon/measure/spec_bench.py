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
from .progress import Progress, Quiet
from .fidelity import default_model_path, load_prompts
from ..engine.model.model import LoadedModel
from ..engine.model.capture import capture_hidden
from ..engine.decoders.rollback import STRATEGIES, Snapshot
from ..engine.decoders.sampling import Sampler
from ..engine.decoders.serial import serial_decode
from ..engine.decoders.speculative import speculative_decode
from ..engine.types import DEFAULT_GUARD, SamplingParams


def run_arm(lm, head, prompts, tokens, depth, strategy, exact, guard_margin=DEFAULT_GUARD, pipeline=True) -> dict:
    produced = 0
    cycles = 0
    guarded = 0
    mask_counts: list[int] = [0] * max(depth, 0)
    cond_den: list[int] = [0] * max(depth, 0)
    # Decode alone (from each prompt's first step on, so the prefill is left out): tokens,
    # cycles and seconds after the first step.
    dec_tokens, dec_cycles, dec_s = 0, 0, 0.0
    t0, c0 = time.perf_counter(), time.process_time()
    for prompt in prompts:
        sampler = Sampler(SamplingParams())
        if depth == 0:
            gen = serial_decode(lm, prompt, sampler)
        elif callable(pipeline):  # another speculative_decode (an earlier engine: load_engine_module)
            gen = pipeline(lm, head, prompt, sampler, depth, exact=exact, rollback=strategy, guard_margin=guard_margin)
        else:
            gen = speculative_decode(lm, head, prompt, sampler, depth, exact=exact, rollback=strategy,
                                     guard_margin=guard_margin, pipeline=pipeline)
        got = 0
        t_first = None
        for step in gen:
            got += len(step.tokens)
            cycles += 1
            guarded += step.guarded
            if t_first is None:
                t_first, first_tokens = time.perf_counter(), got
            else:
                dec_cycles += 1
            if step.drafted:
                prev = True
                for i, ok in enumerate(step.accepted_mask):
                    if prev:
                        cond_den[i] += 1
                    mask_counts[i] += ok
                    prev = prev and ok
            if got >= tokens:
                break
        dec_s += time.perf_counter() - t_first
        dec_tokens += got - first_tokens
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
        "decode_tok_s": dec_tokens / dec_s if dec_s > 0 else 0.0,
        "decode_cycle_s": dec_s / dec_cycles if dec_cycles else 0.0,
        "decode_tokens": dec_tokens,
        "decode_cycles": dec_cycles,
        "guarded": guarded,
        "accepted_by_position": mask_counts,
        "cond_denominator": cond_den,
    }


def load_engine_module(path: str, name: str = "speculative_before"):
    """An earlier version of daemon/engine/decoders/speculative.py (e.g. ``git show
    main:daemon/engine/decoders/speculative.py > FILE``) as a module of the decoders wing, so
    its relative imports resolve against the current engine (a version from before the engine
    stood in wings imports ``.model`` etc. and does not load); its speculative_decode can be
    passed as a ``pipelines`` value to run_bench (the before arm of a before/after)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"daemon.engine.decoders.{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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


def forward_costs(lm: LoadedModel, head, depths, context: int = 64, reps: int = 15) -> dict:
    """What a cycle's forwards cost on the device: a graph built first (untimed), then its
    evaluation timed (launch + run + sync), median of ``reps``. Per depth k: the capturing
    verify of k+1 tokens (the engine's default rollback) + logits; one serial step (T=1,
    plain) + logits; one head draft step (one pair) + logits + argmax. So a cycle at depth
    k costs at least verify[k] + k * draft of forward work, and a serial token step[1]."""
    cache = lm.make_cache()
    lm.hidden(mx.array([[i % 97 + 3 for i in range(context)]]), cache)
    mx.eval([c.state for c in cache])

    def timed(build) -> float:
        ts = []
        for r in range(reps + 1):
            snap = Snapshot.take(cache)
            out = build()
            t = time.perf_counter()
            mx.eval(out)
            if r:
                ts.append(time.perf_counter() - t)
            snap.restore()
        return statistics.median(ts)

    def fwd(T: int, capture: bool):
        def build():
            toks = mx.array([[5 + i for i in range(T)]])
            h = capture_hidden(lm, toks, cache, []) if capture else lm.hidden(toks, cache)
            return [mx.argmax(lm.logits(h), axis=-1)] + [c.state for c in cache]

        return build

    out = {"context": context, "step_s": timed(fwd(1, False)), "verify_s": {}}
    for k in depths:
        out["verify_s"][k] = timed(fwd(k + 1, True))
    if head is not None:
        hcache = head.make_cache()
        t0 = mx.array([[3, 4, 5, 6, 7, 8, 9, 10]], dtype=mx.uint32)
        h0 = lm.hidden(t0, lm.make_cache())  # a real final-normed hidden, in the model's dtype
        mx.eval(head(h0, t0, hcache), [c.state for c in hcache])
        ts = []
        for r in range(reps + 1):
            g = head(h0[:, -1:], t0[:, :1], hcache)
            d = mx.argmax(head.logits(g)[:, -1, :], axis=-1)
            t = time.perf_counter()
            mx.eval(d, [c.state for c in hcache])
            if r:
                ts.append(time.perf_counter() - t)
            for c in hcache:
                c.trim(1)
        out["draft_s"] = statistics.median(ts)
    else:
        out["draft_s"] = 0.0
    return out


def cycle_split(res: dict, costs: dict) -> dict:
    """Per arm: the measured decode time per cycle against the forwards it ran (``costs``:
    forward_costs), and the bound that cost model gives: E / (forward time per cycle)
    against the serial arm's measured time per token."""
    out = {}
    serial = res["arms"].get("serial")
    for name, arm in res["arms"].items():
        k = arm["depth"]
        cyc = arm["decode_cycle_s"]["median"]
        fw = costs["step_s"] if k == 0 else costs["verify_s"][k] + k * costs["draft_s"]
        row = {"cycle_ms": 1000 * cyc, "forwards_ms": 1000 * fw, "rest_ms": 1000 * (cyc - fw),
               "forwards_share": fw / cyc if cyc else 0.0}
        if k and serial is not None:
            tpc = arm["decode_tokens_per_cycle"]
            row["device_bound"] = tpc * costs["step_s"] / fw  # tokens per cycle / (cycle forwards in steps)
            row["device_bound_vs_serial_measured"] = tpc * serial["decode_cycle_s"]["median"] / fw
        out[name] = row
    return out


def run_bench(lm, head, prompts, depths=(1, 2, 3, 4), rounds=5, tokens=48, strategies=STRATEGIES, exact=True, log=print,
              guards: dict[str, float | None] | None = None, pipelines: dict[str, bool] | None = None,
              progress: Progress | None = None) -> dict:
    """``guards``: label -> exact mode's guard margin (None: no guard). One variant (the
    default: the configured guard) keeps the arm names "strategy/dk"; several give every
    speculative arm once per variant, "strategy/dk/label", interleaved like the rest.
    ``pipelines``: label -> speculative_decode's ``pipeline``, or another speculative_decode
    (load_engine_module), likewise (e.g. before/after)."""
    guards = guards or {"": DEFAULT_GUARD}
    pipelines = pipelines or {"": True}
    if len(guards) > 1 and len(pipelines) > 1:
        raise ValueError("compare guards or pipelines, not both at once")
    arms = [("serial", 0, None, None, True)] + [
        (f"{s}/d{k}" + (f"/{g}" if len(guards) > 1 else "") + (f"/{pl}" if len(pipelines) > 1 else ""), k, s, m, pv)
        for k in depths for s in strategies for g, m in guards.items() for pl, pv in pipelines.items()
    ]  # fmt: skip
    raw: dict[str, list[dict]] = {name: [] for name, *_ in arms}
    progress = progress or Quiet()
    progress.add((rounds + 1) * len(arms))
    for r in range(rounds + 1):  # round 0 is the warm-up
        order = arms if r % 2 == 0 else list(reversed(arms))
        for name, k, s, m, pv in order:
            progress.step(f"round {r}/{rounds}{' (warm-up)' if r == 0 else ''}, arm {name}, "
                          f"{len(prompts)} prompts x {tokens} tokens")
            res = run_arm(lm, head, prompts, tokens, k, s, exact, m, pipeline=pv)
            if r > 0:
                raw[name].append(res)
        if r > 0:
            log(f"round {r}/{rounds}: " + ", ".join(f"{n} {raw[n][-1]['tok_s']:.0f}" for n, *_ in arms))
    result = {"arms": {}, "rounds": rounds, "tokens_per_prompt": tokens, "prompts": len(prompts), "exact": exact,
              "guards": guards, "pipelines": pipelines}
    serial_tps = [x["tok_s"] for x in raw["serial"]]
    serial_dec = [x["decode_tok_s"] for x in raw["serial"]]
    for name, k, s, _, pv in arms:
        runs = raw[name]
        tps = [x["tok_s"] for x in runs]
        dec = [x["decode_tok_s"] for x in runs]
        arm = {"depth": k, "strategy": s, "pipeline": pv, "tok_s": spread(tps), "raw_tok_s": tps,
               "tok_per_cpu_s": spread([x["tok_per_cpu_s"] for x in runs]),
               "decode_tok_s": spread(dec), "decode_cycle_s": spread([x["decode_cycle_s"] for x in runs]),
               "decode_tokens_per_cycle": sum(x["decode_tokens"] for x in runs) / max(1, sum(x["decode_cycles"] for x in runs))}
        arm["speedup"] = spread([a / b for a, b in zip(tps, serial_tps)])
        # The same without the prefill (which both arms share, pulling ratios towards 1).
        arm["decode_speedup"] = spread([a / b for a, b in zip(dec, serial_dec)])
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
    if len(pipelines) >= 2:
        # Before/after: per round, each later variant's decode tok/s over the first's.
        pa, *later = pipelines
        per = {}
        for k in depths:
            for s in strategies:
                ra = [x["decode_tok_s"] for x in raw[f"{s}/d{k}/{pa}"]]
                for pb in later:
                    rb = [x["decode_tok_s"] for x in raw[f"{s}/d{k}/{pb}"]]
                    per[f"{s}/d{k}" + (f" {pb}" if len(later) > 1 else "")] = spread([y / x for x, y in zip(ra, rb)])
        result["pipeline_ab"] = {"ratio": f"{'|'.join(later)} / {pa} decode tokens per second (paired per round)",
                                 "per_arm": per}
    # Rollback: which strategy won (paired per round and depth).
    if len(strategies) == 2 and len(guards) == 1 and len(pipelines) == 1:
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
    lines += ["", "| arm | tok/s median | min-max | IQR | speedup vs serial (median) | decode-only speedup (median, min-max) | tok per CPU s (median, min-max) | tokens/cycle | acceptance by position | conditional | guarded/cycle |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, a in res["arms"].items():
        t = a["tok_s"]
        ds = a.get("decode_speedup")
        dsx = f"{ds['median']:.3f}x ({ds['min']:.2f}-{ds['max']:.2f}) | " if ds else "- | "
        acc = " ".join(f"{x:.2f}" for x in a.get("acceptance_by_position", [])) or "-"
        cond = " ".join(f"{x:.2f}" for x in a.get("conditional_acceptance", [])) or "-"
        lines.append(
            f"| {name} | {t['median']:.1f} | {t['min']:.1f}-{t['max']:.1f} | {t['iqr']:.1f} | {a['speedup']['median']:.3f}x | "
            + dsx + (f"{a['tok_per_cpu_s']['median']:.1f} ({a['tok_per_cpu_s']['min']:.1f}-{a['tok_per_cpu_s']['max']:.1f}) | "
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
    if "pipeline_ab" in res:
        pa = res["pipeline_ab"]
        lines += ["", f"Pipeline before/after: {pa['ratio']}:", "", "| arm | median | min-max | IQR |", "|---|---|---|---|"]
        for name, v in pa["per_arm"].items():
            lines.append(f"| {name} | {v['median']:.3f} | {v['min']:.3f}-{v['max']:.3f} | {v['iqr']:.3f} |")
    if "cycle_split" in res:
        fc = res["forward_costs"]
        lines += ["", f"Cycle time split (decode only, median per arm) against the forwards' device cost "
                      f"(prebuilt graph, evaluated and synced: step {1000 * fc['step_s']:.2f} ms, draft "
                      f"{1000 * fc['draft_s']:.2f} ms, capture verify T=k+1 "
                      + ", ".join(f"{1000 * v:.2f}" for v in fc["verify_s"].values()) + " ms); "
                      "device bound = tokens/cycle x step / cycle forwards:", "",
                  "| arm | cycle ms | forwards ms | rest ms | forwards share | device bound | decode speedup / device bound |",
                  "|---|---|---|---|---|---|---|"]
        for name, row in res["cycle_split"].items():
            a = res["arms"][name]
            b = row.get("device_bound")
            frac = f"{a['decode_speedup']['median'] / b:.3f}" if b else "-"
            lines.append(f"| {name} | {row['cycle_ms']:.2f} | {row['forwards_ms']:.2f} | {row['rest_ms']:.2f} | "
                         f"{100 * row['forwards_share']:.0f}% | {f'{b:.3f}x' if b else '-'} | {frac} |")
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
    ap.add_argument("--pipeline", choices=("on", "off", "ab", "abc"), default="on",
                    help="build each cycle's successor while the device runs it (on, the default), not (off), "
                         "or both as two interleaved arms per depth (ab: off = before, on = after); abc: three arms, "
                         "before (--before-engine, else off), off, on")
    ap.add_argument("--before-engine", help="with --pipeline ab: the before arm runs this earlier speculative.py "
                                            "(e.g. from git show main:daemon/engine/decoders/speculative.py) instead of pipeline off")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--markdown", help="also write the markdown table here")
    args = ap.parse_args(argv)
    if args.rounds < 5:
        print("councild bench spec: --rounds must be >= 5", file=sys.stderr)
        return 2

    from ..engine.model.loading import load_model
    from ..engine.model.mtp_head import NoMTPHead, copy_head_tensors, load_mtp_head

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
    from ..engine.decoders.exactness import exact_guard

    strategies = tuple(args.rollbacks.split(","))
    probed = {s: exact_guard(lm, s, DEFAULT_GUARD) for s in strategies}
    if args.guard == "ab" and len(set(probed.values())) != 1:
        print("councild bench spec: --guard ab needs one probe verdict for every rollback compared", file=sys.stderr)
        return 2
    guards = {"on": {"": DEFAULT_GUARD}, "off": {"": None}, "probe": {"": probed[strategies[0]]},
              "ab": {"guard": DEFAULT_GUARD, "probe": probed[strategies[0]]}}[args.guard]
    if args.guard == "probe" and len(set(probed.values())) != 1:
        guards = {"": DEFAULT_GUARD}  # the strategies disagree: keep the guard for all (safe)
    if args.pipeline in ("ab", "abc") and args.guard == "ab":
        print("councild bench spec: --pipeline ab and --guard ab cannot be combined", file=sys.stderr)
        return 2
    pipelines = {"on": {"": True}, "off": {"": False}, "ab": {"before": False, "after": True},
                 "abc": {"before": False, "off": False, "after": True}}[args.pipeline]
    if args.before_engine and args.pipeline in ("ab", "abc"):
        pipelines["before"] = load_engine_module(args.before_engine).speculative_decode
    res = run_bench(lm, head, prompts, depths, args.rounds, args.tokens, strategies=strategies,
                    exact=args.mode == "exact", log=log, guards=guards, pipelines=pipelines,
                    progress=(progress := Progress("bench spec", 0)))
    res["forward_costs"] = forward_costs(lm, head, depths)
    res["cycle_split"] = cycle_split(res, res["forward_costs"])
    res["guard_probe"] = {s: ("off: verify bit-identical" if g is None else g) for s, g in probed.items()}
    res["verify_cost"] = verify_cost(lm, depths)
    res["model"] = str(path)
    res["head"] = args.head
    res["machine"] = {"platform": platform.platform(), "device": str(mx.default_device()), "mlx": mx.__version__}
    res["command"] = "councild bench spec " + " ".join(argv or sys.argv[1:])
    title = f"spec bench: {path.name}, head={args.head}, {res['machine']['device']}"
    md = format_bench(res, title)
    progress.finish(f"{len(res['arms'])} arms x {args.rounds} rounds")
    print(md)
    write_results(res, md, args.json, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
