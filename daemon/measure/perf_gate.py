"""`councild gate perf`: is the configured speculation faster than serial decode on this machine?

Arms: serial (twice: ``serial`` and ``serial_b``, the same work, to measure the noise) and
speculative decode at each depth (1..4 by default; the configured depth is always
included). Every round runs every arm once over the same fixed prompts (greedy, fixed seed);
the order is reversed on alternate rounds (ABAB / BABA) so drift on a shared machine lands
on both sides; one warm-up round is run and discarded; at least 5 measured rounds. The
measurement functions are spec_bench's (the ones `councild bench spec` uses).

Reported per arm: tokens/s median, min-max, IQR; speedup = median over rounds of the arm's
tokens/s over that round's serial tokens/s; acceptance by position; verify cost (one base
forward of k+1 tokens / one serial step) per depth.

Verdict rule (exit code):
  noise  = max(--noise-floor, max over rounds |serial_b / serial - 1|)
           (the largest gap seen between two identical serial arms run in the same round);
  s      = median over rounds of (depth-k tokens/s / serial tokens/s), k = the configured depth;
  FAIL   (exit 1) when s < 1 - noise: speculation is slower than serial beyond the noise;
  PASS   (exit 0) otherwise, labelled "faster" when s > 1 + noise, else "within noise".
Speculation off (mode off or depth 0) passes with nothing to compare. Exit 2: bad usage;
exit 1 also when the model has no MTP head while speculation is configured on.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from ..engine.types import DEFAULT_GUARD
from ..exits import EXIT_CONFIG
from .bench_io import spread, write_results
from .progress import Progress, Quiet

DEFAULT_NOISE_FLOOR = 0.02


def noise_from(serial: list[float], serial_b: list[float], floor: float = DEFAULT_NOISE_FLOOR) -> float:
    """The relative noise: the largest per-round gap between two identical serial arms."""
    if len(serial) != len(serial_b) or not serial:
        raise ValueError("noise needs paired rounds of both serial arms")
    gaps = [abs(b / a - 1.0) for a, b in zip(serial, serial_b)]
    return max(floor, max(gaps))


def verdict(serial: list[float], serial_b: list[float], arm: list[float], depth: int,
            noise_floor: float = DEFAULT_NOISE_FLOOR) -> dict:
    """Decide from per-round tokens/s (paired by round). Pure: the tests feed it numbers."""
    if depth <= 0:
        return {"pass": True, "label": "speculation off", "depth": depth, "speedup": 1.0, "noise": None,
                "rule": "nothing to compare at depth 0"}
    if len(arm) != len(serial):
        raise ValueError("the arm and serial need the same rounds")
    noise = noise_from(serial, serial_b, noise_floor)
    s = statistics.median([x / y for x, y in zip(arm, serial)])
    if s < 1.0 - noise:
        label, ok = "slower than serial beyond the noise", False
    elif s > 1.0 + noise:
        label, ok = "faster than serial beyond the noise", True
    else:
        label, ok = "within noise of serial", True
    return {"pass": ok, "label": label, "depth": depth, "speedup": s, "noise": noise,
            "rule": f"fail when the median speedup is below 1 - noise = {1.0 - noise:.3f}"}


def measure(lm, head, prompts, depths, rounds: int, tokens: int, exact: bool, rollback: str, log=print,
            guard_margin: float | None = DEFAULT_GUARD, progress: Progress | None = None) -> dict:
    """Interleaved rounds of serial, serial_b and each depth; returns per-arm raw runs.
    ``guard_margin``: exact mode's near-tie guard (None: off, as the daemon runs it where a
    verify is bit-identical to serial steps; exactness.exact_guard). ``progress`` hears of
    every arm of every round as it starts."""
    from daemon.measure.spec_bench import run_arm

    progress = progress or Quiet()
    arms = [("serial", 0), ("serial_b", 0)] + [(f"d{k}", k) for k in depths]
    progress.add((rounds + 1) * len(arms))
    raw: dict[str, list[dict]] = {name: [] for name, _ in arms}
    for r in range(rounds + 1):  # round 0 is the warm-up
        order = arms if r % 2 == 0 else list(reversed(arms))
        for name, k in order:
            progress.step(f"round {r}/{rounds}{' (warm-up)' if r == 0 else ''}, arm {name}, "
                          f"{len(prompts)} prompts x {tokens} tokens")
            res = run_arm(lm, head, prompts, tokens, k, rollback, exact, guard_margin)
            if r > 0:
                raw[name].append(res)
        log(f"round {r}/{rounds}" + (" (warm-up)" if r == 0 else ": ")
            + ("" if r == 0 else ", ".join(f"{n} {raw[n][-1]['tok_s']:.1f}" for n, _ in arms)))
    return raw


def summarize(raw: dict[str, list[dict]], depths) -> dict:
    serial = [x["tok_s"] for x in raw["serial"]]
    out = {}
    for name, runs in raw.items():
        tps = [x["tok_s"] for x in runs]
        arm = {"tok_s": spread(tps), "raw_tok_s": tps, "speedup": spread([a / b for a, b in zip(tps, serial)])}
        k = 0 if name.startswith("serial") else int(name[1:])
        arm["depth"] = k
        if k:
            cyc = sum(x["cycles"] for x in runs)
            acc = [sum(x["accepted_by_position"][i] for x in runs) for i in range(k)]
            den = [sum(x["cond_denominator"][i] for x in runs) for i in range(k)]
            arm["acceptance_by_position"] = [a / max(1, cyc) for a in acc]
            arm["conditional_acceptance"] = [a / max(1, d) for a, d in zip(acc, den)]
            arm["tokens_per_cycle"] = sum(x["tokens"] for x in runs) / max(1, cyc)
        out[name] = arm
    return out


def format_markdown(res: dict) -> str:
    v = res["verdict"]
    lines = [f"## perf gate: {res.get('model', '?')} on {res.get('machine', {}).get('device', '?')}", "",
             f"{res['rounds']} rounds (+1 warm-up), {res['prompts']} prompts x {res['tokens_per_prompt']} tokens, "
             f"{res['mode']} mode, {res['rollback']} rollback, interleaved ABAB/BABA.", "",
             "| arm | tok/s median | min-max | IQR | speedup vs serial (median, min-max) | tokens/cycle | conditional acceptance | verify cost (k+1 tokens / step) |",
             "|---|---|---|---|---|---|---|---|"]
    vc = res.get("verify_cost") or {}
    for name, a in res["arms"].items():
        t, s = a["tok_s"], a["speedup"]
        k = a["depth"]
        cond = " ".join(f"{x:.2f}" for x in a.get("conditional_acceptance", [])) or "-"
        vcs = f"{vc['plain'][k]:.2f}x" if k and vc and k in vc.get("plain", {}) else "-"
        lines.append(f"| {name} | {t['median']:.1f} | {t['min']:.1f}-{t['max']:.1f} | {t['iqr']:.1f} | "
                     f"{s['median']:.3f}x ({s['min']:.3f}-{s['max']:.3f}) | {a.get('tokens_per_cycle', 1.0):.2f} | {cond} | {vcs} |")
    noise = "-" if v["noise"] is None else f"{100 * v['noise']:.1f}%"
    lines += ["", f"Noise (max per-round |serial_b/serial - 1|, floor {100 * res['noise_floor']:.0f}%): {noise}.",
              f"Verdict at configured depth {v['depth']}: **{'PASS' if v['pass'] else 'FAIL'}**, {v['label']} "
              f"(speedup {v['speedup']:.3f}x; {v['rule']})."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="councild gate perf", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model folder (default: config, else the bundled model)")
    ap.add_argument("--config", help="TOML config (its [speculation] depth and mode are what is gated)")
    ap.add_argument("--depth", type=int, help="the depth to gate (default: the config's speculation.depth)")
    ap.add_argument("--depths", default="1,2,3,4", help="depths measured beside serial (the gated one is added)")
    ap.add_argument("--mode", choices=("exact", "fast"), help="default: the config's speculation.mode")
    ap.add_argument("--rollback", choices=("capture", "snapshot"), default=None, help="default: the engine's")
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds, >= 5 (plus one warm-up)")
    ap.add_argument("--tokens", type=int, default=48, help="tokens per prompt per arm")
    ap.add_argument("--prompts", type=int, default=3, help="how many of the fixed prompts")
    ap.add_argument("--noise-floor", type=float, default=DEFAULT_NOISE_FLOOR,
                    help=f"smallest noise assumed, as a fraction (default {DEFAULT_NOISE_FLOOR})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the result JSON here")
    ap.add_argument("--markdown", help="write the markdown table here")
    args = ap.parse_args(argv)
    if args.rounds < 5:
        ap.error("--rounds must be >= 5")

    from daemon.config import ConfigError, load_config

    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"councild gate perf: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    depth = cfg.speculation.depth if args.depth is None else args.depth
    mode = args.mode or (cfg.speculation.mode if cfg.speculation.mode != "off" else "exact")
    if cfg.speculation.mode == "off" and args.depth is None:
        depth = 0
    if depth < 0:
        ap.error("--depth must be >= 0")

    import mlx.core as mx

    from daemon.paths import resolve_model
    from daemon.measure.spec_bench import verify_cost
    from daemon.measure.fidelity import load_prompts
    from daemon.engine.model.loading import load_model
    from daemon.engine.model.mtp_head import NoMTPHead, load_mtp_head
    from daemon.engine.decoders.speculative import DEFAULT_ROLLBACK

    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    rollback = args.rollback or DEFAULT_ROLLBACK
    depths = sorted({int(d) for d in args.depths.split(",") if d.strip()} | ({depth} if depth > 0 else set()))
    depths = [d for d in depths if d > 0]
    model = resolve_model(args.model or cfg.model)
    mx.random.seed(args.seed)
    lm = load_model(model)
    try:
        head = load_mtp_head(lm)
    except NoMTPHead as exc:
        if depth > 0:
            print(f"councild gate perf: speculation is configured (depth {depth}) but {exc}", file=sys.stderr)
            return 1
        head, depths = None, []
    prompts = [lm.encode_prompt(p, None, None) for p in load_prompts()[: args.prompts]]
    t0 = time.perf_counter()
    from daemon.engine.decoders.exactness import exact_guard

    # Exact mode as the daemon runs it: no near-tie guard where verify is bit-identical.
    guard = exact_guard(lm, rollback, cfg.speculation.guard_margin) if head is not None else None
    progress = Progress("perf gate", 0)
    raw = measure(lm, head, prompts, depths, args.rounds, args.tokens, mode == "exact", rollback, log, guard, progress)
    arms = summarize(raw, depths)
    serial, serial_b = arms["serial"]["raw_tok_s"], arms["serial_b"]["raw_tok_s"]
    v = verdict(serial, serial_b, arms[f"d{depth}"]["raw_tok_s"] if depth > 0 else serial, depth, args.noise_floor)
    res = {
        "gate": "perf", "model": str(model), "depth": depth, "mode": mode, "rollback": rollback,
        "rounds": args.rounds, "tokens_per_prompt": args.tokens, "prompts": len(prompts), "seed": args.seed,
        "noise_floor": args.noise_floor, "arms": arms, "verdict": v,
        "verify_cost": verify_cost(lm, depths) if depths else None,
        "seconds": time.perf_counter() - t0,
        "machine": {"platform": platform.platform(), "device": str(mx.default_device()), "mlx": mx.__version__},
        "command": "councild gate perf " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    progress.finish(f"{'PASS' if v['pass'] else 'FAIL'}, {v['label']}")
    md = format_markdown(res)
    print(md)
    write_results(res, md, args.json, args.markdown)
    return 0 if v["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
