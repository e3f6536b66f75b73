"""The fused GatedDeltaNet recurrence (engine/kernels/gdn_fused.py) on the device: is it right,
is it invariant, what does it save. One process, sections in order, JSON after each:

    PYTHONPATH=/tmp/site:$PWD python3 bench/gdn_check.py --out DIR [--budget 240]

1. numerics: the kernel against ``gated_delta_reference`` (the same arithmetic in plain
   float32 ops, on the same device) at the 27B shape and the bundled model's, B 1/3/8,
   T 1/2/5, masked and not: max |y - y_ref| / max |y_ref|, max |S - S_ref|;
2. invariance, bit for bit: T tokens in one call against T calls of one token; a row of a
   batch of 5 against the row alone; the last of ``all_states`` against the state;
3. strided: inputs that are views (slices of a merged projection's output, a transpose, a
   slice of ``all_states``) give the bits of the same inputs made contiguous;
4. conv: the kernel with the conv folded in against its reference, and its invariance (as 1-3);
5. one layer's recurrence, host and GPU: mlx-lm's path (``gated_delta_update``: gates, ops,
   per-token loop) against the kernel, 48 independent layers per step (the 27B step's count),
   build / encode / total ms (bench/step_split.py's split), B x T of 1x1, 4x1, 4x2, 8x1; and
   the conv in MLX's ops before the kernel against the conv folded in;
6. the bundled model with its layers on the kernel (conv folded): the exactness probes the daemon runs at
   start (verify through capture and snapshot, batch, ragged verify) and greedy tokens
   against MLX's ops path (agreement is information: the two round differently).
Prints a table per section.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import mlx.core as mx  # noqa: E402
from mlx_lm.models.gated_delta import gated_delta_update  # noqa: E402

from daemon.engine.kernels import gdn_fused, gdn_layer  # noqa: E402
from step_split import med, split_time  # noqa: E402

T0 = time.perf_counter()
R: dict = {"argv": sys.argv[1:], "errors": [], "mlx": mx.__version__}
SHAPES = {"27b": (16, 48, 128, 128), "bundled": (4, 4, 64, 64)}  # Hk, Hv, Dk, Dv


def save(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gdn_check.json").write_text(json.dumps(R, indent=1, default=str))


def inputs(B: int, T: int, shape: str, seed: int) -> dict:
    Hk, Hv, Dk, Dv = SHAPES[shape]
    bf = mx.bfloat16
    d = gdn_fused.sample_inputs(B, T, Hk, Hv, Dk, Dv, bf, mx.random.key(seed))
    d["A_log"] = mx.log(mx.random.uniform(1, 16, (Hv,), key=mx.random.key(seed + 1))).astype(bf)
    d["dt_bias"] = mx.ones((Hv,), dtype=bf)
    mx.eval(list(d.values()))
    return d


def call(fn, d: dict, mask=None, all_states=False, state=None):
    return fn(d["q"], d["k"], d["v"], d["a"], d["b"], d["A_log"], d["dt_bias"],
              d["state"] if state is None else state, mask, all_states=all_states)


def numerics() -> list:
    rows = []
    for shape in SHAPES:
        for B in (1, 3, 8):
            for T in (1, 2, 5):
                for masked in (False, True):
                    d = inputs(B, T, shape, seed=B * 100 + T)
                    mask = (mx.arange(T)[None, :] >= (mx.arange(B)[:, None] % T)) if masked else None
                    y, s, every = call(gdn_fused.gated_delta_fused, d, mask, True)
                    yr, sr, er = call(gdn_fused.gated_delta_reference, d, mask, True)
                    f = mx.float32
                    row = {"shape": shape, "B": B, "T": T, "masked": masked,
                           "y_rel": (mx.abs(y.astype(f) - yr.astype(f)).max() / mx.abs(yr.astype(f)).max()).item(),
                           "state_abs": mx.abs(s - sr).max().item(), "states_abs": mx.abs(every - er).max().item()}
                    rows.append(row)
    return rows


def invariance() -> list:
    rows = []
    for shape in SHAPES:
        d = inputs(5, 4, shape, seed=7)
        y, s, every = call(gdn_fused.gated_delta_fused, d, None, True)
        st, ys = d["state"], []
        for t in range(4):
            one = {**d, **{n: d[n][:, t:t + 1] for n in ("q", "k", "v", "a", "b")}}
            yt, st = call(gdn_fused.gated_delta_fused, one, state=st)
            ys.append(yt)
        y_steps = mx.concatenate(ys, axis=1)
        alone = {**d, **{n: d[n][2:3] for n in ("q", "k", "v", "a", "b", "state")}}
        y1, s1 = call(gdn_fused.gated_delta_fused, alone)
        rows.append({"shape": shape,
                     "steps_equal_one_call": bool(mx.array_equal(y, y_steps).item() and mx.array_equal(s, st).item()),
                     "row_alone_equals_batched": bool(mx.array_equal(y1, y[2:3]).item() and mx.array_equal(s1, s[2:3]).item()),
                     "last_of_all_states_is_state": bool(mx.array_equal(every[:, -1], s).item())})
    return rows


def strided() -> list:
    """Inputs that are views, as the daemon hands them over: v, a and b as slices of one wider
    buffer (a merged projection's output, the conv's), q and k through a transpose, the state a
    slice of ``all_states``; the kernel reads them by their strides. Bit for bit against the
    same inputs made contiguous, and against the reference."""
    rows = []
    for shape in SHAPES:
        Hk, Hv, Dk, Dv = SHAPES[shape]
        for B, T in ((1, 1), (4, 1), (4, 3)):
            d = inputs(B, T, shape, seed=11 * B + T)
            wide = mx.concatenate([d["b"], d["v"].reshape(B, T, -1), d["a"], d["b"]], axis=-1)
            mx.eval(wide)
            v = wide[..., Hv:Hv + Hv * Dv].reshape(B, T, Hv, Dv)
            a, b = wide[..., Hv + Hv * Dv:2 * Hv + Hv * Dv], wide[..., :Hv]
            qt = mx.contiguous(d["q"].transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
            _, _, every = call(gdn_fused.gated_delta_fused, d, None, True)
            state = every[:, -1]  # a view into [B, T, Hv, Dv, Dk]
            views = {**d, "v": v, "a": a, "b": b, "q": qt}
            y, s = call(gdn_fused.gated_delta_fused, views, state=state)
            dense = {n: mx.contiguous(x) for n, x in views.items()}
            yc, sc = call(gdn_fused.gated_delta_fused, dense, state=mx.contiguous(state))
            yr, sr = call(gdn_fused.gated_delta_reference, dense, state=mx.contiguous(state))
            f = mx.float32
            rows.append({"shape": shape, "B": B, "T": T,
                         "views_equal_contiguous": bool(mx.array_equal(y, yc).item() and mx.array_equal(s, sc).item()),
                         "y_rel": (mx.abs(y.astype(f) - yr.astype(f)).max() / mx.abs(yr.astype(f)).max()).item(),
                         "state_abs": mx.abs(s - sr).max().item()})
    return rows


def conv_inputs(B: int, T: int, shape: str, seed: int) -> dict:
    """Inputs of the folded kernel (qkv from the projection, a conv state, a depthwise conv
    weight) beside the recurrence's, in bfloat16; qkv a view of a wider buffer, as the
    merged projection hands it over."""
    Hk, Hv, Dk, Dv = SHAPES[shape]
    C = 2 * Hk * Dk + Hv * Dv
    d = inputs(B, T, shape, seed)
    ks = mx.random.split(mx.random.key(seed + 7), 3)
    wide = mx.random.normal((B, T, C + 2 * Hv), key=ks[0]).astype(mx.bfloat16)
    d.update(qkv=wide[..., Hv:Hv + C], conv_state=mx.random.normal((B, 3, C), key=ks[1]).astype(mx.bfloat16),
             conv_w=(0.5 * mx.random.normal((C, 4, 1), key=ks[2])).astype(mx.bfloat16), heads=(Hk, Dk, Hv, Dv))
    mx.eval([x for x in d.values() if isinstance(x, mx.array)])
    return d


def conv_call(fn, d: dict, mask=None, all_states=False, **over):
    d = {**d, **over}
    return fn(d["qkv"], d["conv_state"], d["conv_w"], d["a"], d["b"], d["A_log"], d["dt_bias"], d["state"], mask,
              heads=d["heads"], all_states=all_states)


def conv() -> list:
    """The kernel with the conv folded in (``gated_delta_conv_fused``): against its float32
    reference on the device (y, state; the conv state it leaves bit for bit), masked and not;
    bit for bit, T tokens in one call against T calls, a row of a batch of 5 against the row
    alone, qkv as a view against qkv contiguous."""
    rows = []
    f = mx.float32
    for shape in SHAPES:
        for B, T in ((1, 1), (3, 2), (5, 5)):
            d = conv_inputs(B, T, shape, seed=100 * B + T)
            for masked in (False, True):
                mask = (mx.arange(T)[None, :] >= (mx.arange(B)[:, None] % 2)) if masked else None
                y, s, every, c = conv_call(gdn_fused.gated_delta_conv_fused, d, mask, True)
                yr, sr, er, cr = conv_call(gdn_fused.gated_delta_conv_reference, d, mask, True)
                row = {"shape": shape, "B": B, "T": T, "masked": masked,
                       "y_rel": (mx.abs(y.astype(f) - yr.astype(f)).max() / mx.abs(yr.astype(f)).max()).item(),
                       "state_abs": mx.abs(s - sr).max().item(), "states_abs": mx.abs(every - er).max().item(),
                       "conv_state_equal": bool(mx.array_equal(c, cr).item())}
                if not masked:
                    cs, st, ys = d["conv_state"], d["state"], []
                    for t in range(T):
                        yt, st, cs = conv_call(gdn_fused.gated_delta_conv_fused, d, conv_state=cs, state=st,
                                               **{n: d[n][:, t:t + 1] for n in ("qkv", "a", "b")})
                        ys.append(yt)
                    one = {n: d[n][B - 1:] for n in ("qkv", "conv_state", "a", "b", "state")}
                    y1, s1, c1 = conv_call(gdn_fused.gated_delta_conv_fused, d, **one)
                    yc, sc, cc = conv_call(gdn_fused.gated_delta_conv_fused, d, qkv=mx.contiguous(d["qkv"]))
                    row.update(steps_equal_one_call=bool(mx.array_equal(mx.concatenate(ys, axis=1), y).item()
                                                         and mx.array_equal(st, s).item() and mx.array_equal(cs, c).item()),
                               row_alone_equals_batched=bool(mx.array_equal(y1, y[B - 1:]).item()
                                                             and mx.array_equal(s1, s[B - 1:]).item()),
                               view_equals_contiguous=bool(mx.array_equal(yc, y).item() and mx.array_equal(sc, s).item()))
                rows.append(row)
    return rows


def unfolded(d: dict) -> mx.array:
    """The conv in MLX's ops (as forward.gdn_conv_qkv: the conv, SiLU, split, normalize_qk)
    and then the fused recurrence: what the folded kernel replaces."""
    from mlx_lm.models.gated_delta import normalize_qk

    Hk, Dk, Hv, Dv = d["heads"]
    B, T, _ = d["qkv"].shape
    conv_input = mx.concatenate([d["conv_state"], d["qkv"]], axis=1)
    kept = mx.contiguous(conv_input[:, -3:, :])
    out = mx.conv1d(conv_input, d["conv_w"], groups=d["qkv"].shape[-1])
    out = out * mx.sigmoid(out)
    q, k, v = mx.split(out, [Hk * Dk, 2 * Hk * Dk], -1)
    q, k = normalize_qk(q.reshape(B, T, Hk, Dk), k.reshape(B, T, Hk, Dk), inv_scale=Dk**-0.5, eps=1e-6)
    y, _ = gdn_fused.gated_delta_fused(q, k, v.reshape(B, T, Hv, Dv), d["a"], d["b"], d["A_log"], d["dt_bias"],
                                       d["state"])
    return y, kept


def layer_timing(layers: int = 48) -> list:
    rows = []
    for B, T in ((1, 1), (4, 1), (4, 2), (8, 1)):
        ds = [inputs(B, T, "27b", seed=i) for i in range(layers)]
        arms = {
            "mlx-lm ops": lambda: [gated_delta_update(d["q"], d["k"], d["v"], d["a"], d["b"], d["A_log"],
                                                      d["dt_bias"], d["state"])[0] for d in ds],
            "fused": lambda: [call(gdn_fused.gated_delta_fused, d)[0] for d in ds]}
        cds = [conv_inputs(B, T, "27b", seed=i) for i in range(layers)]
        arms["conv in ops + fused"] = lambda: [unfolded(d) for d in cds]
        arms["conv folded"] = lambda: [conv_call(gdn_fused.gated_delta_conv_fused, d)[::2] for d in cds]
        for name, fn in arms.items():
            runs = [split_time(fn) for _ in range(7)]
            rows.append({"arm": name, "BxT": f"{B}x{T}", "layers": layers, **med(runs[2:])})
    return rows


def bundled_probes() -> dict:
    from daemon.engine.decoders.batch import batch_matches_serial
    from daemon.engine.decoders.exactness import ragged_verify_matches_serial, verify_matches_serial
    from daemon.engine.model.loading import load_model
    from mlx_lm.models.cache import make_prompt_cache

    lm = load_model(ROOT / "daemon/assets/tiny-qwen35", compile_decode=False)

    def greedy(n: int = 48) -> list[int]:
        cache = make_prompt_cache(lm.text_module)
        tok = mx.array([[9707, 11, 1246, 525, 498, 30, 358]])
        out = []
        for _ in range(n):
            nxt = mx.argmax(lm.logits(lm.hidden(tok, cache)[:, -1:]), axis=-1)
            out.append(nxt.item())
            tok = nxt.reshape(1, 1)
        return out

    ops_tokens = greedy()
    refused = gdn_layer.refusal(lm.text_module)
    res: dict = {"refusal": refused}
    if refused is not None:
        return res
    res["layers"] = gdn_layer.install(lm.text_module, conv_recurrence=gdn_fused.gated_delta_conv_fused)
    res["conv_self_check"] = gdn_layer.conv_self_check(lm.text_module)
    fused_tokens = greedy()
    same = next((i for i, (x, y) in enumerate(zip(ops_tokens, fused_tokens)) if x != y), len(ops_tokens))
    res["greedy_tokens_equal_prefix"] = f"{same}/{len(ops_tokens)}"
    for name, fn in (("verify_capture", lambda: verify_matches_serial(lm, "capture")),
                     ("verify_snapshot", lambda: verify_matches_serial(lm, "snapshot")),
                     ("batch_8", lambda: batch_matches_serial(lm, 8)),
                     ("ragged_verify", lambda: ragged_verify_matches_serial(lm))):
        t = time.perf_counter()
        res[name] = fn()
        res[name + "_s"] = round(time.perf_counter() - t, 2)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/out/gdn_check")
    ap.add_argument("--sections", default="numerics,invariance,strided,conv,layer_timing,bundled_probes")
    args = ap.parse_args(argv)
    out = Path(args.out)
    R["refusal"] = gdn_fused.backend_refusal()
    if R["refusal"] is not None:
        print(f"no kernel here: {R['refusal']}")
        save(out)
        return 2
    for name in args.sections.split(","):
        t = time.perf_counter()
        try:
            R[name] = globals()[name]()
        except Exception:  # noqa: BLE001 - a section's failure is a result; the others run
            R["errors"].append(f"{name}: " + traceback.format_exc())
            print(R["errors"][-1], file=sys.stderr)
        R[name + "_s"] = round(time.perf_counter() - t, 1)
        print(f"\n## {name} ({R[name + '_s']} s)")
        got = R.get(name)
        for row in got if isinstance(got, list) else [got]:
            print(json.dumps(row, default=str))
        save(out)
    R["wall_s"] = time.perf_counter() - T0
    save(out)
    return 1 if R["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
