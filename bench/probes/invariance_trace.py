"""Where, inside the model, a T-position forward first differs from T one-token steps (or
a batched row from the row alone), module by module. GPU machine:
    python3 bench/probes/invariance_trace.py [--model DIR] [--attention mlx|invariant] [--out DIR]
Every Linear, RMSNorm, gated norm, conv, RoPE, MLP and mixer call is recorded in order for
the serial steps and for the verify; the table lists each recorded call whose output for a
position differs, first ones first (later ones inherit the first difference). Then each op
alone on random inputs: row t of an op over T rows against the op over that row only.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import random
import sys

sys.path.insert(0, os.getcwd())

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from daemon.engine.kernels import invariant  # noqa: E402
from daemon.engine.model.loading import load_model  # noqa: E402

REC: list | None = None
NAMES: dict[int, str] = {}


def wrap(cls, axis: int):
    orig = cls.__call__

    def call(self, *a, **k):
        out = orig(self, *a, **k)
        if REC is not None and isinstance(out, mx.array):
            REC.append((NAMES.get(id(self), cls.__name__), axis, out))
        return out
    cls.__call__ = call


def main() -> int:
    global REC
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="daemon/assets/tiny-qwen35")
    ap.add_argument("--attention", default="invariant")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    lm = load_model(a.model, compile_decode=False)
    if a.attention == "invariant":
        invariant.install(lm.text_module)
    for name, m in lm.backbone.named_modules():
        NAMES[id(m)] = name
    classes = {type(m) for _, m in lm.backbone.named_modules()}
    for cls in classes:
        if cls.__name__ in ("Linear", "InvariantLinear", "QuantizedLinear", "RMSNorm", "Qwen3NextRMSNormGated", "Conv1d", "GatedDeltaNet",
                            "InvariantAttention", "Qwen3NextAttention", "Qwen3NextMLP", "Embedding", "DecoderLayer"):
            wrap(cls, 1)
        elif "RoPE" in cls.__name__ or "Rope" in cls.__name__:
            wrap(cls, 2)
    rng = random.Random(0)
    V = lm.text_args.vocab_size
    prompt = [rng.randrange(V) for _ in range(33)]
    block = [rng.randrange(V) for _ in range(4)]
    base = lm.make_cache()
    mx.eval(lm.hidden(mx.array([prompt], dtype=mx.uint32), base))
    report = {"attention": a.attention, "verify": [], "batch": []}
    # serial steps
    c = copy.deepcopy(base)
    steps = []
    for tok in block:
        REC = []
        mx.eval(lm.hidden(mx.array([[tok]], dtype=mx.uint32), c))
        steps.append(REC)
    REC = []
    c = copy.deepcopy(base)
    mx.eval(lm.hidden(mx.array([block], dtype=mx.uint32), c))
    ver = REC
    REC = None
    print("calls serial", len(steps[0]), "verify", len(ver))
    for i, (name, axis, out) in enumerate(ver):
        bad = []
        for t in range(len(block)):
            if i >= len(steps[t]) or steps[t][i][0] != name:
                bad.append(f"t{t}:misaligned")
                continue
            s = steps[t][i][2]
            v = mx.take(out, mx.array([out.shape[axis] - len(block) + t]), axis=axis) if out.shape[axis] != s.shape[axis] else None
            if v is None:
                v = mx.take(out, mx.array([t]), axis=axis)
            if s.shape[axis] != 1:  # conv over a window: compare its last position
                s = mx.take(s, mx.array([s.shape[axis] - 1]), axis=axis)
            if v.shape != s.shape or not mx.array_equal(v, s).item():
                bad.append(t)
        if bad:
            report["verify"].append([i, name, bad])
    for row in report["verify"][:25]:
        print("verify differs:", row)
    # ops alone: row t of T rows vs that row alone, for every distinct module type/shape
    ops = {}
    mx.random.seed(3)
    for name, m in lm.backbone.named_modules():
        kind = type(m).__name__
        if kind not in ("Linear", "InvariantLinear", "QuantizedLinear", "RMSNorm"):
            continue
        dim = m.weight.shape[-1] if kind != "RMSNorm" else m.weight.shape[0]
        if kind == "QuantizedLinear":
            dim = m.weight.shape[-1] * 32 // m.bits
        key = f"{kind}{tuple(m.weight.shape)}"
        if key in ops:
            continue
        res = {}
        for T in (2, 4, 8, 16):
            x = mx.random.normal((1, T, dim)).astype(mx.bfloat16)
            y = m(x)
            res[T] = all(mx.array_equal(y[:, t], m(x[:, t:t + 1])[:, 0]).item() for t in range(T))
            xb = x.reshape(T, 1, dim)
            yb = m(xb)
            res[f"B{T}"] = all(mx.array_equal(yb[t], m(xb[t:t + 1])[0]).item() for t in range(T))
        ops[key] = res
    # rope, scalar offset vs positions, and per-row array offsets
    attn = next(l.self_attn for l in lm.backbone.layers if hasattr(l, "self_attn"))
    x = mx.random.normal((1, attn.num_attention_heads, 4, attn.head_dim)).astype(mx.bfloat16)
    y = attn.rope(x, offset=40)
    ops["rope_T"] = all(mx.array_equal(y[:, :, t], attn.rope(x[:, :, t:t + 1], offset=40 + t)[:, :, 0]).item() for t in range(4))
    xb = mx.random.normal((3, attn.num_attention_heads, 1, attn.head_dim)).astype(mx.bfloat16)
    offs = [40, 7, 33]
    yb = attn.rope(xb, offset=mx.array(offs))
    ops["rope_rows_array_offset"] = all(mx.array_equal(yb[i], attn.rope(xb[i:i + 1], offset=o)[0]).item() for i, o in enumerate(offs))
    report["ops"] = ops
    print("ops", json.dumps(ops))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"invariance_trace_{a.attention}.json"), "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
