"""Compile engine/kernels/quant_mma.py's kernel with nvcc for sm_90 at each launch variant, before any
device time is spent: syntax, template and register errors show here, and ptxas reports each
variant's registers and spills (a spilling variant is slow on the device).

    .venv/bin/python tools/cuda_compile_check.py [--nvcc /usr/local/cuda/bin/nvcc] [--arch sm_90]

MLX wraps a ``cuda_kernel`` source in a function whose parameters are ``const T* name`` plus a
``name_shape`` per input and whose template arguments are constants; this script writes the
same shape of wrapper (shapes as plain int pointers) for every variant it checks. Exit status 0
when every variant compiles without spills."""

from __future__ import annotations

import argparse
import itertools
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def kernel_texts() -> tuple[str, str]:
    """The header and body as MLX is handed them, from the module."""
    sys.path.insert(0, str(ROOT))
    from daemon.engine.kernels import quant_mma

    return quant_mma._HEADER, quant_mma._SOURCE


def wrapper(header: str, body: str, xtype: str, params: dict[str, int]) -> str:
    consts = "\n".join(f"constexpr int {k} = {v};" for k, v in params.items())
    return f"""#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
using T = {xtype};
{consts}
{header}
extern "C" __global__ void qmm(const T* x, const int* x_shape, const uint32_t* w, const int* w_shape,
                               const T* scales, const int* scales_shape, const T* biases, const int* biases_shape,
                               T* y) {{
{body}
}}
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nvcc", default=shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc")
    ap.add_argument("--arch", default="sm_90")
    args = ap.parse_args(argv)
    header, body = kernel_texts()
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        for bits, (xtype, xbf), S, MT, U, NA in itertools.product(
                (4, 8), (("__nv_bfloat16", 1), ("__half", 0)), (1, 4), (1, 2, 4), (1, 2), (1, 2, 4)):
            if xbf == 0 and (S != 4 or U != 1):
                continue  # fp16: one launch per shape of the rest is enough to catch its errors
            params = {"XBF": xbf, "BITS": bits, "GS": 64, "S": S, "MT": MT, "U": U, "NA": NA}
            src = Path(tmp) / "k.cu"
            src.write_text(wrapper(header, body, xtype, params))
            r = subprocess.run([args.nvcc, f"-arch={args.arch}", "-c", "-o", str(Path(tmp) / "k.o"),
                                "-Xptxas", "-v", str(src)], capture_output=True, text=True)
            info = r.stderr
            regs = re.search(r"Used (\d+) registers", info)
            spill = re.search(r"(\d+) bytes spill stores", info)
            spilled = int(spill.group(1)) if spill else 0
            tag = " ".join(f"{k}={v}" for k, v in params.items())
            if r.returncode:
                bad += 1
                print(f"FAIL {tag}\n{info}")
                continue
            if spilled:
                bad += 1
            print(f"{'SPILL' if spilled else 'ok   '} {tag} {xtype}: {regs.group(1) if regs else '?'} registers, "
                  f"{spilled} bytes spilled")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
