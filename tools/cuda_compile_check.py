"""Compile engine/kernels/quant_mma.py's kernel (or, with --gdn, gdn_fused.py's) with nvcc for sm_90
at each launch variant, before any device time is spent: syntax, template and register errors
show here, and ptxas reports each variant's registers and spills (a spilling variant is slow on
the device).

    .venv/bin/python tools/cuda_compile_check.py [--gdn] [--nvcc /usr/local/cuda/bin/nvcc] [--arch sm_90]
    .venv/bin/python tools/cuda_compile_check.py --sass 2:1:1:2:4[:X] --cuobjdump PATH   (one variant's chunk loop, counted)
    .venv/bin/python tools/cuda_compile_check.py --source FILE [--sass ...]   (another quant_mma.py's kernel:
                                                   bench/probes/qmm_ablations.py's copies)
    .venv/bin/python tools/cuda_compile_check.py --nvrtc /path/libnvrtc.so.13 --cuda-include /usr/local/cuda-13.0/include
                                                   (MLX's own generated texts, compiled by NVRTC: the
                                                   library is in PyPI's nvidia-cuda-nvrtc wheel)

MLX wraps a ``cuda_kernel`` source in a function whose parameters are ``const T* name`` plus a
``name_shape`` per input and whose template arguments are constants; this script writes the
same shape of wrapper (shapes as plain int pointers) for every variant it checks. Exit status 0
when every variant compiles without spills."""

from __future__ import annotations

import argparse
import collections
import functools
import importlib.util
import itertools
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


SOURCE: str | None = None  # --source: another quant_mma.py (an ablation's, bench/probes/qmm_ablations.py)


@functools.cache  # loaded once a run (``SOURCE`` is set before the first call)
def quant_mma_module():
    """engine/kernels/quant_mma.py (imported from the repository root: this is a tool, not a
    package), or the ``--source`` file's module."""
    sys.path.insert(0, str(ROOT))
    if SOURCE:
        spec = importlib.util.spec_from_file_location("councild_quant_mma_source", SOURCE)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    from daemon.engine.kernels import quant_mma

    return quant_mma


def kernel_texts(residual: bool = False) -> tuple[str, str]:
    """The header and body as MLX is handed them, from the module (``residual``: the variant that
    adds its input ``res`` as it writes)."""
    qm = quant_mma_module()
    return qm._HEADER, qm.kernel_body(residual)


def wrapper(header: str, body: str, xtype: str, params: dict[str, int]) -> str:
    consts = "\n".join(f"constexpr int {k} = {v};" for k, v in params.items())
    return f"""#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
using T = {xtype};
{consts}
{header}
extern "C" __global__ void qmm(const T* x, const int* x_shape, {"const int x_ndim, " if "x_ndim" in body else ""}const uint32_t* w, const int* w_shape,
                               const T* scales, const int* scales_shape, const T* biases, const int* biases_shape,
                               {"const T* res, const int* res_shape, " if "res[" in body else ""}T* y) {{
{body}
}}
"""


_SHAPES = """struct Shape { int v[8]; __device__ int operator[](int i) const { return v[i]; } };
struct Strides { int64_t v[8]; __device__ int64_t operator[](int i) const { return v[i]; } };
"""


def gdn_wrapper(masked: bool, all_states: bool, conv: bool, xtype: str, params: dict[str, int]) -> str:
    """gdn_fused.py's kernel in the signature MLX gives a ``cuda_kernel`` made with
    ensure_row_contiguous off: every input with its shape and strides where the source names them."""
    sys.path.insert(0, str(ROOT))
    from daemon.engine.kernels import gdn_fused

    source = gdn_fused.kernel_source(masked, all_states, conv)
    ins, outs = gdn_fused.kernel_names(masked, all_states, conv)
    ctype = {"A_log": "float", "state_in": "float", "mask": "bool", "state_out": "float", "states": "float"}
    args = []
    for name in ins:
        args.append(f"const {ctype.get(name, 'T')}* {name}")
        args += [f"const Shape {name}_shape"] * (f"{name}_shape" in source)
        args += [f"const Strides {name}_strides"] * (f"{name}_strides" in source)
    args += [f"{ctype.get(name, 'T')}* {name}" for name in outs]
    consts = "\n".join(f"constexpr int {k} = {v};" for k, v in params.items())
    return f"""#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
using T = {xtype};
{_SHAPES}
extern "C" __global__ void gdn({", ".join(args)}) {{
using InT = T;
{consts}
{source}
}}
"""


def compile_one(args, tmp: str, source: str, tag: str) -> bool:
    """nvcc ``source`` for ``args.arch`` and print one line for it (ptxas's registers and
    spills, or the compiler's errors); True when it failed or spilled."""
    src = Path(tmp) / "k.cu"
    src.write_text(source)
    r = subprocess.run([args.nvcc, f"-arch={args.arch}", "-c", "-o", str(Path(tmp) / "k.o"),
                        "-Xptxas", "-v", str(src)], capture_output=True, text=True)
    if r.returncode:
        print(f"FAIL {tag}\n{r.stderr}")
        return True
    regs = re.search(r"Used (\d+) registers", r.stderr)
    spill = re.search(r"(\d+) bytes spill stores", r.stderr)
    spilled = int(spill.group(1)) if spill else 0
    print(f"{'SPILL' if spilled else 'ok   '} {tag}: {regs.group(1) if regs else '?'} registers, {spilled} bytes spilled")
    return spilled > 0


def gdn_main(args) -> int:
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        for conv, masked, all_states, xtype, Dk in itertools.product(
                (False, True), (False, True), (False, True), ("__nv_bfloat16", "__half", "float"), (64, 128)):
            params = {"Dk": Dk, "Dv": 128, "Hk": 16, "Hv": 48, "KC": 4, "KEY": 16 * Dk}
            bad += compile_one(args, tmp, gdn_wrapper(masked, all_states, conv, xtype, params),
                               f"conv={conv} masked={masked} all_states={all_states} {xtype} Dk={Dk}")
    return 1 if bad else 0


def sass_loop(args) -> int:
    """``--sass S:MT:NA:P:BITS``: the shared-memory feed's chunk loop of one bf16 variant, counted
    by opcode in the compiled SASS (``--cuobjdump``: CUDA's, or PyPI's nvidia-cuda-cuobjdump):
    the loop runs once a chunk, so its instructions, and those on the half-rate integer pipe,
    are what a chunk costs the schedulers."""
    S, MT, NA, P, bits, X, SBT = (*(int(v) for v in args.sass.split(":")), 0, 0)[:7]
    header, body = kernel_texts()
    params = {"XBF": 1, "BITS": bits, "GS": 64, "S": S, "MT": MT, "U": 1, "NA": NA, "P": P, "XPRE": X, "SBT": SBT}
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = Path(tmp) / "k.cu", Path(tmp) / "k.cubin"
        src.write_text(wrapper(header, body, "__nv_bfloat16", params))
        subprocess.run([args.nvcc, f"-arch={args.arch}", "-cubin", "-o", str(cubin), str(src)], check=True)
        sass = subprocess.run([args.cuobjdump, "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout
    code = [(int(m.group(1), 16), m.group(2).strip()) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    wait = next(a for a, op in code if op.startswith("DEPBAR.LE"))  # the loop's first wait for a chunk
    back = next((a, int(m.group(1), 16)) for a, op in code if a > wait
                and (m := re.search(r"BRA (0x[0-9a-f]+)", op)) and int(m.group(1), 16) <= wait)
    loop = [re.sub(r"^@!?U?P\w+ ", "", op).split()[0].split(".")[0] for a, op in code if back[1] <= a <= back[0]]
    counts = collections.Counter(loop)
    integer = sum(counts[k] for k in ("LOP3", "SHF", "IADD3", "LEA", "PRMT", "SEL", "ISETP", "MOV", "VIADD"))
    print(f"{params}: {len(loop)} instructions in the chunk loop, {integer} on the integer pipe")
    print(", ".join(f"{k} {v}" for k, v in counts.most_common()))
    return 0


def nvrtc_texts(args) -> int:
    """``--nvrtc LIB``: MLX's own generated text of the matmul kernel (plain and residual variants,
    as ``mx.fast.cuda_kernel`` would hand it to NVRTC, engine/kernels/mlx_custom_source.py) at the
    daemon's launches for bf16 / fp16, 4 / 8 bits and 1, 4, 12, 32 rows, compiled with that NVRTC
    library and ``--cuda-include`` (its headers and cccl): MLX's signature and the kernel's text
    together, before any device time is spent. Needs mlx (the CPU wheel does)."""
    import mlx.core as mx

    sys.path.insert(0, str(ROOT))
    from daemon.engine.kernels import custom_kernel_cache as cache

    qm = quant_mma_module()
    nvrtc = cache.Nvrtc(args.nvrtc)
    cuda = Path(args.cuda_include)
    folders = [p for p in (Path(mx.__file__).parent / "include", cuda, cuda / "cccl") if p.exists()]
    options = ["--device-as-default-execution-space", f"--gpu-architecture={args.arch}a"]
    options += [f"--include-path={p}" for p in folders]
    N, K, bad = 5120, 6144, 0
    for residual, dtype, bits, rows in itertools.product((False, True), (mx.bfloat16, mx.float16), (4, 8), (1, 4, 12, 32)):
        x = mx.zeros((rows, 1, K), dtype=dtype)
        w = mx.zeros((N, K * bits // 32), dtype=mx.uint32)
        sb = mx.zeros((N, K // 64), dtype=dtype)
        launch = qm._launch((rows, 1), N, K, dtype, bits, 64, None, None, None, None, None, None)
        inputs = [x, w, sb, sb] + ([mx.zeros((rows, 1, N), dtype=dtype)] if residual else [])
        func, text = qm._get_kernel(residual).instantiation(inputs, launch["template"], launch["output_dtypes"])
        tag = f"{'residual' if residual else 'plain'} {dtype} {bits}-bit {rows} rows"
        try:
            code, _ = nvrtc.compile(text, func + ".cu", cache.src.KERNEL_NAMESPACE + func,
                                    {cache.SIGNATURE_HEADER_NAME: cache.SIGNATURE_HEADER}, options, True)
            print(f"ok    {tag}: {len(code)} bytes of SASS")
        except cache.CompileError as e:
            print(f"FAIL  {tag}\n{e}")
            bad += 1
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nvcc", default=shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--gdn", action="store_true", help="gdn_fused.py's recurrence kernel instead")
    ap.add_argument("--sass", metavar="S:MT:NA:P:BITS[:X[:SBT]]", help="count one variant's chunk loop in its SASS instead "
                    "(X: the activations' prefetch, SBT: tiled scales and biases; 0 or 1)")
    ap.add_argument("--cuobjdump", default=shutil.which("cuobjdump") or "/usr/local/cuda/bin/cuobjdump")
    ap.add_argument("--nvrtc", metavar="LIB", help="compile MLX's generated texts with this libnvrtc instead (nvrtc_texts)")
    ap.add_argument("--cuda-include", default="/usr/local/cuda/include", help="with --nvrtc: CUDA's headers (cccl beside)")
    ap.add_argument("--source", metavar="FILE", help="another quant_mma.py's kernel instead of the tree's (an ablation's: bench/probes/qmm_ablations.py)")
    args = ap.parse_args(argv)
    global SOURCE
    SOURCE = args.source
    if args.nvrtc:
        return nvrtc_texts(args)
    if args.gdn:
        return gdn_main(args)
    if args.sass:
        return sass_loop(args)
    header, body = kernel_texts()
    qm = quant_mma_module()
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        for bits, (xtype, xbf), S, MT, U, NA, P, X, SBT in itertools.product(
                (4, 8), (("__nv_bfloat16", 1), ("__half", 0)), (1, 4), (1, 2, 4), (1, 2), (1, 2, 4), (0, 2, 4), (0, 1), (0, 1)):
            if xbf == 0 and (S != 4 or U != 1):
                continue  # fp16: one launch per shape of the rest is enough to catch its errors
            if SBT and (xbf == 0 or S != 4 or U != 1 or NA == 2):
                continue  # tiled scales change only their addresses: the bf16 launches of one split
            if P and (U != 1 or S * P * NA > qm.RING_SLOTS_MAX):
                continue  # the shared-memory feed ignores U; launches cap its ring
            if X and (not P or bits != 4 or MT > qm.PREFETCH_TILES):
                continue  # the activations' prefetch: the 4-bit shared-memory feed's, at few row tiles
            params = {"XBF": xbf, "BITS": bits, "GS": 64, "S": S, "MT": MT, "U": U, "NA": NA, "P": P, "XPRE": X, "SBT": SBT}
            bad += compile_one(args, tmp, wrapper(header, body, xtype, params),
                               " ".join(f"{k}={v}" for k, v in params.items()) + f" {xtype}")
        # The residual variant differs only in its writes: the daemon's launches of each feed.
        header, body = kernel_texts(residual=True)
        for bits, S, MT, NA, P, X in ((4, 4, 1, 1, 2, 1), (4, 4, 1, 1, 2, 0), (4, 4, 2, 1, 2, 0), (4, 3, 4, 4, 2, 0),
                                      (8, 4, 1, 1, 2, 0), (4, 4, 1, 1, 0, 0)):
            params = {"XBF": 1, "BITS": bits, "GS": 64, "S": S, "MT": MT, "U": 1, "NA": NA, "P": P, "XPRE": X, "SBT": 0}
            bad += compile_one(args, tmp, wrapper(header, body, "__nv_bfloat16", params),
                               "residual " + " ".join(f"{k}={v}" for k, v in params.items()))
        # Group size 32 at 4 bits: each lane copies its own four pairs (no SBW), in either layout.
        header, body = kernel_texts()
        for SBT in (0, 1):
            params = {"XBF": 1, "BITS": 4, "GS": 32, "S": 4, "MT": 1, "U": 1, "NA": 1, "P": 2, "XPRE": 1, "SBT": SBT}
            bad += compile_one(args, tmp, wrapper(header, body, "__nv_bfloat16", params),
                               "group 32 " + " ".join(f"{k}={v}" for k, v in params.items()))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
