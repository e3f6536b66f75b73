"""Batched speculation at the 27B shape with oracle drafts: does speculating pay at batch height 4?

    python3 bench/gpu_batch_spec.py [--shape 27b|tiny] [--dtype 4bit|bf16] [--heights 4]
        [--depths 1 2] [--profile seed_0.83] [--tokens 32] [--rounds 3] [--out DIR]
        [--kernels mlx,gdn+qmm] [--compiled] [--ahead off|on|ab] [--solo]

A random-weight qwen3_5 with the shape of Qwen3.5-27B, decisive weights (bench/gpu_bench.py
``build_model``: the greedy next token of t is inv[t]), 4-bit by default. The MTP head is the
real-shaped random head, so a draft costs what a real one does; its logits are biased to the
oracle's token inv[previous token], replaced by a random token with probability 1 - a_i at
draft position i (the acceptance profile). Arms interleaved per round, B greedy rows (fast
rows: this model's matmuls are not invariant on CUDA, so exact rows do not batch there):
- batch d0: BatchDecoder, one batched forward per token;
- spec dK: SpecBatchDecoder at depth K (batched drafting, one B x (K+1) verify per cycle),
  each cycle built after the last one is read (``spec_ahead=False``);
- spec dK ahead (``--ahead``): the same with drafting cycles built ahead, decided on the
  device (batch_ahead.py; the daemon's default on CUDA);
- solo d0 / solo dK (``--solo``, one row only): what the daemon runs for a lone request,
  serial_decode and speculative_decode (fast mode, its own pipeline: the next cycle built on
  the guess that every draft lands, on by default on CUDA), with the same oracle head.
The oracle's first draft of a cycle follows each row's last committed token (``OracleSpecBatch``);
before 2026-12-07 it read the head feed's last column, which for a row that kept fewer
pairs than the longest is padding: at 4 rows most first drafts missed (1.65 tokens a row a
cycle at depth 2 against one row's 2.47 with the same profile), so those runs understate
speculation at heights above one.
``--kernels``: one or more kernel sets, each on its own copy of the model, alternated within each round (bench/step_split.py's
``set_arm``: "mlx", or a "+" of "gdn", the fused GatedDeltaNet recurrence, "conv", its conv folded in, "merge", the
projections that read one input as one matmul, and "qmm", the quantized linears on the
tensor-core kernel, whose split "sN" (N warps split K) and shared-memory stages "pN" set: ``apply_launches``); ``--compiled``: the compiled step, as the daemon
runs it. Each measured round draws new prompts (the same length; every arm of the round gets them).
Aggregate tokens/s per arm (median, range) and the per-round ratio to batch d0, printed as
markdown and written to DIR/gpu_batch_spec.json. Prefill is outside the timed region.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import mlx.core as mx  # noqa: E402

from daemon.engine.decoders.batch import BatchDecoder  # noqa: E402
from daemon.engine.decoders.batch_spec import SpecBatchDecoder  # noqa: E402
from daemon.engine.decoders.sampling import Sampler  # noqa: E402
from daemon.engine.decoders.serial import serial_decode  # noqa: E402
from daemon.engine.decoders.speculative import speculative_decode  # noqa: E402
from daemon.engine.types import SamplingParams  # noqa: E402
from step_split import apply_launches, set_arm  # noqa: E402
from gpu_bench import PROFILES, QWEN35_27B, TINY, OracleHead, build_model, log, quantize_4bit  # noqa: E402


class OracleSpecBatch(SpecBatchDecoder):
    """SpecBatchDecoder that tells the oracle head each row's last committed token (its
    primary) once the head has taken the rows' pairs: the feed pads rows to the longest, so
    the feed's last column is not every row's last token."""

    def _feed(self, head):
        g = super()._feed(head)
        head._last = self._primaries()
        return g

    def _feed_lazy(self, head, prev):
        g = super()._feed_lazy(head, prev)
        head._last = prev.bonus
        return g


class BatchOracleHead(OracleHead):
    """The real head's compute with the oracle's drafts, for every row of a batch: the draft
    after token t is inv[t] (the decisive model's greedy next token), corrupted at draft
    position i with probability 1 - acceptance[i]. A call with the head's own last output
    continues a draft chain (position i + 1); any other call starts one (position 1).
    (gpu_bench.OracleHead's cache and size; its single-row sequence is not used.)"""

    def __init__(self, head, inv: mx.array, acceptance: list[float], vocab: int, seed: int = 0):
        super().__init__(head, [], acceptance, vocab, seed)
        self.inv = inv
        self.rng = random.Random(seed)
        self._last = None

    def __call__(self, hidden, tokens, cache):
        out = self.head(hidden, tokens, cache)
        self._i = self._i + 1 if (self._g is not None and hidden is self._g) else 1
        self._last = tokens[:, -1]
        return out

    def logits(self, g):
        self._g = g
        lg = self.head.logits(g)
        a = self.acc[self._i - 1] if self._i - 1 < len(self.acc) else 0.0
        want = self.inv[self._last.astype(mx.int32)]
        B = want.shape[0]
        miss = mx.array([self.rng.random() >= a for _ in range(B)])
        other = (want + 1 + mx.array([self.rng.randrange(self.vocab - 1) for _ in range(B)])) % self.vocab
        tok = mx.where(miss, other, want)
        bias = (self._ar[None, None, :] == tok[:, None, None]).astype(lg.dtype) * 30000.0
        return lg + bias


def run_arm(lm, head, arm: str, prompts: list[list[int]], tokens: int) -> tuple[float, float, float]:
    """(aggregate tokens/s, tokens per row per step: 1 at depth 0, E(k) when drafts land, and
    the decode-only tokens/s: the tokens after the first step over the time after it).

    The first step carries the prompts' prefill (``--context`` tokens a row): the decode-only
    rate leaves it out, what a long answer streams at. On an H100's 27B (64 tokens a row) the
    two differed by 1-4%: one row's 77 tok/s over 24 tokens against 98 over 48 (2026-12-07)
    was the host's speed from call to call (the step is bound by graph building), not the
    prefill (bench/results/h100_2026-12-07b)."""
    if arm.startswith("solo "):
        return run_solo(lm, head, int(arm.split(" ")[1][1:]), prompts, tokens)
    if arm == "batch d0":
        bd = BatchDecoder(lm, max_rows=len(prompts), exact_ok=False)
    else:
        k = int(arm.split(" ")[1][1:])
        # The ahead arm builds ahead from its first cycle that can be (ahead_min_cycle_s 0): the
        # mechanism, as calls 4-5 of bench/results/h100_2026-12-07c measured it. The daemon first
        # times 8 drafting cycles and builds ahead only where they take 10 ms or more.
        bd = OracleSpecBatch(lm, lambda: head, lambda B, k=k: k, max_rows=len(prompts), exact_ok=False,
                             spec_ahead=arm.endswith(" ahead"), ahead_min_cycle_s=0.0)
    for i, p in enumerate(prompts):
        bd.add(i, Sampler(SamplingParams()), p, exact=False)
    got = {i: 0 for i in range(len(prompts))}
    steps = 0
    t0 = time.perf_counter()
    t_first = first_tokens = None
    while min(got.values()) < tokens:
        for r, out in bd.step().items():
            got[r] += 1 if isinstance(out, int) else len(out.tokens)
        steps += 1
        if t_first is None:
            t_first, first_tokens = time.perf_counter(), sum(got.values())
    t_end = time.perf_counter()
    total = sum(got.values())
    if hasattr(bd.stats, "read_wait_s"):
        st = bd.stats
        log(f"  {arm}: {st.cycles} cycles, {1e3 * (t_end - t0) / max(st.cycles, 1):.2f} ms a cycle, of which the "
            f"host waited {1e3 * st.read_wait_s / max(st.cycles, 1):.2f} ms reading the device; built ahead "
            f"{st.spec_ahead_used}, undone {st.spec_ahead_undone}")
    decode_rate = (total - first_tokens) / (t_end - t_first) if t_end > t_first else float("nan")
    return total / (t_end - t0), total / (steps * len(prompts)), decode_rate


def run_solo(lm, head, k: int, prompts: list[list[int]], tokens: int) -> tuple[float, float, float]:
    """run_arm's triple for a lone request as the daemon decodes it: serial_decode at depth 0,
    else speculative_decode in fast mode with its pipeline as resolved for this device.
    (Not spec_bench.run_arm, which loops the same way but counts the tokens asked for: here
    the tokens got, as run_arm above counts the batch's, so the arms of one table compare.)"""
    (prompt,) = prompts
    sampler = Sampler(SamplingParams())
    gen = serial_decode(lm, prompt, sampler) if k == 0 else speculative_decode(lm, head, prompt, sampler, k, exact=False)
    got = cycles = 0
    t0 = time.perf_counter()
    t_first = first_tokens = None
    for step in gen:
        got += len(step.tokens)
        cycles += 1
        if t_first is None:
            t_first, first_tokens = time.perf_counter(), got
        if got >= tokens:
            break
    t_end = time.perf_counter()
    gen.close()
    decode_rate = (got - first_tokens) / (t_end - t_first) if t_end > t_first else float("nan")
    return got / (t_end - t0), got / cycles, decode_rate


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=("27b", "tiny"), default="27b")
    ap.add_argument("--dtype", choices=("4bit", "bf16"), default="4bit")
    ap.add_argument("--heights", type=int, nargs="+", default=[4])
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--profile", default="seed_0.83", choices=sorted(PROFILES))
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench/out/gpu")
    ap.add_argument("--kernels", default="mlx", help="kernel sets, comma-separated (alternated per round)")
    ap.add_argument("--compiled", action="store_true", help="the compiled step (model/compiled.py), as the daemon runs")
    ap.add_argument("--budget", type=float, default=1e9, help="stop starting rounds after this many seconds")
    ap.add_argument("--ahead", choices=("off", "on", "ab"), default="off",
                    help="speculation arms with drafting cycles built ahead: off, on (only), ab (both, alternated)")
    ap.add_argument("--solo", action="store_true",
                    help="at height 1 also the daemon's lone-request paths: solo d0 (serial) and solo dK (speculative)")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    cfg = QWEN35_27B if args.shape == "27b" else TINY
    kernel_sets = args.kernels.split(",")
    # One model per kernel set (the same seed: the same weights), each switched onto its set
    # once: switching one model back and forth re-traced its compiled step inside the timed
    # rounds (every shape a step meets after a switch), which the first call of 2026-12-04
    # with two sets paid in every round.
    models = {}
    for ks in kernel_sets:
        lm, head, inv = build_model(cfg)
        if args.dtype == "4bit":
            quantize_4bit(lm, head)
        models[ks] = (lm, BatchOracleHead(head, inv, PROFILES[args.profile], cfg["vocab_size"]))
        log(f"built {lm.path.name} {args.dtype} for {ks}: active memory {mx.get_active_memory() / 1e9:.1f} GB")
    ahead = {"off": [""], "on": [" ahead"], "ab": ["", " ahead"]}[args.ahead]
    solo = [f"solo d{k}" for k in [0, *args.depths]] if args.solo else []

    def arms_at(B: int) -> list[str]:
        return [f"{ks} {a}" for ks in kernel_sets
                for a in ["batch d0"] + [f"spec d{k}{x}" for k in args.depths for x in ahead] + (solo if B == 1 else [])]

    rng = random.Random(7)
    results = []
    paths = {}

    for ks, (lm, _) in models.items():
        paths[ks] = set_arm(lm, ks, args.compiled)

    for B in args.heights:
        arms = arms_at(B)

        def new_prompts() -> list[list[int]]:  # each round its own (the arms of a round share them)
            return [[rng.randrange(cfg["vocab_size"]) for _ in range(args.context)] for _ in range(B)]

        prompts = new_prompts()
        for a in arms:  # one unmeasured pass: compiles every shape
            apply_launches(a.split(" ")[0])
            run_arm(*models[a.split(" ")[0]], a.split(" ", 1)[1], prompts, 4)
        rates = {a: [] for a in arms}
        decode_rates = {a: [] for a in arms}
        per_step = {a: [] for a in arms}
        for r in range(args.rounds):
            if time.perf_counter() - t_start > args.budget:
                log(f"budget: B={B} stopped before round {r + 1}")
                break
            prompts = new_prompts()
            # The order alternates round by round: on an H100 (2026-12-07) the kernel set run
            # second in a round ran 5-10% faster whichever it was (bench/results/h100_2026-12-07b).
            for a in (arms if r % 2 == 0 else arms[::-1]):
                ks, arm = a.split(" ", 1)
                apply_launches(ks)
                rate, ps, decode_rate = run_arm(*models[ks], arm, prompts, args.tokens)
                rates[a].append(rate)
                decode_rates[a].append(decode_rate)
                per_step[a].append(ps)
                log(f"B={B} round {r + 1}/{args.rounds} {a} ({paths[ks]}): {rate:.1f} tok/s ({decode_rate:.1f} after the "
                    f"first step), {ps:.2f} tokens/row/step")
        for a in arms:
            if not rates[a]:
                continue
            base = rates[f"{a.split(' ')[0]} batch d0"]
            q = [x / y for x, y in zip(rates[a], base)]
            # The same arm on the first kernel set, round by round: what a kernel set changes.
            first = rates[f"{kernel_sets[0]} {a.split(' ', 1)[1]}"]
            vs_first = [x / y for x, y in zip(rates[a], first)]
            results.append({"height": B, "arm": a, "tokens_per_s": rates[a], "ratio_vs_batch_d0": q,
                            "tokens_per_row_step": statistics.median(per_step[a]),
                            "median_tokens_per_s": statistics.median(rates[a]), "median_ratio": statistics.median(q),
                            "decode_tokens_per_s": decode_rates[a],
                            "median_decode_tokens_per_s": statistics.median(decode_rates[a]),
                            "ratio_vs_first_kernels": vs_first})
    lines = [f"batched speculation, {lm.path.name} {args.dtype}, paths {paths}, oracle drafts {args.profile} "
             f"{PROFILES[args.profile]}, {args.tokens} tokens/row, context {args.context}, {args.rounds} rounds, "
             f"{mx.default_device()}", "",
             f"| rows | arm | tokens/s median (range) | decode-only tokens/s (after the first step, which prefills) | "
             f"vs its batch d0: median (range) | vs {kernel_sets[0]}, same arm and round: median (range) | "
             "tokens/row/step |", "|---|---|---|---|---|---|---|"]
    for r in results:
        t, q, f = r["tokens_per_s"], r["ratio_vs_batch_d0"], r["ratio_vs_first_kernels"]
        d = r["decode_tokens_per_s"]
        lines.append(f"| {r['height']} | {r['arm']} | {r['median_tokens_per_s']:.1f} ({min(t):.1f}-{max(t):.1f}) | "
                     f"{r['median_decode_tokens_per_s']:.1f} ({min(d):.1f}-{max(d):.1f}) | "
                     f"{r['median_ratio']:.2f}x ({min(q):.2f}-{max(q):.2f}) | "
                     f"{statistics.median(f):.2f}x ({min(f):.2f}-{max(f):.2f}) | {r['tokens_per_row_step']:.2f} |")
    print("\n".join(lines))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_batch_spec.json").write_text(json.dumps(
        {"command": "python3 bench/gpu_batch_spec.py " + " ".join(argv if argv is not None else sys.argv[1:]),
         "shape": args.shape, "dtype": args.dtype, "profile": args.profile, "results": results}, indent=2))
    (out / "gpu_batch_spec.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
