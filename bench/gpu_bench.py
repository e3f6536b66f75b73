"""GPU benchmark (MLX on CUDA): a random-weight qwen3_5 with the shape of Qwen3.5-27B.

``python bench/gpu_bench.py --out DIR [--shape 27b|tiny] [--budget-s S]``

One process, in order:
1. copy bandwidth: one large elementwise pass (a + 1 over 2 GiB of bf16; bytes read + written).
2. build the model in bf16 (random weights, layer by layer, so float32 init never piles up),
   then for bf16 and then 4-bit (mlx ``nn.quantize``, group 64, in place):
   - serial tok/s through the engine's serial path (spec_bench's arm), against the
     weight-read bound = copy bandwidth / bytes of all weights (as DESIGN.md's reference);
   - verify cost for T = 2..5 (spec_bench.verify_cost: one forward of T tokens / one step);
   - draft cost: one MTP-head step (random head of the real shape) + its logits / one step;
   - where the time goes: graph construction vs mx.eval of a prebuilt step graph; one
     GatedDeltaNet layer, one attention layer and the lm_head timed alone, eager vs
     ``mx.compile``d (GDN layer at T=1), against their weight bytes;
   - speculation by depth with ORACLE drafts through daemon.engine.decoders.speculative
     (spec_bench.run_bench), at two acceptance profiles, vs the bound
     E(k) / (verify(k) + k * draft).

``--cycle-ab`` instead: per dtype, the speculative cycle before (an
earlier engine, ``--before-engine``, or this one building each cycle after the last) and
after (this engine, building the next cycle ahead), interleaved with serial at each depth
and profile, with both bounds and the cycle's time split (forwards vs the rest).

Model shape (Qwen3.5-27B text config, from public configs: hidden 5120, 64 layers,
full_attention_interval 4 (48 GatedDeltaNet + 16 gated attention), intermediate 17408,
24 q heads / 4 kv heads x 256, linear heads 16 key / 48 value x 128, conv 4, vocab 248320,
untied embeddings, partial rotary 0.25, rope theta 1e7, one MTP layer).

Decisive random weights: with plain random weights the top-2 logit margin is tiny, so
M=1 vs M>=2 kernels flip argmaxes often and an oracle built from the serial run would
drift off the committed sequence. So the embedding is scaled to unit rms, the residual
branch outputs (o_proj, out_proj, down_proj) are scaled by 1e-2 and lm_head = embed[perm]:
the final hidden stays close to the input token's embedding and the greedy next token is
perm^-1(token) with a margin of tens of standard deviations. Shapes, dtypes and kernels are
those of the real model; only the values differ, so costs are the real model's.

Oracle drafts: a stand-in head wraps the random MTP head (so each draft costs a real head
step + lm_head) and biases its logits to the token the serial run produced at that
position, corrupted with probability 1 - a_i at draft position i (conditional acceptance
a_i, as the governor's cost model reads it).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from governor.cost_model import expected_tokens  # noqa: E402

QWEN35_27B = {
    "model_type": "qwen3_5_text",
    "hidden_size": 5120,
    "intermediate_size": 17408,
    "num_hidden_layers": 64,
    "num_attention_heads": 24,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "rms_norm_eps": 1e-6,
    "vocab_size": 248320,
    "linear_num_value_heads": 48,
    "linear_num_key_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 4,
    "tie_word_embeddings": False,
    "max_position_embeddings": 262144,
    "mtp_num_hidden_layers": 1,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10]},
}
# Same structure, small: for checking this script on a CPU.
TINY = dict(QWEN35_27B, hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, vocab_size=4096, linear_num_value_heads=4,
            linear_num_key_heads=2, linear_key_head_dim=64, linear_value_head_dim=64,
            rope_parameters=dict(QWEN35_27B["rope_parameters"], mrope_section=[4, 2, 2]))

PROFILES = {
    "seed_0.83": [0.83, 0.79, 0.77, 0.76],  # DESIGN.md: depth-4 acceptance by position
    "paired_0.98": [0.98, 0.95, 0.88, 0.76],  # a well-paired head (first position 0.98)
}
RES_SCALE = 1e-2

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def copy_bandwidth(gib: float = 2.0, reps: int = 10) -> dict:
    n = int(gib * (1 << 30) // 2)
    a = mx.random.uniform(shape=(n,)).astype(mx.bfloat16)
    mx.eval(a)
    ts = []
    for _ in range(reps + 2):
        t = time.perf_counter()
        b = a + 1
        mx.eval(b)
        ts.append(time.perf_counter() - t)
        del b
    t = statistics.median(ts[2:])
    moved = 2 * a.nbytes
    del a
    mx.clear_cache()
    return {"bytes_moved": moved, "seconds": t, "bytes_per_s": moved / t}


def build_model(text_cfg: dict, seed: int = 0):
    """A LoadedModel of random, decisive bf16 weights (see the module docstring)."""
    from mlx_lm.models import qwen3_5

    from daemon.engine.model.model import LoadedModel
    from daemon.engine.model.mtp_head import MTPHead

    config = {"model_type": "qwen3_5", "text_config": text_cfg, "tie_word_embeddings": False}
    mx.random.seed(seed)
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(config))
    bf16 = mx.bfloat16

    def cast(m: nn.Module) -> None:
        from mlx.utils import tree_map_with_path

        m.update(tree_map_with_path(
            lambda p, v: v if (p.endswith("A_log") or v.dtype != mx.float32) else v.astype(bf16), m.parameters()))

    text = model.language_model
    D = text_cfg["hidden_size"]
    V = text_cfg["vocab_size"]
    emb = text.model.embed_tokens
    emb.weight = (emb.weight * math.sqrt(D)).astype(bf16)  # unit rms rows
    mx.eval(emb.weight)
    perm = mx.random.permutation(V)
    text.lm_head.weight = emb.weight[perm]
    mx.eval(text.lm_head.weight, perm)
    for layer in text.model.layers:
        cast(layer)
        out = layer.linear_attn.out_proj if layer.is_linear else layer.self_attn.o_proj
        out.weight = out.weight * RES_SCALE
        layer.mlp.down_proj.weight = layer.mlp.down_proj.weight * RES_SCALE
        mx.eval(layer.parameters())
    cast(text.model.norm)
    mx.eval(text.model.norm.parameters())
    inv = mx.argsort(perm)  # greedy next token of t is inv[t]
    mx.eval(inv)

    lm = LoadedModel(model=model, tokenizer=None, path=Path(f"random-qwen35-{D}x{text_cfg['num_hidden_layers']}"),
                     config=config, model_type="qwen3_5")
    head = MTPHead(text.args)
    cast(head)
    mx.eval(head.parameters())
    head._lm = lm
    return lm, head, inv


def quantize_4bit(lm, head) -> None:
    """mlx-lm's default 4-bit (group 64) on every Linear and the embedding; the head like the base."""
    from daemon.engine.model.mtp_head import _quantize_like_base

    text = lm.text_module
    nn.quantize(text, group_size=64, bits=4,
                class_predicate=lambda p, m: p in ("lm_head", "model.embed_tokens") and hasattr(m, "to_quantized"))
    mx.eval(text.lm_head.parameters(), text.model.embed_tokens.parameters())
    for layer in text.model.layers:
        nn.quantize(layer, group_size=64, bits=4)
        mx.eval(layer.parameters())
        mx.clear_cache()
    _quantize_like_base(head, lm, set())
    mx.eval(head.parameters())
    mx.clear_cache()


def weight_bytes(module) -> int:
    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


class OracleHead:
    """Stand-in MTP head: the real head's compute, the oracle's tokens.

    The engine calls ``head(hidden, tokens, cache)`` to feed committed pairs (the next
    ``logits`` drafts position 1 of a cycle) or to feed back its own last output with the
    token it just drafted (position i+1); the two are told apart by identity of the hidden
    passed in. The drafted position in the sequence is the head cache's offset + 1 (slot S
    pairs base hidden S with token S+1 and drafts token S+2)."""

    def __init__(self, head, sequence: list[int], acceptance: list[float], vocab: int, seed: int = 0):
        self.head = head
        self.seq = sequence
        self.acc = acceptance
        self.vocab = vocab
        self.seed = seed
        self.unloaded = False
        self._g = None
        self._i = 0
        self._pos = 0
        self._ar = mx.arange(vocab)
        self.drafted = 0
        self.corrupted = 0

    def make_cache(self):
        return self.head.make_cache()

    @property
    def nbytes(self) -> int:
        return self.head.nbytes

    def __call__(self, hidden, tokens, cache):
        out = self.head(hidden, tokens, cache)
        self._i = self._i + 1 if (self._g is not None and hidden is self._g) else 1
        self._pos = cache[0].offset + 1
        return out

    def logits(self, g):
        self._g = g
        lg = self.head.logits(g)
        tok = self.seq[self._pos] if self._pos < len(self.seq) else 0
        a = self.acc[self._i - 1] if self._i - 1 < len(self.acc) else 0.0
        self.drafted += 1
        # The coin for (position, draft index) is fixed by the seed: every arm, and a cycle
        # built ahead and undone, sees the same drafts at the same place.
        rng = random.Random(f"{self.seed}:{self._pos}:{self._i}")
        if rng.random() >= a:
            tok = (tok + 1 + rng.randrange(self.vocab - 1)) % self.vocab
            self.corrupted += 1
        return lg + (self._ar == tok).astype(lg.dtype) * 30000.0


def time_eval(fn, reps: int) -> float:
    from daemon.measure.spec_bench import median_time

    return median_time(fn, reps)


def where_time_goes(lm, prompt: list[int], wbytes: int, bw: float, reps: int = 10) -> dict:
    """Graph construction vs evaluation of one serial step; per-layer eager vs compiled."""
    from mlx_lm.models.cache import ArraysCache

    from daemon.engine.decoders.rollback import Snapshot
    from daemon.engine.prefill.prefill import prefill

    out: dict = {}
    cache = lm.make_cache()
    last = prefill(lm, prompt, cache)
    mx.eval([c.state for c in cache])
    builds, evals = [], []
    for _ in range(reps + 2):
        snap = Snapshot.take(cache)
        t = time.perf_counter()
        y = mx.argmax(lm.logits(lm.hidden(last[None], cache))[:, -1, :], axis=-1)
        t1 = time.perf_counter()
        mx.eval(y, [c.state for c in cache])
        t2 = time.perf_counter()
        builds.append(t1 - t)
        evals.append(t2 - t1)
        snap.restore()
    out["step_graph_build_s"] = statistics.median(builds[2:])
    out["step_eval_prebuilt_s"] = statistics.median(evals[2:])
    try:
        from mlx_lm.models.cache import KVCache  # noqa: F401
        import tempfile

        snap = Snapshot.take(cache)
        y = mx.argmax(lm.logits(lm.hidden(last[None], cache))[:, -1, :], axis=-1)
        with tempfile.NamedTemporaryFile("w+", suffix=".dot") as fh:
            mx.export_to_dot(fh.name, y)
            text = Path(fh.name).read_text()
        out["step_graph_nodes"] = sum(1 for ln in text.splitlines() if "[label" in ln and "->" not in ln)
        mx.eval(y)
        snap.restore()
    except Exception as exc:  # noqa: BLE001
        out["step_graph_nodes_error"] = repr(exc)

    layers = lm.backbone.layers
    gdn_i = next(i for i, l in enumerate(layers) if l.is_linear)
    att_i = next(i for i, l in enumerate(layers) if not l.is_linear)
    D = lm.text_args.hidden_size
    x = (mx.random.normal((1, 1, D)) * 0.5).astype(mx.bfloat16)
    mx.eval(x)
    chain = 16  # layer calls chained per eval, so one sync is spread over many

    gdn = layers[gdn_i]
    c = cache[gdn_i]
    c0, c1 = c[0], c[1]

    def gdn_step(x, s0, s1):
        tmp = ArraysCache(2)
        tmp[0], tmp[1] = s0, s1
        y = gdn(x, None, tmp)
        return y, tmp[0], tmp[1]

    def run_chain(step):
        def run():
            y, s0, s1 = x, c0, c1
            for _ in range(chain):
                y, s0, s1 = step(y, s0, s1)
            mx.eval(y, s0, s1)
        return run

    eager = time_eval(run_chain(gdn_step), reps) / chain
    res = {"eager_s": eager, "weight_bytes": weight_bytes(gdn)}
    try:
        compiled = mx.compile(gdn_step)
        res["compiled_s"] = time_eval(run_chain(compiled), reps) / chain
    except Exception as exc:  # noqa: BLE001
        res["compiled_error"] = repr(exc)
    res["bound_s"] = res["weight_bytes"] / bw
    out["gdn_layer"] = res

    att = layers[att_i]
    kv = cache[att_i]

    def att_run():
        snap_off = kv.offset
        y = x
        for _ in range(chain):
            y = att(y, None, kv)
        mx.eval(y, kv.state)
        kv.offset = snap_off

    out["attention_layer"] = {"eager_s": time_eval(att_run, reps) / chain, "weight_bytes": weight_bytes(att)}
    out["attention_layer"]["bound_s"] = out["attention_layer"]["weight_bytes"] / bw

    def head_run():
        ys = [lm.logits(x + i) for i in range(4)]
        mx.eval(ys)

    lmh = lm.text_module.lm_head
    out["lm_head"] = {"eager_s": time_eval(head_run, reps) / 4, "weight_bytes": weight_bytes(lmh)}
    out["lm_head"]["bound_s"] = out["lm_head"]["weight_bytes"] / bw
    n_gdn = sum(1 for l in layers if l.is_linear)
    n_att = len(layers) - n_gdn
    est = n_gdn * res["eager_s"] + n_att * out["attention_layer"]["eager_s"] + out["lm_head"]["eager_s"]
    out["sum_of_parts_eager_s"] = est
    if "compiled_s" in res:
        out["sum_of_parts_gdn_compiled_s"] = est - n_gdn * (res["eager_s"] - res["compiled_s"])
    out["bound_step_s"] = wbytes / bw
    return out


def draft_cost(lm, head, reps: int = 10) -> float:
    """One head step (1 pair) + lm_head + argmax, in seconds."""
    D = lm.text_args.hidden_size
    cache = head.make_cache()
    h = mx.random.normal((1, 8, D)).astype(mx.bfloat16)
    t = mx.array([[3, 4, 5, 6, 7, 8, 9, 10]], dtype=mx.uint32)
    mx.eval(head(h, t, cache))
    g = h[:, -1:]

    def run():
        out = head(g, t[:, :1], cache)
        d = mx.argmax(head.logits(out)[:, -1, :], axis=-1)
        mx.eval(d, [c.state for c in cache])
        for c in cache:
            c.trim(1)

    return time_eval(run, reps)


def bench_dtype(name: str, lm, head, inv, prompt, args, bw: float, profiles: dict, results: dict,
                spec_deadline: float) -> None:
    from daemon.measure.spec_bench import run_arm, run_bench, verify_cost
    from daemon.engine.decoders.sampling import Sampler
    from daemon.engine.decoders.serial import serial_decode
    from daemon.engine.types import SamplingParams

    r: dict = {}
    results[name] = r
    if args.compiled:  # after any quantization: the traces hold the weights they were made with
        from daemon.engine.model.compiled import enable_compiled_decode

        lm.compiled_decode = None
        reason = enable_compiled_decode(lm)
        r["decode_path"] = "compiled" if reason is None else f"eager: {reason}"
        log(f"{name}: decode path {r['decode_path']}")
    wb = weight_bytes(lm.model)
    emb = weight_bytes(lm.text_module.model.embed_tokens)
    r["weight_bytes"] = wb
    r["embedding_bytes"] = emb
    r["head_bytes"] = weight_bytes(head)
    r["bound_tok_s"] = bw / wb
    r["bound_tok_s_without_embedding_table"] = bw / (wb - emb)
    log(f"{name}: weights {wb / 1e9:.2f} GB (embedding {emb / 1e9:.2f} GB, head {r['head_bytes'] / 1e9:.2f} GB); "
        f"bound {r['bound_tok_s']:.0f} tok/s")

    # The oracle sequence, and a check that the decisive weights decide.
    gen = serial_decode(lm, prompt, Sampler(SamplingParams()))
    seq = []
    for step in gen:
        seq += step.tokens
        if len(seq) >= args.tokens + 8:
            break
    gen.close()
    inv_l = inv.tolist()
    chain_ok = sum(1 for a, b in zip([prompt[-1]] + seq, seq) if inv_l[a] == b) / len(seq)
    r["greedy_follows_permutation"] = chain_ok
    log(f"{name}: greedy follows the permutation at {100 * chain_ok:.0f}% of steps")
    full_seq = list(prompt) + seq

    serial = []
    for _ in range(args.serial_reps + 1):
        serial.append(run_arm(lm, None, [prompt], args.tokens, 0, None, True)["tok_s"])
    r["serial_tok_s"] = {"median": statistics.median(serial[1:]), "runs": serial[1:]}
    r["serial_pct_of_bound"] = 100 * r["serial_tok_s"]["median"] / r["bound_tok_s"]
    log(f"{name}: serial {r['serial_tok_s']['median']:.1f} tok/s = {r['serial_pct_of_bound']:.1f}% of bound")

    vc = verify_cost(lm, [1, 2, 3, 4], context=len(prompt), reps=args.reps)
    r["verify_cost"] = vc
    log(f"{name}: verify T=2..5 plain " + " ".join(f"{vc['plain'][k]:.2f}" for k in (1, 2, 3, 4))
        + " capture " + " ".join(f"{vc['capture'][k]:.2f}" for k in (1, 2, 3, 4)))
    dc = draft_cost(lm, head, args.reps)
    r["draft_cost_s"] = dc
    r["draft_cost_ratio"] = dc / vc["serial_step_s"]
    log(f"{name}: draft step {1000 * dc:.2f} ms = {r['draft_cost_ratio']:.3f} serial steps")

    try:
        r["where_time_goes"] = where_time_goes(lm, prompt, wb, bw, args.reps)
    except Exception as exc:  # noqa: BLE001 - report and go on
        import traceback

        r["where_time_goes_error"] = traceback.format_exc()
        log(f"{name}: where_time_goes failed: {exc!r}")
    if "where_time_goes" in r:
        w = r["where_time_goes"]
        log(f"{name}: step graph build {1000 * w['step_graph_build_s']:.2f} ms, eval of prebuilt graph "
            f"{1000 * w['step_eval_prebuilt_s']:.2f} ms, nodes {w.get('step_graph_nodes')}; GDN layer eager "
            f"{1e6 * w['gdn_layer']['eager_s']:.0f} us compiled {1e6 * w['gdn_layer'].get('compiled_s', float('nan')):.0f} us "
            f"(bound {1e6 * w['gdn_layer']['bound_s']:.0f}); attention layer {1e6 * w['attention_layer']['eager_s']:.0f} us "
            f"(bound {1e6 * w['attention_layer']['bound_s']:.0f}); lm_head {1e6 * w['lm_head']['eager_s']:.0f} us "
            f"(bound {1e6 * w['lm_head']['bound_s']:.0f})")

    r["speculation"] = {}
    for pname, acc in profiles.items():
        if time.perf_counter() - T0 > spec_deadline:
            log(f"{name}: past {spec_deadline:.0f} s, skipping profile {pname}")
            r["speculation_skipped"] = r.get("speculation_skipped", []) + [pname]
            continue
        oracle = OracleHead(head, full_seq, acc, lm.text_args.vocab_size, seed=1)
        try:
            res = run_bench(lm, oracle, [prompt], (1, 2, 3, 4), args.rounds, args.tokens, strategies=("capture",),
                            exact=True, log=log)
        except Exception as exc:  # noqa: BLE001
            import traceback

            r["speculation_error"] = traceback.format_exc()
            log(f"{name} {pname}: failed: {exc!r}")
            continue
        bound = {}
        for k in (1, 2, 3, 4):
            e = expected_tokens(acc, k)
            bound[k] = e / (vc["capture"][k] + k * r["draft_cost_ratio"])
        res["bound_speedup"] = bound
        res["bound_speedup_free_verify"] = {k: expected_tokens(acc, k) / (1 + k * r["draft_cost_ratio"]) for k in (1, 2, 3, 4)}
        res["target_conditional_acceptance"] = acc
        res["oracle_drafts"] = oracle.drafted
        res["oracle_corrupted"] = oracle.corrupted
        r["speculation"][pname] = res
        log(f"{name} {pname}: " + ", ".join(
            f"d{k} {res['arms'][f'capture/d{k}']['speedup']['median']:.2f}x (bound {bound[k]:.2f}x, acc "
            + " ".join(f"{a:.2f}" for a in res['arms'][f'capture/d{k}']['conditional_acceptance']) + ")"
            for k in (1, 2, 3, 4)))


def compile_ab_dtype(name: str, lm, head, prompt, args, results: dict) -> None:
    """Before/after for daemon/engine/model/compiled.py on this dtype: the start-up self-check's
    verdict, verify cost eager vs compiled, and serial + oracle speculation, interleaved."""
    from daemon.measure.compile_bench import decode_path, run_compile_ab
    from daemon.engine.model.compiled import CompiledDecode, self_check
    from daemon.measure.spec_bench import verify_cost
    from daemon.engine.decoders.sampling import Sampler
    from daemon.engine.decoders.serial import serial_decode
    from daemon.engine.types import SamplingParams

    r: dict = {}
    results.setdefault("compile_ab", {})[name] = r
    compiled = CompiledDecode(lm.backbone)  # a fresh trace: the weights may have been quantized
    t = time.perf_counter()
    reason = self_check(lm, compiled)
    r["self_check"] = reason or "bit-identical"
    r["self_check_s"] = time.perf_counter() - t
    log(f"{name} compile: self-check {r['self_check']} ({r['self_check_s']:.1f} s, includes tracing)")
    from daemon.measure.compile_bench import format_paired, paired_forward_times

    r["paired"] = paired_forward_times(lm, compiled, Ts=(1, 2, 3, 4, 5), pairs=args.compile_pairs, context=len(prompt))
    log(f"{name} compile: paired forwards\n" + format_paired(r["paired"]))
    if args.compile_skip_tokps:
        return
    with decode_path(lm, None):
        r["verify_eager"] = verify_cost(lm, [1, 2, 3, 4], context=len(prompt), reps=args.reps)
    with decode_path(lm, compiled):
        r["verify_compiled"] = verify_cost(lm, [1, 2, 3, 4], context=len(prompt), reps=args.reps)
    for p in ("eager", "compiled"):
        v = r[f"verify_{p}"]
        log(f"{name} compile: {p} step {1000 * v['serial_step_s']:.2f} ms, verify T=2..5 plain "
            + " ".join(f"{v['plain'][k]:.2f}" for k in (1, 2, 3, 4)) + " capture "
            + " ".join(f"{v['capture'][k]:.2f}" for k in (1, 2, 3, 4)))
    with decode_path(lm, None):  # the oracle follows the eager serial run
        gen = serial_decode(lm, prompt, Sampler(SamplingParams()))
        seq: list[int] = []
        for step in gen:
            seq += step.tokens
            if len(seq) >= args.tokens + 8:
                break
        gen.close()
    acc = PROFILES[args.compile_profile]
    oracle = OracleHead(head, list(prompt) + seq, acc, lm.text_args.vocab_size, seed=1)
    lm.compiled_decode = compiled
    try:
        depths = [int(d) for d in args.compile_depths.split(",") if d.strip()]
        res = run_compile_ab(lm, oracle, [prompt], depths, args.rounds, args.tokens, log=log)
    finally:
        lm.compiled_decode = None
    res["profile"] = {args.compile_profile: acc}
    r["ab"] = res
    log(f"{name} compile: compiled/eager " + ", ".join(
        f"{k} {v['median']:.3f}x ({v['min']:.3f}-{v['max']:.3f})" for k, v in res["ratio"].items())
        + f"; token mismatches: {len(res['token_mismatches'])}")


def cycle_ab_dtype(name: str, lm, head, prompt, args, results: dict) -> None:
    """The speculative cycle before (each cycle built after the previous
    one is decided) and after (built ahead on the guess of a full accept), interleaved with
    serial, on the compiled decode path as the daemon runs it; oracle drafts at each
    profile. Reports both bounds (synced verify costs as before; prebuilt-graph device
    costs) and the cycle's time split (forwards vs the rest)."""
    from daemon.engine.model.compiled import enable_compiled_decode
    from daemon.engine.decoders.sampling import Sampler
    from daemon.engine.decoders.serial import serial_decode
    from daemon.engine.types import SamplingParams
    from daemon.measure.spec_bench import cycle_split, forward_costs, run_bench, verify_cost

    r: dict = {}
    results.setdefault("cycle_ab", {})[name] = r
    lm.compiled_decode = None
    t = time.perf_counter()
    reason = enable_compiled_decode(lm)
    r["decode_path"] = "compiled" if reason is None else f"eager: {reason}"
    log(f"{name}: decode path {r['decode_path']} ({time.perf_counter() - t:.1f} s)")
    gen = serial_decode(lm, prompt, Sampler(SamplingParams()))
    seq: list[int] = []
    for step in gen:
        seq += step.tokens
        if len(seq) >= args.tokens + 16:
            break
    gen.close()
    depths = [int(d) for d in args.cycle_depths.split(",")]
    vc = verify_cost(lm, depths, context=len(prompt), reps=args.reps)
    fc = forward_costs(lm, head, depths, context=len(prompt), reps=args.reps)
    dc = fc["draft_s"]
    r["verify_cost"], r["forward_costs"] = vc, fc
    log(f"{name}: synced step {1000 * vc['serial_step_s']:.2f} ms, capture verify T=2.. "
        + " ".join(f"{vc['capture'][k]:.2f}" for k in depths) + f"; prebuilt step {1000 * fc['step_s']:.2f} ms, verify "
        + " ".join(f"{1000 * fc['verify_s'][k]:.2f}" for k in depths) + f" ms, draft {1000 * dc:.2f} ms")
    r["profiles"] = {}
    for pname in args.cycle_profiles.split(","):
        acc = PROFILES[pname]
        oracle = OracleHead(head, list(prompt) + seq, acc, lm.text_args.vocab_size, seed=1)
        before = False
        if args.before_engine:
            from daemon.measure.spec_bench import load_engine_module

            before = load_engine_module(args.before_engine).speculative_decode
        variants = {"before": before, "off": False, "after": True} if args.cycle_arms == 3 else {"before": before, "after": True}
        res = run_bench(lm, oracle, [prompt], depths, args.rounds, args.tokens, strategies=("capture",), exact=True,
                        log=log, pipelines=variants)
        res["pipelines"] = {"before": args.before_engine or "this engine, pipeline off", "after": "this engine, pipeline on"}
        if args.cycle_arms == 3:
            res["pipelines"]["off"] = "this engine, pipeline off"
        res["cycle_split"] = cycle_split(res, fc)
        res["forward_costs"] = fc
        bound, dev_bound = {}, {}
        for k in depths:
            e = expected_tokens(acc, k)
            bound[k] = e / (vc["capture"][k] + k * dc / vc["serial_step_s"])
            dev_bound[k] = e * fc["step_s"] / (fc["verify_s"][k] + k * dc)
        res["bound_speedup"] = bound  # synced verify costs (the bound of the earlier tables)
        res["device_bound_speedup"] = dev_bound  # prebuilt-graph (device) costs, target acceptance
        res["target_conditional_acceptance"] = acc
        r["profiles"][pname] = res
        log(f"{name} {pname}: " + ", ".join(
            f"d{k} before {res['arms'][f'capture/d{k}/before']['decode_speedup']['median']:.2f}x "
            f"after {res['arms'][f'capture/d{k}/after']['decode_speedup']['median']:.2f}x "
            f"(bound {bound[k]:.2f}x, device bound {dev_bound[k]:.2f}x)" for k in depths))
        (Path(args.out) / "gpu_bench.json").write_text(json.dumps(results, indent=2, default=str))
    lm.compiled_decode = None


def format_cycle_summary(res: dict) -> str:
    from daemon.measure.spec_bench import format_bench

    lines = [f"## speculative cycle before/after: {res['machine']['device']}, mlx {res['machine']['mlx']}", ""]
    for name, r in res.get("cycle_ab", {}).items():
        lines += [f"### {name} ({r['decode_path']})", ""]
        for pname, sp in r.get("profiles", {}).items():
            lines += [f"#### {pname} (target conditional acceptance {sp['target_conditional_acceptance']})", "",
                      "| depth | before (decode speedup, min-max) | after | after/before (paired, min-max) | "
                      "bound (synced verify) | after / bound | device bound | after / device bound |",
                      "|---|---|---|---|---|---|---|---|"]
            for k in sp["bound_speedup"]:
                k = int(k)
                b = sp["arms"][f"capture/d{k}/before"]["decode_speedup"]
                a = sp["arms"][f"capture/d{k}/after"]["decode_speedup"]
                per = sp["pipeline_ab"]["per_arm"]
                ab = per.get(f"capture/d{k}") or per[f"capture/d{k} after"]
                bd, db = sp["bound_speedup"][k], sp["device_bound_speedup"][k]
                lines.append(f"| {k} | {b['median']:.3f}x ({b['min']:.2f}-{b['max']:.2f}) | {a['median']:.3f}x "
                             f"({a['min']:.2f}-{a['max']:.2f}) | {ab['median']:.3f} ({ab['min']:.2f}-{ab['max']:.2f}) | "
                             f"{bd:.3f}x | {a['median'] / bd:.3f} | {db:.3f}x | {a['median'] / db:.3f} |")
            lines += ["", format_bench(sp, f"{name} {pname}: all arms"), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/out/gpu")
    ap.add_argument("--shape", choices=("27b", "tiny"), default="27b")
    ap.add_argument("--dtypes", default="bf16,4bit")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--serial-reps", type=int, default=3)
    ap.add_argument("--context", type=int, default=64, help="prompt length (tokens)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="start no 4-bit speculation profile past this many seconds")
    ap.add_argument("--bf16-spec-deadline-s", type=float, default=150.0,
                    help="run bf16 speculation only if this many seconds have not passed yet")
    ap.add_argument("--profiles", default=",".join(PROFILES), help="4-bit oracle profiles (comma list)")
    ap.add_argument("--bf16-profiles", default="seed_0.83", help="profiles to run at bf16 (comma list, or none)")
    ap.add_argument("--compiled", action="store_true",
                    help="run the full bench on the compiled decode path (daemon/engine/model/compiled.py), as the daemon does")
    ap.add_argument("--compile-ab", action="store_true",
                    help="instead of the full bench: compiled vs eager decode (daemon/engine/model/compiled.py) per dtype")
    ap.add_argument("--compile-profile", default="paired_0.98", choices=sorted(PROFILES),
                    help="oracle acceptance profile for --compile-ab's speculation arms")
    ap.add_argument("--compile-depths", default="1,2,3", help="speculation depths for --compile-ab")
    ap.add_argument("--compile-pairs", type=int, default=20, help="interleaved eager/compiled forward pairs per T")
    ap.add_argument("--compile-skip-tokps", action="store_true",
                    help="--compile-ab: only the self-check and the paired forwards (no verify-cost or tok/s arms)")
    ap.add_argument("--cycle-ab", action="store_true",
                    help="instead of the full bench: the speculative cycle built after (before) vs ahead (after), "
                         "with its time split, per dtype and profile (compiled decode path)")
    ap.add_argument("--cycle-profiles", default="paired_0.98,seed_0.83", help="profiles for --cycle-ab")
    ap.add_argument("--cycle-depths", default="1,2,3,4", help="depths for --cycle-ab")
    ap.add_argument("--cycle-arms", type=int, choices=(2, 3), default=2,
                    help="--cycle-ab: 2 = before/after; 3 = before, this engine pipeline off, pipeline on")
    ap.add_argument("--before-engine", help="--cycle-ab's before arm: this earlier speculative.py (git show "
                                            "main:daemon/engine/decoders/speculative.py > FILE) instead of this engine with the pipeline off")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import mlx_lm

    cfg = QWEN35_27B if args.shape == "27b" else TINY
    results: dict = {"command": "python bench/gpu_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                     "text_config": cfg, "res_scale": RES_SCALE, "profiles": PROFILES,
                     "machine": {"platform": platform.platform(), "device": str(mx.default_device()),
                                 "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__}}
    try:
        results["machine"]["device_info"] = {k: v for k, v in mx.device_info().items() if isinstance(v, (int, float, str))}
    except Exception:  # noqa: BLE001
        pass

    def save():
        (out / "gpu_bench.json").write_text(json.dumps(results, indent=2, default=str))

    bwr = copy_bandwidth(2.0 if args.shape == "27b" else 0.25)
    results["copy_bandwidth"] = bwr
    bw = bwr["bytes_per_s"]
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    lm, head, inv = build_model(cfg)
    log(f"built {lm.path.name}: active memory {mx.get_active_memory() / 1e9:.1f} GB")
    rng = random.Random(7)
    prompt = [rng.randrange(cfg["vocab_size"]) for _ in range(args.context)]
    dtypes = args.dtypes.split(",")
    def ab_over_dtypes(run_dtype, summarize, name: str) -> int:
        """Run one A/B bench per dtype (4-bit quantizes the model in place, so it goes
        last), saving after each, then print and write its summary."""
        try:
            for dtype in dtypes:
                if dtype == "4bit":
                    quantize_4bit(lm, head)
                    mx.clear_cache()
                run_dtype(dtype, lm, head, prompt, args, results)
                save()
        finally:
            results["elapsed_s"] = time.perf_counter() - T0
            save()
        md = summarize(results)
        print(md)
        (out / name).write_text(md + "\n")
        return 0

    if args.cycle_ab:
        return ab_over_dtypes(cycle_ab_dtype, format_cycle_summary, "gpu_cycle_ab.md")
    if args.compile_ab:
        return ab_over_dtypes(compile_ab_dtype, format_compile_summary, "gpu_compile_ab.md")
    try:
        if "bf16" in dtypes:
            profs = {} if args.bf16_profiles == "none" else {p: PROFILES[p] for p in args.bf16_profiles.split(",")}
            bench_dtype("bf16", lm, head, inv, prompt, args, bw, profs, results, args.bf16_spec_deadline_s)
            save()
        if "4bit" in dtypes:
            quantize_4bit(lm, head)
            mx.clear_cache()
            log(f"quantized to 4-bit: active memory {mx.get_active_memory() / 1e9:.1f} GB")
            bench_dtype("4bit", lm, head, inv, prompt, args, bw, {p: PROFILES[p] for p in args.profiles.split(",")}, results, args.budget_s)
            save()
    finally:
        results["elapsed_s"] = time.perf_counter() - T0
        save()
    print(format_summary(results))
    (out / "gpu_bench.md").write_text(format_summary(results) + "\n")
    return 0


def format_compile_summary(res: dict) -> str:
    from daemon.measure.compile_bench import format_compile_ab

    lines = [f"## compiled vs eager decode: {res['machine']['device']}, mlx {res['machine']['mlx']}", ""]
    for name, r in res.get("compile_ab", {}).items():
        lines += [f"### {name}", "", f"Self-check (the daemon's start-up test): **{r['self_check']}**.", ""]
        if "paired" in r:
            from daemon.measure.compile_bench import format_paired

            lines += [format_paired(r["paired"]), ""]
        if "verify_eager" not in r:
            continue
        lines += [
                  "| path | step ms | verify T=2 | T=3 | T=4 | T=5 | capture T=2 | T=3 | T=4 | T=5 |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for p in ("eager", "compiled"):
            v = r[f"verify_{p}"]
            lines.append(f"| {p} | {1000 * v['serial_step_s']:.2f} | "
                         + " | ".join(f"{v['plain'][k]:.2f}x" for k in (1, 2, 3, 4)) + " | "
                         + " | ".join(f"{v['capture'][k]:.2f}x" for k in (1, 2, 3, 4)) + " |")
        if "ab" in r:
            lines += ["", format_compile_ab(r["ab"], f"{name}: serial and oracle speculation "
                                                     f"({', '.join(r['ab']['profile'])})")]
        lines.append("")
    return "\n".join(lines)


def format_summary(res: dict) -> str:
    bw = res["copy_bandwidth"]["bytes_per_s"]
    lines = [f"## GPU bench: {res['machine']['device']}, mlx {res['machine']['mlx']}, mlx-lm {res['machine']['mlx_lm']}",
             "", f"copy bandwidth {bw / 1e12:.2f} TB/s (bytes read + written, one bf16 a+1 pass over 2 GiB)", "",
             "| dtype | weights GB | bound tok/s | serial tok/s | % of bound | verify T=2 | T=3 | T=4 | T=5 | draft step |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name in ("bf16", "4bit"):
        r = res.get(name)
        if not r or "serial_tok_s" not in r:
            continue
        vc = r.get("verify_cost", {})
        ratios = " | ".join(f"{vc['plain'][k]:.2f}x" if vc else "-" for k in (1, 2, 3, 4))
        lines.append(f"| {name} | {r['weight_bytes'] / 1e9:.2f} | {r['bound_tok_s']:.0f} | {r['serial_tok_s']['median']:.1f} | "
                     f"{r['serial_pct_of_bound']:.1f}% | {ratios} | {r.get('draft_cost_ratio', float('nan')):.3f}x |")
    lines += ["", "Verify cost with the capturing forward (the engine's default rollback):", "",
              "| dtype | T=2 | T=3 | T=4 | T=5 |", "|---|---|---|---|---|"]
    for name in ("bf16", "4bit"):
        r = res.get(name)
        if r and "verify_cost" in r:
            lines.append(f"| {name} | " + " | ".join(f"{r['verify_cost']['capture'][k]:.2f}x" for k in (1, 2, 3, 4)) + " |")
    lines += ["", "Speculation with oracle drafts (engine end to end, capture rollback, exact mode), "
                  "speedup = median of per-round ratios vs serial; bound = E(k) / (verify(k) + k * draft):", "",
              "| dtype | profile (conditional a1..a4) | depth | speedup | bound | measured conditional acceptance | tokens/cycle |",
              "|---|---|---|---|---|---|---|"]
    for name in ("bf16", "4bit"):
        r = res.get(name) or {}
        for pname, sp in (r.get("speculation") or {}).items():
            for k in (1, 2, 3, 4):
                a = sp["arms"][f"capture/d{k}"]
                lines.append(f"| {name} | {pname} | {k} | {a['speedup']['median']:.2f}x | {sp['bound_speedup'][k]:.2f}x | "
                             + " ".join(f"{x:.2f}" for x in a["conditional_acceptance"]) + f" | {a['tokens_per_cycle']:.2f} |")
    for name in ("bf16", "4bit"):
        w = (res.get(name) or {}).get("where_time_goes")
        if not w:
            continue
        g, at, lh = w["gdn_layer"], w["attention_layer"], w["lm_head"]
        lines += ["", f"Where the time goes ({name}): step graph build {1000 * w['step_graph_build_s']:.2f} ms, "
                      f"eval of the prebuilt graph {1000 * w['step_eval_prebuilt_s']:.2f} ms "
                      f"(bound {1000 * w['bound_step_s']:.2f} ms), graph nodes {w.get('step_graph_nodes', '?')}", "",
                  "| part | eager us | compiled us | weight-read bound us |", "|---|---|---|---|",
                  f"| GatedDeltaNet layer (x48) | {1e6 * g['eager_s']:.0f} | "
                  f"{(1e6 * g['compiled_s']) if 'compiled_s' in g else float('nan'):.0f} | {1e6 * g['bound_s']:.0f} |",
                  f"| attention layer (x16) | {1e6 * at['eager_s']:.0f} | - | {1e6 * at['bound_s']:.0f} |",
                  f"| lm_head | {1e6 * lh['eager_s']:.0f} | - | {1e6 * lh['bound_s']:.0f} |",
                  f"| sum of parts | {1000 * w['sum_of_parts_eager_s']:.2f} ms | "
                  f"{1000 * w.get('sum_of_parts_gdn_compiled_s', float('nan')):.2f} ms | {1000 * w['bound_step_s']:.2f} ms |"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
