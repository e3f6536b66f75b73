"""Does MLX read the custom kernels the daemon writes, and do they compute the same bits?
(engine/kernels/custom_kernel_cache.py; CUDA only.)

Three fresh processes run every custom kernel the daemon has (the GatedDeltaNet recurrence and
its folded-conv form, masked and with every state; the fixed-order attention and matmul; the
fixed-order 4-bit matmul, scalar and on the tensor cores; 8-bit on the tensor cores) on the same
random inputs:
- ``mlx``: the cache off, an empty PTX folder: MLX compiles each kernel itself (as before);
- ``write``: the cache on, an empty folder: the daemon compiles and writes each, MLX reads it;
  for each instantiation MLX's own generated text (``verbose=True``, read from fd 1) is compared
  with the text mlx_custom_source.py builds: the same text is the same module name;
- ``read``: the cache on, the folder ``write`` filled: nothing compiles.
Each case's first call is timed (graph, compile or read, the launch); the outputs of the three
are compared bit for bit.

    PYTHONPATH=$PWD python3 bench/probes/custom_kernel_cache.py --json $OUT/custom_kernel_cache.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def cases():
    import mlx.core as mx

    from daemon.engine.kernels import gdn_fused, invariant, invariant_quant

    key = mx.random.key(7)
    Hk, Hv, Dk, Dv, KC = 2, 4, 128, 128, 4
    out = {}
    for B, T, masked, all_states in [(1, 1, False, False), (2, 3, True, False), (2, 3, False, True)]:
        s = gdn_fused.sample_inputs(B, T, Hk, Hv, Dk, Dv, mx.bfloat16, key)
        A_log = mx.random.normal((Hv,), key=mx.random.key(1)).astype(mx.float32)
        dt_bias = mx.random.normal((Hv,), key=mx.random.key(2)).astype(mx.bfloat16)
        mask = mx.array([[True] * T, [False] + [True] * (T - 1)]) if masked else None
        tag = f"B{B}T{T}{'_mask' if masked else ''}{'_all' if all_states else ''}"
        out[f"gdn_{tag}"] = lambda s=s, A_log=A_log, dt_bias=dt_bias, mask=mask, all_states=all_states: gdn_fused.gated_delta_fused(
            s["q"], s["k"], s["v"], s["a"], s["b"], A_log, dt_bias, s["state"], mask, all_states=all_states)
        C = 2 * Hk * Dk + Hv * Dv
        qkv = mx.random.normal((B, T, C), key=mx.random.key(3)).astype(mx.bfloat16)
        conv_state = mx.random.normal((B, KC - 1, C), key=mx.random.key(4)).astype(mx.bfloat16)
        conv_w = (mx.random.normal((C, KC, 1), key=mx.random.key(5)) * 0.3).astype(mx.bfloat16)
        out[f"gdn_conv_{tag}"] = lambda s=s, qkv=qkv, cs=conv_state, cw=conv_w, A_log=A_log, dt_bias=dt_bias, mask=mask, all_states=all_states: (
            gdn_fused.gated_delta_conv_fused(qkv, cs, cw, s["a"], s["b"], A_log, dt_bias, s["state"], mask,
                                             heads=(Hk, Dk, Hv, Dv), all_states=all_states))
    q = mx.random.normal((1, 8, 3, 64), key=mx.random.key(8)).astype(mx.bfloat16)
    k = mx.random.normal((1, 2, 40, 64), key=mx.random.key(9)).astype(mx.bfloat16)
    v = mx.random.normal((1, 2, 40, 64), key=mx.random.key(10)).astype(mx.bfloat16)
    out["sdpa_causal"] = lambda: (invariant.invariant_sdpa(q, k, v, 0.125, "causal"),)
    x = mx.random.normal((3, 256), key=mx.random.key(11)).astype(mx.bfloat16)
    w = mx.random.normal((512, 256), key=mx.random.key(12)).astype(mx.bfloat16)
    out["matmul"] = lambda: (invariant.invariant_matmul(x, w),)
    for bits in (4, 8):
        wq, scales, biases = mx.quantize(w, group_size=64, bits=bits)
        for M in (1, 5):
            xm = x[:1] if M == 1 else mx.concatenate([x, x[:2]])
            out[f"qmm{bits}_mma_M{M}"] = lambda xm=xm, wq=wq, s=scales, b=biases, bits=bits: (
                invariant_quant.quantized_matmul(xm, wq, s, b, 64, bits, "cuda"),)
        if bits == 4:
            out["qmm4_scalar"] = lambda wq=wq, s=scales, b=biases: (
                invariant_quant.quantized_matmul(x, wq, s, b, 64, 4, "cuda", scalar=True),)
    return out


class StdoutCapture:
    """MLX prints a kernel's generated text with std::cout: read it from fd 1."""

    def __enter__(self):
        sys.stdout.flush()
        self.file = tempfile.TemporaryFile()
        self.saved = os.dup(1)
        os.dup2(self.file.fileno(), 1)
        return self

    def __exit__(self, *exc):
        import ctypes

        ctypes.CDLL(None).fflush(None)
        os.dup2(self.saved, 1)
        os.close(self.saved)
        self.file.seek(0)
        self.text = self.file.read().decode(errors="replace")


def check_texts() -> list[dict]:
    """Wrap every CachedCudaKernel call so that each new instantiation's text is compared with MLX's."""
    from daemon.engine.kernels import custom_kernel_cache as ckc

    checked: list[dict] = []
    seen: set = set()
    real_call = ckc.CachedCudaKernel.__call__

    def call(self, *, inputs, output_dtypes, template=None, **launch):
        func, ours = self.instantiation(inputs, template, output_dtypes)
        if func not in seen:
            seen.add(func)
            with StdoutCapture() as cap:
                self._kernel(inputs=inputs, output_dtypes=output_dtypes, template=template, verbose=True, **launch)
            body = cap.text.split("```\n", 1)[-1].rsplit("\n```", 1)[0]
            checked.append({"kernel": func, "same_text": body == ours, "chars": len(ours),
                            "first_difference": next((i for i, (a, b) in enumerate(zip(body, ours)) if a != b), None)})
        return real_call(self, inputs=inputs, output_dtypes=output_dtypes, template=template, **launch)

    ckc.CachedCudaKernel.__call__ = call
    return checked


def phase(name: str, ptx: Path, outputs: Path) -> dict:
    os.environ["MLX_PTX_CACHE_DIR"] = str(ptx)
    import mlx.core as mx

    from daemon.engine.kernels import custom_kernel_cache as ckc

    ckc.CACHE.configure(name != "mlx")
    texts = check_texts() if name == "write" else []
    timings, arrays = {}, {}
    for label, fn in cases().items():
        t = time.perf_counter()
        result = fn()
        mx.eval(*result)
        timings[label] = round(time.perf_counter() - t, 4)
        for i, a in enumerate(result):
            arrays[f"{label}.{i}"] = a
    mx.savez(str(outputs), **arrays)
    return {"phase": name, "first_call_s": timings, "total_s": round(sum(timings.values()), 3),
            "cache": ckc.CACHE.summary(), "texts": texts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "custom-kernel-cache")
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    ap.add_argument("--ptx", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase:
        print(json.dumps(phase(args.phase, args.ptx, args.work / f"{args.phase}.npz")))
        return
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    runs = []
    for name, ptx in [("mlx", args.work / "ptx-mlx"), ("write", args.work / "ptx"), ("read", args.work / "ptx")]:
        done = subprocess.run([sys.executable, __file__, "--phase", name, "--ptx", str(ptx), "--work", str(args.work)],
                              capture_output=True, text=True, timeout=900)
        if done.returncode:
            print(done.stdout[-3000:], done.stderr[-3000:])
            raise SystemExit(f"phase {name} failed")
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        r = runs[-1]
        print(f"{name:6s} first calls {r['total_s']:7.3f} s  cache {r['cache']}")
    import mlx.core as mx

    ref = mx.load(str(args.work / "mlx.npz"))
    same = {}
    for name in ("write", "read"):
        got = mx.load(str(args.work / f"{name}.npz"))
        same[name] = {k: bool(mx.array_equal(ref[k], got[k]).item()) for k in ref}
        print(f"{name}: {sum(same[name].values())}/{len(ref)} outputs bit-identical to MLX's own compile")
    texts = runs[1]["texts"]
    print(f"texts: {sum(t['same_text'] for t in texts)}/{len(texts)} instantiations with MLX's text")
    files = sorted(p.name for p in (args.work / "ptx").glob("custom_kernel_*.ptx"))
    for label in runs[0]["first_call_s"]:
        print(f"  {label:28s} " + "  ".join(f"{r['phase']} {r['first_call_s'][label]:7.3f}" for r in runs))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"mlx": mx.__version__, "device": str(mx.default_device()), "runs": runs,
                                         "bit_identical": same, "files": files}, indent=1))


if __name__ == "__main__":
    main()
