"""Batch decode (daemon/engine/decoders/batch.py) vs time-sliced serial decode, and batch exactness.

    .venv/bin/python bench/batch_bench.py                     # throughput + flips, bundled model
    .venv/bin/python bench/batch_bench.py --streams 1 2 4 8 --tokens 64 --rounds 3
    .venv/bin/python bench/batch_bench.py --skip-throughput   # exactness only

Throughput: for each number of concurrent streams S, aggregate tokens/s of
- serial: S serial_decode generators advanced one token each in turn (what the worker's
  time-slicing does today: one request, one cycle, per pass);
- batch guarded / batch: one BatchDecoder holding the S rows, one batched forward per step,
  with the near-tie guard (M=1 redo where the margin is small; JSON key batch_exact) and
  without it (JSON key batch_fast).
Arms run interleaved (A B C A B C ...) for --rounds rounds; median and spread (max-min)
are reported. Prefill is outside the timed region in every arm.

Exactness (--flips): batch numerics vs serial_decode alone, temperature 0.
- teacher-forced: rows of different prompt lengths are batched and fed serial_decode's own
  tokens; every position where the batched argmax differs from serial's is a flip (no
  compounding after a divergence). Also: how many positions the guard flags, and whether
  every flip sat inside the guard.
- free-running: BatchDecoder rows vs serial_decode, fast and exact; a row counts its first
  divergence (fidelity-gate convention: tokens compared up to and including it).
Prints markdown; writes JSON (default bench/results/batch_cpu.json).
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402

from daemon.engine.decoders.batch import BatchDecoder, max_logit_diff  # noqa: E402
from daemon.engine.types import DEFAULT_GUARD  # noqa: E402
from daemon.engine.model.loading import load_model
from daemon.engine.model.model import LoadedModel  # noqa: E402
from daemon.engine.decoders.sampling import Sampler  # noqa: E402
from daemon.engine.decoders.serial import serial_decode  # noqa: E402
from daemon.engine.prefill.prefill import prefill  # noqa: E402
from daemon.engine.types import SamplingParams  # noqa: E402


def greedy() -> Sampler:
    return Sampler(SamplingParams())


def serial_tokens(lm: LoadedModel, prompt: list[int], n: int) -> list[int]:
    gen = serial_decode(lm, prompt, greedy())
    out = [s.tokens[0] for s in itertools.islice(gen, n)]
    gen.close()
    return out


def make_prompts(lm: LoadedModel, n: int, seed: int = 0) -> list[list[int]]:
    """Text prompts from the fidelity set when the model has a real tokenizer, cut to
    varied lengths; random ids otherwise (the random model)."""
    import random

    rng = random.Random(seed)
    vocab = lm.text_args.vocab_size
    try:
        from daemon.measure.fidelity import load_prompts

        texts = load_prompts()
    except Exception:
        texts = []
    out = []
    for i in range(n):
        if texts and "random" not in lm.name:
            ids = lm.encode_prompt(texts[i % len(texts)], None, None)
            cut = max(1, min(len(ids), rng.choice([3, 8, 17, 40, 90])))
            out.append(ids[:cut])
        else:
            out.append([rng.randrange(vocab) for _ in range(rng.choice([1, 5, 13, 31, 70]))])
    return out


# ---------------------------------------------------------------------------- exactness
def teacher_forced(lm: LoadedModel, prompts: list[list[int]], refs: list[list[int]], guard: float) -> dict:
    """Batch all prompts, feed serial's tokens, count argmax flips vs serial."""
    caches = []
    lasts = []
    for p in prompts:
        c = lm.make_cache()
        lasts.append(int(prefill(lm, p, c).item()))
        caches.append(c)
    batch = [type(layer[0]).merge(list(layer)) for layer in zip(*caches)]
    inputs = mx.array(lasts, dtype=mx.uint32)
    n = min(len(r) for r in refs)
    flips = flagged = flips_outside_guard = 0
    flip_margins = []
    for t in range(n):
        logits = lm.logits(lm.hidden(inputs[:, None], batch))[:, -1, :]
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        top2 = mx.topk(lp.astype(mx.float32), 2, axis=-1)
        margin = top2.max(axis=-1) - top2.min(axis=-1)
        scale = mx.maximum(mx.abs(logits.max(axis=-1).astype(mx.float32)), 1.0)
        am = mx.argmax(lp, axis=-1)
        mx.eval(am, margin, scale)
        am_l, m_l, s_l = am.tolist(), margin.tolist(), scale.tolist()
        for i, r in enumerate(refs):
            f = m_l[i] <= guard * s_l[i]
            flagged += f
            if am_l[i] != r[t]:
                flips += 1
                flip_margins.append(m_l[i])
                flips_outside_guard += not f
        inputs = mx.array([r[t] for r in refs], dtype=mx.uint32)
    positions = n * len(refs)
    return {
        "positions": positions,
        "flips": flips,
        "flips_per_1000": 1000.0 * flips / positions,
        "guard_flagged": flagged,
        "guard_flagged_per_1000": 1000.0 * flagged / positions,
        "flips_outside_guard": flips_outside_guard,
        "max_flip_margin": max(flip_margins) if flip_margins else None,
    }


def free_running(lm: LoadedModel, prompts: list[list[int]], refs: list[list[int]], exact: bool, rows: int) -> dict:
    n = min(len(r) for r in refs)
    out = {"rows": 0, "identical": 0, "tokens_compared": 0, "flips": 0, "guarded": 0, "guard_changed": 0}
    for g in range(0, len(prompts), rows):
        group = list(range(g, min(g + rows, len(prompts))))
        bd = BatchDecoder(lm, guard_margin=DEFAULT_GUARD if exact else None, exact_ok=True)
        for i in group:
            bd.add(i, greedy(), prompts[i], exact=exact)
        got = {i: [] for i in group}
        for _ in range(n):
            for k, v in bd.step().items():
                got[k].append(v)
        out["guarded"] += bd.stats.guarded
        out["guard_changed"] += bd.stats.guard_changed
        for i in group:
            out["rows"] += 1
            d = next((j for j, (a, b) in enumerate(zip(refs[i], got[i])) if a != b), None)
            if d is None:
                out["identical"] += 1
                out["tokens_compared"] += n
            else:
                out["flips"] += 1
                out["tokens_compared"] += d + 1
    out["flips_per_1000"] = 1000.0 * out["flips"] / max(1, out["tokens_compared"])
    return out


def exactness(lm: LoadedModel, n_prompts: int, n_tokens: int, rows: int, guard: float) -> dict:
    prompts = make_prompts(lm, n_prompts)
    t0 = time.perf_counter()
    refs = [serial_tokens(lm, p, n_tokens) for p in prompts]
    res = {"prompts": n_prompts, "tokens": n_tokens, "rows": rows, "guard": guard,
           "prompt_lengths": [len(p) for p in prompts]}
    tf = {"positions": 0, "flips": 0, "guard_flagged": 0, "flips_outside_guard": 0, "max_flip_margin": None}
    for g in range(0, n_prompts, rows):
        r = teacher_forced(lm, prompts[g:g + rows], refs[g:g + rows], guard)
        for k in ("positions", "flips", "guard_flagged", "flips_outside_guard"):
            tf[k] += r[k]
        if r["max_flip_margin"] is not None:
            tf["max_flip_margin"] = max(tf["max_flip_margin"] or 0.0, r["max_flip_margin"])
    tf["flips_per_1000"] = 1000.0 * tf["flips"] / tf["positions"]
    tf["guard_flagged_per_1000"] = 1000.0 * tf["guard_flagged"] / tf["positions"]
    res["teacher_forced"] = tf
    res["max_abs_logit_diff_batched_vs_m1"] = {str(k): v for k, v in max_logit_diff(lm, (2, 4, 8, 16), (1, 7, 60, 300)).items()}
    res["free_fast"] = free_running(lm, prompts, refs, exact=False, rows=rows)
    res["free_exact"] = free_running(lm, prompts, refs, exact=True, rows=rows)  # guarded
    res["seconds"] = time.perf_counter() - t0
    return res


# ---------------------------------------------------------------------------- throughput
def run_serial(lm: LoadedModel, prompts: list[list[int]], n: int) -> float:
    gens = [serial_decode(lm, p, greedy()) for p in prompts]
    for g in gens:  # prefill + first step, outside the timed region
        next(g)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n):
        for g in gens:
            next(g)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    for g in gens:
        g.close()
    return n * len(prompts) / dt, n * len(prompts) / dc


def run_batch(lm: LoadedModel, prompts: list[list[int]], n: int, exact: bool) -> float:
    bd = BatchDecoder(lm, guard_margin=DEFAULT_GUARD if exact else None, exact_ok=True)
    for i, p in enumerate(prompts):
        bd.add(i, greedy(), p, exact=exact)
    bd.step()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n):
        bd.step()
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    return n * len(prompts) / dt, n * len(prompts) / dc


def throughput(lm: LoadedModel, streams: list[int], n_tokens: int, rounds: int) -> list[dict]:
    arms = {
        "serial": lambda ps: run_serial(lm, ps, n_tokens),
        "batch_exact": lambda ps: run_batch(lm, ps, n_tokens, exact=True),
        "batch_fast": lambda ps: run_batch(lm, ps, n_tokens, exact=False),
    }
    rows = []
    for s in streams:
        prompts = make_prompts(lm, s, seed=s)
        samples = {a: [] for a in arms}
        cpu = {a: [] for a in arms}
        run_batch(lm, prompts, 4, exact=False)  # warm-up
        for _ in range(rounds):
            for a, fn in arms.items():
                wall, per_cpu_s = fn(prompts)
                samples[a].append(wall)
                cpu[a].append(per_cpu_s)
        row = {"streams": s, "tokens_per_stream": n_tokens}
        for a, xs in samples.items():
            row[a] = {"median": statistics.median(xs), "spread": max(xs) - min(xs), "samples": xs,
                      "per_cpu_second_median": statistics.median(cpu[a]), "per_cpu_second_samples": cpu[a]}
        row["speedup_exact"] = row["batch_exact"]["median"] / row["serial"]["median"]
        row["speedup_fast"] = row["batch_fast"]["median"] / row["serial"]["median"]
        rows.append(row)
        print(f"  streams={s}: serial {row['serial']['median']:.1f}, batch exact {row['batch_exact']['median']:.1f}, "
              f"fast {row['batch_fast']['median']:.1f} tok/s", file=sys.stderr, flush=True)
    return rows


# ---------------------------------------------------------------------------- report
def markdown(result: dict) -> str:
    lines = [f"# Batch decode ({result['machine']})", ""]
    if result.get("throughput"):
        t = result["throughput"]
        lines += [
            f"Model `{result['model']}`; aggregate tokens/s, {t[0]['tokens_per_stream']} tokens per stream, "
            f"{result['rounds']} interleaved rounds (median, spread = max - min). serial = time-sliced "
            "serial_decode (one token per stream per pass).",
            "",
            "| streams | serial (time-sliced) | batch, guarded | batch | guarded / serial | batch / serial |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for r in t:
            cell = lambda a: f"{r[a]['median']:.1f} ± {r[a]['spread'] / 2:.1f}"  # noqa: E731
            lines.append(f"| {r['streams']} | {cell('serial')} | {cell('batch_exact')} | {cell('batch_fast')} | "
                         f"{r['speedup_exact']:.2f}x | {r['speedup_fast']:.2f}x |")
        lines += [
            "",
            "Tokens per CPU-second of this process (median; less sensitive to other load on a shared machine):",
            "",
            "| streams | serial | batch, guarded | batch | batch / serial |",
            "|---:|---:|---:|---:|---:|",
        ]
        for r in t:
            c = {a: r[a].get("per_cpu_second_median") for a in ("serial", "batch_exact", "batch_fast")}
            if None in c.values():
                continue
            lines.append(f"| {r['streams']} | {c['serial']:.1f} | {c['batch_exact']:.1f} | {c['batch_fast']:.1f} | "
                         f"{c['batch_fast'] / c['serial']:.2f}x |")
        lines.append("")
    for name, e in result.get("exactness", {}).items():
        tf, ff, fe = e["teacher_forced"], e["free_fast"], e["free_exact"]
        lines += [
            f"## Exactness: {name} ({e['prompts']} prompts x {e['tokens']} tokens, rows of {e['rows']}, "
            f"guard {e['guard']:.4g})",
            "",
            "| measure | value |",
            "|---|---:|",
            f"| max abs logit diff, batched vs M=1, by batch height | "
            f"{', '.join(f'B={k}: {v:.3g}' for k, v in e['max_abs_logit_diff_batched_vs_m1'].items())} |",
            f"| teacher-forced flips / 1000 (batched argmax vs serial) | {tf['flips_per_1000']:.2f} "
            f"({tf['flips']} of {tf['positions']}) |",
            f"| guard flagged / 1000 (M=1 redos the exact config pays) | {tf['guard_flagged_per_1000']:.1f} |",
            f"| flips outside the guard | {tf['flips_outside_guard']} |",
            f"| largest flip margin (logprob) | {tf['max_flip_margin'] if tf['max_flip_margin'] is not None else '-'} |",
            f"| free-running fast: rows identical / flips per 1000 | {ff['identical']}/{ff['rows']} / "
            f"{ff['flips_per_1000']:.2f} |",
            f"| free-running exact: rows identical / flips per 1000 / guard redos (changed) | "
            f"{fe['identical']}/{fe['rows']} / {fe['flips_per_1000']:.2f} / {fe['guarded']} ({fe['guard_changed']}) |",
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the bundled tiny-qwen35)")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--tokens", type=int, default=64, help="timed tokens per stream per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--flips", action=argparse.BooleanOptionalAction, default=True,
                    help="measure batch-vs-serial flips (bundled and random model)")
    ap.add_argument("--flip-prompts", type=int, default=16)
    ap.add_argument("--flip-tokens", type=int, default=128)
    ap.add_argument("--flip-rows", type=int, default=4)
    ap.add_argument("--guard", type=float, default=DEFAULT_GUARD)
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "batch_cpu.json"))
    ap.add_argument("--md", default=None, help="also write the markdown here")
    args = ap.parse_args(argv)

    from daemon.paths import BUNDLED_MODEL

    lm = load_model(args.model or BUNDLED_MODEL)
    result = {
        "model": lm.name,
        "machine": f"{platform.machine()} {platform.system()}, mlx {mx.__version__}, device {mx.default_device()}",
        "rounds": args.rounds,
        "command": "bench/batch_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if args.flips:
        from daemon.engine.model.random_model import build_random_model

        result["exactness"] = {}
        print("exactness: bundled model", file=sys.stderr, flush=True)
        result["exactness"][lm.name] = exactness(lm, args.flip_prompts, args.flip_tokens, args.flip_rows, args.guard)
        with tempfile.TemporaryDirectory() as tmp:
            rlm = load_model(build_random_model(Path(tmp) / "random-qwen35", seed=0))
            print("exactness: random model", file=sys.stderr, flush=True)
            result["exactness"]["random-qwen35"] = exactness(rlm, args.flip_prompts, args.flip_tokens,
                                                             args.flip_rows, args.guard)
    if not args.skip_throughput:
        print("throughput", file=sys.stderr, flush=True)
        result["throughput"] = throughput(lm, args.streams, args.tokens, args.rounds)
    md = markdown(result)
    print(md)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    if args.md:
        Path(args.md).write_text(md + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
