"""Which parts of a forward change a row's bits with the rows and positions beside it, and
does councild's invariant attention (daemon/engine/kernels/invariant.py) fix the model's?

Run on a GPU machine (the CPU gives one class everywhere):
    python3 bench/probes/invariance_probe.py [--model daemon/assets/tiny-qwen35] [--out DIR]
Prints a table per part and writes invariance_probe.json:
- sdpa: MLX's fused attention and the invariant kernel, query t of a T-position forward
  ("causal") against the same query alone over its own keys; left-padded rows and rows with
  holes (masked slots mid-sequence) against the row alone.
- conv: the GatedDeltaNet depthwise conv over 3+T positions against one window at a time.
- model: the daemon's start-up probes (verify vs serial through both rollback strategies,
  batched rows of mixed lengths vs M=1 at heights 2-16, ragged batched verify) with MLX's
  attention and with the invariant one.
- cost: ms per serial step, per T=4 verify and per B=4 batched step, and a 2,048-token
  prefill, with each attention (median of several synced runs).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.getcwd())

import mlx.core as mx  # noqa: E402

from daemon.engine.decoders import batch as batch_mod  # noqa: E402
from daemon.engine.decoders import exactness
from daemon.engine.kernels import invariant  # noqa: E402
from daemon.engine.model.compiled import enable_compiled_decode  # noqa: E402
from daemon.engine.model.loading import load_model  # noqa: E402


def same(a, b) -> bool:
    return a.shape == b.shape and mx.array_equal(a, b).item()


def sdpa_impls():
    fused = lambda q, k, v, s, m: mx.fast.scaled_dot_product_attention(q, k, v, scale=s, mask=m)  # noqa: E731
    return {"mlx_fused": fused, "invariant": invariant.invariant_sdpa}


def probe_sdpa(Hq, Hk, D, L0=40, dtype=mx.bfloat16) -> dict:
    mx.random.seed(0)
    out = {}
    for name, f in sdpa_impls().items():
        res = {"positions": {}, "left_padding": None, "holes": None}
        for T in range(1, 9):
            q = mx.random.normal((1, Hq, T, D)).astype(dtype)
            k = mx.random.normal((1, Hk, L0 + T, D)).astype(dtype)
            v = mx.random.normal((1, Hk, L0 + T, D)).astype(dtype)
            full = f(q, k, v, D ** -0.5, "causal" if T > 1 else None)
            ok = all(same(full[:, :, t], f(q[:, :, t:t + 1], k[:, :, :L0 + t + 1], v[:, :, :L0 + t + 1], D ** -0.5, None)[:, :, 0])
                     for t in range(T))
            res["positions"][T] = ok
        # Left padding: rows of lengths 40, 23, 35 padded to 40, T = 1 and 4, vs each row alone.
        for kind in ("left_padding", "holes"):
            oks = []
            for T in (1, 4):
                lens = [40, 23, 35]
                Lb = 40 + T
                rows_k = [mx.random.normal((1, Hk, n + T, D)).astype(dtype) for n in lens]
                rows_v = [mx.random.normal((1, Hk, n + T, D)).astype(dtype) for n in lens]
                qs = mx.random.normal((3, Hq, T, D)).astype(dtype)
                if kind == "left_padding":
                    pad = [Lb - (n + T) for n in lens]
                    kb = mx.concatenate([mx.concatenate([mx.random.normal((1, Hk, p, D)).astype(dtype), x], axis=2) for p, x in zip(pad, rows_k)])
                    vb = mx.concatenate([mx.concatenate([mx.random.normal((1, Hk, p, D)).astype(dtype), x], axis=2) for p, x in zip(pad, rows_v)])
                    keyok = mx.array([[j >= p for j in range(Lb)] for p in pad])
                else:  # every row keeps its keys with 5 garbage slots inserted at 10..14, then padded
                    Lb = 45 + T
                    def holed(x, n):
                        g = mx.random.normal((1, Hk, 5, D)).astype(dtype)
                        y = mx.concatenate([x[:, :, :10], g, x[:, :, 10:]], axis=2)
                        return mx.concatenate([mx.random.normal((1, Hk, Lb - y.shape[2], D)).astype(dtype), y], axis=2)
                    kb = mx.concatenate([holed(x, n) for x, n in zip(rows_k, lens)])
                    vb = mx.concatenate([holed(x, n) for x, n in zip(rows_v, lens)])
                    keyok = []
                    for n in lens:
                        p = Lb - (n + T + 5)
                        keyok.append([j >= p and not (p + 10 <= j < p + 15) for j in range(Lb)])
                    keyok = mx.array(keyok)
                causal = mx.arange(Lb)[None, :] <= mx.arange(Lb - T, Lb)[:, None]  # [T, Lb]
                mask = mx.logical_and(keyok[:, None, None, :], causal[None, None])
                got = f(qs, kb, vb, D ** -0.5, mask)
                for r, n in enumerate(lens):
                    alone = f(qs[r:r + 1], rows_k[r], rows_v[r], D ** -0.5, "causal" if T > 1 else None)
                    oks.append(same(got[r:r + 1], alone))
            res[kind] = all(oks)
        out[name] = res
    return out


def probe_matmul(shapes=((768, 256), (256, 768), (17408, 5120), (5120, 17408)), dtype=mx.bfloat16) -> dict:
    """Row 0 of x[:M] @ w.T for M = 1..16, grouped into classes of identical bits, with MLX's
    matmul and the invariant one; and ms per M=1 and M=4 product (median of 50 synced)."""
    mx.random.seed(2)
    out = {}
    impls = {"mlx": lambda x, w: x @ w.T, "invariant": invariant.invariant_matmul}
    for N, K in shapes:
        w = (mx.random.normal((N, K)) * K ** -0.5).astype(dtype)
        x = mx.random.normal((16, K)).astype(dtype)
        r = {}
        for name, f in impls.items():
            classes: list[list[int]] = []
            reps: list = []
            for M in range(1, 17):
                y = f(x[:M], w)[0]
                mx.eval(y)
                for c, rep in zip(classes, reps):
                    if mx.array_equal(rep, y).item():
                        c.append(M)
                        break
                else:
                    classes.append([M])
                    reps.append(y)
            times = {}
            for M in (1, 4, 16):
                xm = x[:M]
                def run():
                    mx.eval(f(xm, w))
                times[M] = round(timed(run, n=50), 4)
            r[name] = {"classes": classes, "ms": times}
        out[f"{N}x{K}"] = r
    return out


def probe_conv(lm) -> dict:
    layer = next(l for l in lm.backbone.layers if hasattr(l, "linear_attn"))
    conv = layer.linear_attn.conv1d
    C = conv.weight.shape[0]
    K = conv.weight.shape[1]
    mx.random.seed(1)
    res = {}
    for T in range(1, 9):
        x = mx.random.normal((1, K - 1 + T, C)).astype(mx.bfloat16)
        full = conv(x)
        res[T] = all(same(full[:, t], conv(x[:, t:t + K])[:, 0]) for t in range(T))
    xb = mx.random.normal((8, K, C)).astype(mx.bfloat16)
    fb = conv(xb)
    res["rows_1_8"] = all(same(fb[i], conv(xb[i:i + 1])[0]) for i in range(8))
    return res


def model_probes(path: str, attention: str) -> dict:
    lm = load_model(path, compile_decode=False)
    if attention == "invariant":
        invariant.install(lm.text_module)
    reason = enable_compiled_decode(lm)
    lm.decode_path = "compiled" if reason is None else f"eager: {reason}"
    r = {"decode_path": lm.decode_path}
    for strat in ("capture", "snapshot"):
        r[f"verify_{strat}"] = exactness.verify_matches_serial(lm, strat)
    r["batch_max_diff"] = {str(k): v for k, v in batch_mod.max_logit_diff(lm).items()}
    r["ragged_verify"] = exactness.ragged_verify_matches_serial(lm)
    r["cost_ms"] = cost(lm)
    return r


def timed(fn, n=9) -> float:
    fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def cost(lm) -> dict:
    import random

    rng = random.Random(0)
    V = lm.text_args.vocab_size
    prompt = [rng.randrange(V) for _ in range(2048)]
    out = {}

    def prefill():
        c = lm.make_cache()
        for i in range(0, 2048, 512):
            h = lm.prefill_hidden(mx.array([prompt[i:i + 512]], dtype=mx.uint32), c)
            mx.eval(h, [x.state for x in c])
        return c

    out["prefill_2048"] = timed(prefill, n=3)
    cache = prefill()

    def forward_and_trim(tokens: list[int]):
        """One forward of ``tokens`` over the 2,048-token cache, trimmed back after it, so
        every timed run sees the same length (GatedDeltaNet state advances; its cost does not
        depend on it)."""
        block = mx.array([tokens], dtype=mx.uint32)

        def run():
            mx.eval(lm.logits(lm.hidden(block, cache)))
            for c in cache:
                if hasattr(c, "trim") and c.is_trimmable():
                    c.trim(len(tokens))
        return run

    out["step_L2048"] = timed(forward_and_trim([1]), n=21)
    out["verify4_L2048"] = timed(forward_and_trim([1, 2, 3, 4]), n=21)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="daemon/assets/tiny-qwen35")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    print("device", mx.default_device(), "backend", invariant.backend(), flush=True)
    res = {"device": str(mx.default_device()), "backend": invariant.backend(), "mlx": mx.__version__}
    res["sdpa_bundled"] = probe_sdpa(4, 2, 64)
    print("sdpa bundled shape", json.dumps(res["sdpa_bundled"]), flush=True)
    res["sdpa_27b"] = probe_sdpa(24, 4, 256)
    print("sdpa 27B shape", json.dumps(res["sdpa_27b"]), flush=True)
    res["matmul"] = probe_matmul()
    print("matmul", json.dumps(res["matmul"]), flush=True)
    lm = load_model(a.model, compile_decode=False)
    res["conv"] = probe_conv(lm)
    print("conv", json.dumps(res["conv"]), flush=True)
    for att in ("mlx", "invariant"):
        res[f"model_{att}"] = model_probes(a.model, att)
        print(f"model {att}", json.dumps(res[f"model_{att}"]), flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "invariance_probe.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
