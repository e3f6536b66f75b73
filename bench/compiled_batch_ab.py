"""Eager vs compiled batched step (should the batch compile its step?): B = 1, 2, 4, 8, interleaved in one process.

    PYTHONPATH=. python bench/compiled_batch_ab.py [--json OUT.json] [--md OUT.md]
        [--model DIR] [--random auto|none|27b|tiny] [--heights 1 2 4 8] [--rounds 6]
        [--steps 16] [--verify-t 3] [--context 64]

Models: the bundled model (``--model``, default daemon/assets/tiny-qwen35), then, with
``--random 27b`` (the default on a GPU), a random-weight qwen3_5 of Qwen3.5-27B's shape,
4-bit (bench/gpu_bench.py ``build_model`` + ``quantize_4bit``); ``tiny`` is that builder at
a small shape, for checking the script on a CPU.

Two kinds of forward, each for B rows of different prompt lengths (``--context`` + 8 i
tokens, so the caches carry left padding):
- ``step``: the continuous batch's decode step (engine/decoders/batch.py ``BatchDecoder.step``, as
  served: the next forward queued before the host reads the last one's tokens); B = 1 is
  one row on its own caches, the one-row step that was already compiled;
- ``verify``: the speculating batch's verify of B rows x ``--verify-t`` positions through
  the capturing walk (engine/model/capture.py), then a ragged keep of one position per row
  (holes in the attention KV, per-row state gathers: engine/caches/ragged_cache.py), synced per
  cycle as a speculating cycle reads its acceptance.
Arms: ``eager`` (``lm.compiled_decode`` None: every forward eager) and ``compiled`` (the
compiled step, batches included). Where the batch self-check refused the compiled batch on
this backend, the compiled arm admits batches anyway and the results say so
(``batch_check``): the speed is measured, the daemon would not use it.

Per height and kind, one unmeasured round of both arms (traces, first-use kernels), then
``--rounds`` rounds alternating the order (eager first on even rounds, compiled first on
odd: ABAB / BABA), each arm ``--steps`` forwards on the same rows (so both see the same
cache lengths, growing together). Reported: ms per forward, median and range over rounds,
eager/compiled as the median (range) of per-round ratios, and the compiled step's cost
relative to compiled B = 1 (the issue's goal on the H200: a B = 4 step <= 1.5x one row).
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

# The daemon's MLX switches, before MLX reads them (engine/jit/backend_env.py): without them a
# verify at every new key length would pay a cuDNN plan build on CUDA (46-57 ms), which the
# daemon does not pay.
from daemon.engine.jit.backend_env import configure  # noqa: E402

BACKEND_ENV = configure(cudnn_attention=False, ptx_cache=None)

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import ArraysCache  # noqa: E402

from daemon.engine.decoders.batch import BatchDecoder  # noqa: E402
from daemon.engine.model.capture import capture_hidden  # noqa: E402
from daemon.engine.model.compiled import enable_compiled_decode  # noqa: E402
from daemon.engine.caches.ragged_cache import RaggedKVCache, keep_ragged  # noqa: E402
from daemon.engine.decoders.sampling import Sampler  # noqa: E402
from daemon.engine.types import SamplingParams  # noqa: E402
from daemon.measure.bench_io import spread, write_results  # noqa: E402

BUNDLED = ROOT / "daemon" / "assets" / "tiny-qwen35"
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


@contextmanager
def arm(lm, compiled, name: str):
    """Run the body eager (``lm.compiled_decode`` None) or on the compiled step."""
    saved = lm.compiled_decode
    lm.compiled_decode = compiled if name == "compiled" else None
    try:
        yield
    finally:
        lm.compiled_decode = saved


def _prompts(vocab: int, B: int, context: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1 + rng.randrange(vocab - 1) for _ in range(context + 8 * i)] for i in range(B)]


class StepRows:
    """B rows of a BatchDecoder (fast rows: admitted on every backend)."""

    def __init__(self, lm, prompts: list[list[int]]):
        self.bd = BatchDecoder(lm, max_rows=len(prompts), exact_ok=False)
        for i, p in enumerate(prompts):
            self.bd.add(i, Sampler(SamplingParams()), p)

    def run(self, n: int) -> float:
        """Seconds per step over n steps, as served (each step queues the next forward)."""
        self.bd.step()
        mx.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            self.bd.step()
        mx.synchronize()
        return (time.perf_counter() - t) / n


class VerifyRows:
    """B rows merged as the speculating batch merges them (one row: its own caches)."""

    def __init__(self, lm, prompts: list[list[int]], T: int):
        self.lm, self.T = lm, T
        rows = []
        for p in prompts:
            cache = lm.make_cache()
            lm.hidden(mx.array([p], dtype=mx.uint32), cache)
            rows.append(cache)
        if len(rows) == 1:
            self.cache = rows[0]
        else:
            self.cache = []
            for layer in zip(*rows):
                if isinstance(layer[0], ArraysCache):
                    m = ArraysCache.merge(list(layer))
                    m.left_padding = None
                else:
                    m = RaggedKVCache.merge(list(layer))
                self.cache.append(m)
        mx.eval([c.state for c in self.cache])
        B = len(prompts)
        self.tokens = mx.array([[p[-1]] * T for p in prompts], dtype=mx.uint32)
        self.keep = [1] * B

    def cycle(self) -> None:
        rec: list = []
        h = capture_hidden(self.lm, self.tokens, self.cache, rec)
        pick = mx.argmax(self.lm.logits(h), axis=-1).astype(mx.uint32)  # [B, T]
        keep_ragged(self.cache, rec, self.keep, self.T)
        self.tokens = mx.concatenate([pick[:, :1]] * self.T, axis=1)
        mx.eval(self.tokens, [c.state for c in self.cache])

    def run(self, n: int) -> float:
        t = time.perf_counter()
        for _ in range(n):
            self.cycle()
        return (time.perf_counter() - t) / n


def bench_model(name: str, lm, args) -> dict:
    reason = enable_compiled_decode(lm)
    if reason is not None:
        log(f"{name}: the one-row step is not compiled ({reason}); nothing to compare")
        return {"model": name, "decode_path": f"eager: {reason}", "rows": []}
    compiled = lm.compiled_decode
    batch_check = "passed" if compiled.batched else f"refused ({compiled.batch_reason}); measured anyway"
    compiled.batched = True
    log(f"{name}: one-row step compiled; batch self-check {batch_check}")
    vocab = lm.text_args.vocab_size
    rows = []
    for B in args.heights:
        prompts = _prompts(vocab, B, args.context, seed=B)
        for kind in ("step", "verify"):
            with arm(lm, None, "eager"):  # rows prefilled eagerly in either arm
                runner = StepRows(lm, prompts) if kind == "step" else VerifyRows(lm, prompts, args.verify_t)
            for a in ("eager", "compiled"):  # unmeasured: traces and first-use kernels
                with arm(lm, compiled, a):
                    runner.run(2)
            ms = {"eager": [], "compiled": []}
            for r in range(args.rounds):
                for a in (("eager", "compiled") if r % 2 == 0 else ("compiled", "eager")):
                    with arm(lm, compiled, a):
                        ms[a].append(runner.run(args.steps) * 1000)
            ratio = [e / c for e, c in zip(ms["eager"], ms["compiled"])]
            rows.append({"kind": kind, "height": B, "positions": B * (1 if kind == "step" else args.verify_t),
                         "eager_ms": ms["eager"], "compiled_ms": ms["compiled"],
                         "eager": spread(ms["eager"]), "compiled": spread(ms["compiled"]),
                         "eager_over_compiled": spread(ratio)})
            log(f"{name} {kind} B={B}: eager {statistics.median(ms['eager']):.2f} ms, compiled "
                f"{statistics.median(ms['compiled']):.2f} ms, {statistics.median(ratio):.2f}x")
            del runner
    for kind in ("step", "verify"):
        one = [r for r in rows if r["kind"] == kind and r["height"] == 1]
        for r in rows:
            if r["kind"] == kind and one:
                r["compiled_vs_one_row"] = r["compiled"]["median"] / one[0]["compiled"]["median"]
                r["eager_vs_one_row_compiled"] = r["eager"]["median"] / one[0]["compiled"]["median"]
    return {"model": name, "decode_path": "compiled", "batch_check": batch_check, "rows": rows}


def _fmt(s: dict, digits: int = 2) -> str:
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def table(res: dict) -> str:
    lines = [f"eager vs compiled batched step, {res['device']}, mlx {res['mlx']}; {res['rounds']} rounds ABAB/BABA x "
             f"{res['steps']} forwards each, verify of {res['verify_t']} positions a row", ""]
    for m in res["models"]:
        lines += [f"### {m['model']} (batch self-check: {m.get('batch_check', m['decode_path'])})", "",
                  "| forward | B | eager ms median (range) | compiled ms median (range) | eager/compiled median (range) "
                  "| compiled / compiled B=1 | eager / compiled B=1 |", "|---|---|---|---|---|---|---|"]
        for r in m["rows"]:
            lines.append(f"| {r['kind']} | {r['height']} | {_fmt(r['eager'])} | {_fmt(r['compiled'])} | "
                         f"{_fmt(r['eager_over_compiled'])}x | {r.get('compiled_vs_one_row', float('nan')):.2f}x | "
                         f"{r.get('eager_vs_one_row_compiled', float('nan')):.2f}x |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(BUNDLED))
    ap.add_argument("--random", choices=("auto", "none", "27b", "tiny"), default="auto",
                    help="also a random qwen3_5 of this shape, 4-bit (auto: 27b on a GPU, none on the CPU)")
    ap.add_argument("--heights", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--verify-t", type=int, default=3)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--json")
    ap.add_argument("--md")
    args = ap.parse_args(argv)
    on_gpu = mx.default_device() == mx.gpu
    shape = args.random if args.random != "auto" else ("27b" if on_gpu else "none")
    res = {"command": "python bench/compiled_batch_ab.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "device": f"{mx.default_device()} ({platform.machine()}, {platform.node()})", "mlx": mx.__version__,
           "backend_env": {k: v for k, (v, _) in BACKEND_ENV.items()}, "rounds": args.rounds, "steps": args.steps,
           "verify_t": args.verify_t, "context": args.context,
           "models": []}
    if args.model != "none":
        from daemon.engine.model.loading import load_model

        lm = load_model(args.model, compile_decode=False)
        res["models"].append(bench_model(Path(args.model).name, lm, args))
        del lm
        mx.clear_cache()
    if shape != "none":
        from gpu_bench import QWEN35_27B, TINY, build_model, quantize_4bit

        lm, head, _ = build_model(QWEN35_27B if shape == "27b" else TINY)
        quantize_4bit(lm, head)
        del head
        log(f"built random {shape} 4-bit: active memory {mx.get_active_memory() / 1e9:.1f} GB")
        res["models"].append(bench_model(f"random {shape} 4-bit", lm, args))
    md = table(res)
    print(md)
    write_results(res, md, args.json, args.md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
