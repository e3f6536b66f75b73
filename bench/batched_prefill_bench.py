"""Several prompts' prefill pieces in one forward (daemon/engine/prefill/batched_prefill.py) vs one
at a time (each ChunkedPrefill.step() alone, what the worker does today).

    .venv/bin/python bench/batched_prefill_bench.py                       # B = 2, 4 x L = 16, 64, 256
    .venv/bin/python bench/batched_prefill_bench.py --rows 2 4 8 --lengths 64 --rounds 7 --head

For each (B rows, L tokens): B parts whose caches already hold different numbers of tokens
(PREFIXES: a fresh prompt beside prefix-cache hits, so the attention caches are left-padded
when merged), each with a next piece of exactly L tokens. Arm "together": one
``prefill_together`` call (merge, one forward, extract, one evaluation); arm "alone": B
``step()`` calls. Only that is timed (building the parts and their prefixes is not). The arms
alternate A B A B ... over --rounds rounds, each on fresh parts; reported: median and spread
(max - min) of prefill tokens/s (B x L over the arm's wall time), and tokens per CPU-second of
this process (less sensitive to other load on a shared machine). Every round also checks
that the together parts' caches are bit-identical to the alone ones ("identical").
Prints markdown; writes JSON (--json) and the markdown (--markdown).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402

from daemon.engine.prefill.batched_prefill import prefill_together  # noqa: E402
from daemon.engine.kernels.forward import cache_arrays  # noqa: E402
from daemon.engine.model.loading import load_model  # noqa: E402
from daemon.engine.prefill.prefill import ChunkedPrefill  # noqa: E402
from daemon.paths import BUNDLED_MODEL  # noqa: E402

# Tokens already in row i's cache (cycled): different lengths, one fresh row.
PREFIXES = (0, 37, 101, 13, 64, 5, 150, 22)


def make_parts(lm, B: int, L: int, seed: int, head=None) -> list[ChunkedPrefill]:
    from daemon.engine.caches.head_history import HeadHistory

    rng = random.Random(seed)
    V = lm.text_args.vocab_size
    parts = []
    for i in range(B):
        prefix = PREFIXES[i % len(PREFIXES)]
        prompt = [rng.randrange(1, V) for _ in range(prefix + L + 1)]
        cache = lm.make_cache()
        if prefix:
            ChunkedPrefill(lm, prompt[: prefix + 1], prefix, cache).step()
        history = HeadHistory(head) if head is not None else None
        parts.append(ChunkedPrefill(lm, prompt, L, cache, history, start=prefix))
    return parts


def timed(fn) -> tuple[float, float]:
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def run_together(parts):
    assert prefill_together(parts) == [parts[0].chunk] * len(parts)  # each part's whole piece


def run_alone(parts):
    for p in parts:
        p.step()


def identical(a: list[ChunkedPrefill], b: list[ChunkedPrefill]) -> bool:
    for p, q in zip(a, b):
        if p.pos != q.pos:
            return False
        for x, y in zip(cache_arrays(p.cache), cache_arrays(q.cache), strict=True):
            if x.shape != y.shape or not mx.array_equal(x, y).item():
                return False
    return True


def measure(lm, B: int, L: int, rounds: int, head) -> dict:
    arms = {"together": {"wall": [], "cpu": []}, "alone": {"wall": [], "cpu": []}}
    same = True
    # Warm-up round (first use of a shape compiles kernels / grows the allocator): untimed.
    for fn in (run_together, run_alone):
        fn(make_parts(lm, B, L, seed=-1, head=head))
    for r in range(rounds):
        together, alone = make_parts(lm, B, L, r, head), make_parts(lm, B, L, r, head)
        for name, fn, parts in (("together", run_together, together), ("alone", run_alone, alone)):
            wall, cpu = timed(lambda: fn(parts))
            arms[name]["wall"].append(wall)
            arms[name]["cpu"].append(cpu)
        same = same and identical(together, alone)
    out = {"rows": B, "tokens": L, "identical": same, "prefixes": [PREFIXES[i % len(PREFIXES)] for i in range(B)]}
    for name, t in arms.items():
        tps = [B * L / w for w in t["wall"]]
        out[name] = {
            "wall_s": t["wall"],
            "cpu_s": t["cpu"],
            "tok_s_median": statistics.median(tps),
            "tok_s_spread": max(tps) - min(tps),
            "tok_per_cpu_s_median": statistics.median(B * L / max(c, 1e-9) for c in t["cpu"]),
        }
    # Paired per round (both arms ran back to back): together's speed over alone's.
    out["speedup_rounds"] = [a / t for t, a in zip(arms["together"]["wall"], arms["alone"]["wall"])]
    out["speedup_median"] = statistics.median(out["speedup_rounds"])
    return out


def markdown(result: dict) -> str:
    lines = [f"# Batched prefill ({result['machine']})", "",
             f"Model `{result['model']}`{' with its MTP head history fed' if result['head'] else ''}; "
             f"{result['rounds']} rounds, arms alternated A B (median, spread = max - min). "
             "Prefill tokens/s: B rows x L tokens over the arm's wall time; together = one "
             "`prefill_together` forward, alone = B `ChunkedPrefill.step()` calls. Rows' caches hold "
             "different prefixes (left-padded when merged). Load average at start / end: "
             f"{result['loadavg_start']} / {result['loadavg_end']}.", "",
             "| B | L | alone tok/s | together tok/s | together / alone (paired median, range) "
             "| tok per CPU-s alone / together | identical |",
             "|---:|---:|---:|---:|---:|---:|:---:|"]
    for r in result["results"]:
        a, t = r["alone"], r["together"]
        lines.append(f"| {r['rows']} | {r['tokens']} | {a['tok_s_median']:.0f} ± {a['tok_s_spread']:.0f} "
                     f"| {t['tok_s_median']:.0f} ± {t['tok_s_spread']:.0f} "
                     f"| {r['speedup_median']:.2f}x ({min(r['speedup_rounds']):.2f}-{max(r['speedup_rounds']):.2f}) "
                     f"| {a['tok_per_cpu_s_median']:.0f} / {t['tok_per_cpu_s_median']:.0f} "
                     f"| {'yes' if r['identical'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(BUNDLED_MODEL))
    ap.add_argument("--rows", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--head", action="store_true", help="give every part an MTP head history (fed per row in both arms)")
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "batched_prefill_cpu.json"))
    ap.add_argument("--markdown", default=None, help="also write the table here (default: the JSON path with .md)")
    args = ap.parse_args(argv)

    lm = load_model(args.model)
    head = None
    if args.head:
        from daemon.engine.model.mtp_head import load_mtp_head

        head = load_mtp_head(lm)
    result = {
        "argv": [sys.argv[0]] + (argv if argv is not None else sys.argv[1:]),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "machine": f"{platform.machine()} {platform.system()}, mlx {mx.__version__}, device {mx.default_device()}",
        "model": Path(args.model).name,
        "chunked_prefill": lm.chunked_prefill,
        "head": args.head,
        "rounds": args.rounds,
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "results": [],
    }
    for B in args.rows:
        for L in args.lengths:
            r = measure(lm, B, L, args.rounds, head)
            result["results"].append(r)
            print(f"B={B} L={L}: alone {r['alone']['tok_s_median']:.0f} tok/s, together "
                  f"{r['together']['tok_s_median']:.0f} tok/s, {r['speedup_median']:.2f}x, identical={r['identical']}",
                  flush=True)
    result["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    md = markdown(result)
    print(md)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    Path(args.markdown or Path(args.json).with_suffix(".md")).write_text(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
