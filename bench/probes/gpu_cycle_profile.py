"""Where a speculative cycle's host time goes: cProfile over decode cycles.

``python bench/probes/gpu_cycle_profile.py --out DIR [--model PATH | --shape 27b|tiny] [--dtype bf16|4bit]``

For serial decode and speculation at each depth (pipeline off and on), decodes ``--tokens``
tokens after a warm-up and profiles them with cProfile, which also times the C calls that
wait on or feed the device: ``tolist``/``item`` (the host waiting for the device),
``async_eval``/``eval`` (MLX encoding and launching kernels) and the Python graph building
around them (a host wait inside ``decide`` is booked to decide's own time). Prints the top functions by own time per arm and writes them as JSON. A
profile is a diagnosis, not a speed figure (cProfile slows Python code): the speed figures
are gpu_bench.py --cycle-ab's.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for p in (ROOT, ROOT / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import mlx.core as mx  # noqa: E402


class _TimedMx:
    """The engine modules' ``mx``, with eval and async_eval as Python functions, so that
    cProfile lists them (nanobind calls are otherwise booked to their caller)."""

    def __init__(self, mx_module):
        self._mx = mx_module

    def __getattr__(self, name):
        return getattr(self._mx, name)

    def async_eval(self, *a):
        return self._mx.async_eval(*a)

    def eval(self, *a):
        return self._mx.eval(*a)


def time_mx_calls() -> None:
    import daemon.engine.decoders.serial as serial
    import daemon.engine.decoders.speculative as speculative

    for mod in (serial, speculative):
        mod.mx = _TimedMx(mx)


def decode(lm, head, prompt, depth, pipeline, tokens):
    from daemon.engine.decoders.sampling import Sampler
    from daemon.engine.decoders.serial import serial_decode
    from daemon.engine.decoders.speculative import speculative_decode
    from daemon.engine.types import SamplingParams

    s = Sampler(SamplingParams())
    gen = serial_decode(lm, prompt, s) if depth == 0 else speculative_decode(
        lm, head, prompt, s, depth, exact=True, rollback="capture", pipeline=pipeline)
    return gen


def profile_arm(lm, head, prompt, depth, pipeline, tokens, top):
    gen = decode(lm, head, prompt, depth, pipeline, tokens)
    got = 0
    for step in gen:  # warm-up: prefill and the first cycles
        got += len(step.tokens)
        if got >= 8:
            break
    prof = cProfile.Profile()
    got, cycles = 0, 0
    t = time.perf_counter()
    prof.enable()
    for step in gen:
        got += len(step.tokens)
        cycles += 1
        if got >= tokens:
            break
    prof.disable()
    dt = time.perf_counter() - t
    gen.close()
    st = pstats.Stats(prof)
    rows = []
    for (file, line, fn), (cc, nc, tt, ct, _) in st.stats.items():
        rows.append({"fn": f"{Path(file).name}:{line}:{fn}", "calls": nc, "tottime_ms_per_cycle": 1000 * tt / cycles,
                     "cumtime_ms_per_cycle": 1000 * ct / cycles})
    rows.sort(key=lambda r: -r["tottime_ms_per_cycle"])
    return {"depth": depth, "pipeline": pipeline, "tokens": got, "cycles": cycles,
            "ms_per_cycle": 1000 * dt / cycles, "ms_per_token": 1000 * dt / got, "top": rows[:top]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/out/cycle_profile")
    ap.add_argument("--model", help="a model folder (its own MTP head); else a random model of --shape")
    ap.add_argument("--shape", choices=("27b", "tiny"), default="27b")
    ap.add_argument("--dtype", choices=("bf16", "4bit"), default="bf16")
    ap.add_argument("--profile", default="paired_0.98")
    ap.add_argument("--depths", default="0,1,2")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from daemon.engine.model.compiled import enable_compiled_decode

    if args.model:
        from daemon.engine.model.loading import load_model
        from daemon.engine.model.mtp_head import load_mtp_head
        from daemon.measure.fidelity import load_prompts

        lm = load_model(Path(args.model))
        head = load_mtp_head(lm)
        prompt = lm.encode_prompt(load_prompts()[0], None, None)
        print("compiled:", enable_compiled_decode(lm) or "yes", file=sys.stderr)
    else:
        import gpu_bench as G
        from daemon.engine.decoders.sampling import Sampler
        from daemon.engine.decoders.serial import serial_decode
        from daemon.engine.types import SamplingParams

        cfg = G.QWEN35_27B if args.shape == "27b" else G.TINY
        lm, base_head, _ = G.build_model(cfg)
        if args.dtype == "4bit":
            G.quantize_4bit(lm, base_head)
        print("compiled:", enable_compiled_decode(lm) or "yes", file=sys.stderr)
        rng = random.Random(7)
        prompt = [rng.randrange(cfg["vocab_size"]) for _ in range(64)]
        seq = []
        gen = serial_decode(lm, prompt, Sampler(SamplingParams()))
        for step in gen:
            seq += step.tokens
            if len(seq) >= args.tokens + 40:
                break
        gen.close()
        head = G.OracleHead(base_head, list(prompt) + seq, G.PROFILES[args.profile], cfg["vocab_size"], seed=1)
    time_mx_calls()
    res = {"command": "python bench/probes/gpu_cycle_profile.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "device": str(mx.default_device()), "mlx": mx.__version__, "arms": []}
    lines = []
    for d in [int(x) for x in args.depths.split(",")]:
        for pipeline in ((True,) if d == 0 else (False, True)):
            profile_arm(lm, head, prompt, d, pipeline, args.tokens, args.top)  # warm every trace first
            r = profile_arm(lm, head, prompt, d, pipeline, args.tokens, args.top)
            res["arms"].append(r)
            lines.append(f"### depth {d}, pipeline {'on' if pipeline else 'off'}: {r['ms_per_cycle']:.2f} ms/cycle, "
                         f"{r['ms_per_token']:.2f} ms/token (under cProfile)\n")
            lines.append("| function | calls | own ms/cycle | cum ms/cycle |\n|---|---|---|---|")
            lines += [f"| {x['fn']} | {x['calls']} | {x['tottime_ms_per_cycle']:.3f} | {x['cumtime_ms_per_cycle']:.3f} |"
                      for x in r["top"]]
            lines.append("")
            print("\n".join(lines[-(len(r['top']) + 4):]), flush=True)
    (out / "cycle_profile.json").write_text(json.dumps(res, indent=2))
    (out / "cycle_profile.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
