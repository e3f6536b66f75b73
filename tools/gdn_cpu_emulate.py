"""Run gdn_fused.py's CUDA kernel text on this CPU, against its float32 reference.

    .venv/bin/python tools/gdn_cpu_emulate.py [--cxx g++] [--shapes 1x1,2x3,3x5]

Why: device time is scarce and a machine can be lost mid-call; the kernel's logic (its
indexing, the conv window and padding rows, the q/k warps' shared memory and their barrier,
the conv state it writes, every output written once) can be checked before any GPU runs it.
What: the kernel body exactly as ``kernel_source`` hands it to MLX, wrapped in C++ that plays
CUDA on threads: each block's 128 threads are std::threads (blocks in turn), ``__syncthreads``
a barrier of the block, ``__shfl_xor_sync`` an exchange through a per-warp buffer between two
barriers, ``__shared__`` a static (blocks run one at a time). Activations are float32 (the
kernel's float variant), at a small shape (2 key heads of 64, 4 value heads of 8, a 4-tap
conv). Each variant (the conv folded in or not, masked or not, every token's state or not)
runs at each B x T; the outputs must match ``gated_delta_conv_reference`` (or, for the plain
kernel, ``gated_delta_reference``) to 1e-4 of their range, the conv state bit for bit, and no
output element may be left unwritten. A kernel whose barrier some thread
skipped would hang here, as on the GPU: each run has a timeout.
Not checked here: bfloat16 rounding, speed, and anything about the GPU's memory model beyond
what the barriers order. Exit status 0 when every case passes.
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402

from daemon.engine.kernels import gdn_fused  # noqa: E402

HK, DK, HV, DV, KC = 2, 64, 4, 8, 4
C = 2 * HK * DK + HV * DV
UNWRITTEN = -999.0

_PRELUDE = """
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <thread>
#include <vector>
using InT = float;
constexpr int Dk = %(DK)d, Dv = %(DV)d, Hk = %(HK)d, Hv = %(HV)d, KC = %(KC)d, KEY = %(KEY)d;
struct D3 { int x, y, z; };
thread_local D3 threadIdx, blockIdx;
const D3 blockDim = {32, 4, 1};
static std::barrier<>* block_bar;
static std::barrier<>* warp_bar[4];
static float warp_buf[4][32];
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline void __syncthreads() { block_bar->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int k) {
    const int w = threadIdx.y, l = threadIdx.x;
    warp_buf[w][l] = v;
    warp_bar[w]->arrive_and_wait();
    const float o = warp_buf[w][l ^ k];
    warp_bar[w]->arrive_and_wait();
    return o;
}
#define __shared__ static
template <class T> std::vector<T> load(const char* f) {
    std::ifstream in(f, std::ios::binary);
    std::vector<char> b((std::istreambuf_iterator<char>(in)), {});
    std::vector<T> v(b.size() / sizeof(T));
    std::memcpy(v.data(), b.data(), b.size());
    return v;
}
"""

_MAIN = """
int main() {
    std::ifstream meta("meta.txt");
    int gy, gz;
    meta >> gy >> gz;
%(loads)s
    for (int bz = 0; bz < gz; ++bz) for (int by = 0; by < gy; ++by) {
        std::barrier<> bb(128);
        block_bar = &bb;
        std::vector<std::unique_ptr<std::barrier<>>> wb;
        for (int w = 0; w < 4; ++w) { wb.emplace_back(new std::barrier<>(32)); warp_bar[w] = wb.back().get(); }
        std::vector<std::thread> ts;
        for (int ty = 0; ty < 4; ++ty) for (int tx = 0; tx < 32; ++tx)
            ts.emplace_back([=] { threadIdx = {tx, ty, 0}; blockIdx = {0, by, bz}; kernel(); });
        for (auto& t : ts) t.join();
    }
%(writes)s
    return 0;
}
"""


def build(folder: Path, masked: bool, all_states: bool, cxx: str, conv: bool = True) -> Path:
    """The kernel's variant (the folded conv's, or with ``conv`` False the plain recurrence's)
    as a CPU program in ``folder``; its path."""
    assert gdn_fused.ROWS_PER_BLOCK == 4, "the emulation plays blocks of four warps"
    ins, outs = gdn_fused.kernel_names(masked, all_states, conv)
    decl = [f"const {'bool' if n == 'mask' else 'float'}* {n}; int64_t {n}_shape[8]; int64_t {n}_strides[8];"
            for n in ins] + [f"float* {n};" for n in outs]
    loads = []
    for n in ins:
        kind = "char" if n == "mask" else "float"
        loads.append(f"    static auto v_{n} = load<{kind}>(\"{n}.bin\"); {n} = (decltype({n}))v_{n}.data();")
        loads.append(f"    for (auto& s : {n}_shape) meta >> s; for (auto& s : {n}_strides) meta >> s;")
    for n in outs:
        loads.append(f"    int64_t n_{n}; meta >> n_{n}; static std::vector<float> o_{n}(n_{n}, {UNWRITTEN}f); {n} = o_{n}.data();")
    writes = [f"    {{ std::ofstream f(\"out_{n}.bin\", std::ios::binary); f.write((char*)o_{n}.data(), o_{n}.size() * 4); }}"
              for n in outs]
    src = (_PRELUDE % {"DK": DK, "DV": DV, "HK": HK, "HV": HV, "KC": KC, "KEY": HK * DK} + "\n".join(decl)
           + "\nvoid kernel() {\n" + gdn_fused.kernel_source(masked, all_states, conv) + "\n}\n"
           + _MAIN % {"loads": "\n".join(loads), "writes": "\n".join(writes)})
    (folder / "emu.cpp").write_text(src)
    exe = folder / "emu"
    subprocess.run([cxx, "-std=c++20", "-O1", "-pthread", "-w", "emu.cpp", "-o", str(exe)], cwd=folder, check=True)
    return exe


def run_case(exe: Path, masked: bool, all_states: bool, B: int, T: int, seed: int = 0, conv: bool = True) -> dict:
    """One run of ``exe`` at B x T against the reference (``gated_delta_conv_reference``, or
    ``gated_delta_reference`` for the plain kernel): {output: (relative error, exact, unwritten
    elements)} and "ok"."""
    folder = exe.parent
    ins, outs = gdn_fused.kernel_names(masked, all_states, conv)
    rng = np.random.default_rng(seed)
    wide = rng.standard_normal((B, T, C + 6)).astype(np.float32)
    d = {"qkv": wide[..., 3:3 + C],  # a view, as the merged projection's slice is
         "conv_in": rng.standard_normal((B, KC - 1, C)).astype(np.float32),
         "conv_w": (0.5 * rng.standard_normal((C, KC, 1))).astype(np.float32),
         "ga": rng.standard_normal((B, T, HV)).astype(np.float32),
         "gb": rng.standard_normal((B, T, HV)).astype(np.float32),
         "A_log": np.log(rng.uniform(1, 16, (HV,))).astype(np.float32), "dt_bias": np.ones((HV,), np.float32),
         "state_in": (0.1 * rng.standard_normal((B, HV, DV, DK))).astype(np.float32),
         "mask": np.arange(T)[None, :] >= (np.arange(B)[:, None] % 2)}  # odd rows: first token padding
    plain = gdn_fused.sample_inputs(B, T, HK, HV, DK, DV, mx.float32, mx.random.key(seed))
    d.update({n: np.array(plain[n]) for n in ("q", "k", "v")})
    meta = [DV // 4, B * HV]
    for n in ins:
        arr = d[n]
        base, offset = (wide, 3) if n == "qkv" else (np.ascontiguousarray(arr), 0)
        base.reshape(-1)[offset:].tofile(folder / f"{n}.bin")
        meta += list(arr.shape) + [0] * (8 - arr.ndim) + [s // arr.itemsize for s in arr.strides] + [0] * (8 - arr.ndim)
    sizes = {"y": B * T * HV * DV, "state_out": B * HV * DV * DK, "states": B * T * HV * DV * DK,
             "conv_out": B * (KC - 1) * C}
    meta += [sizes[o] for o in outs]
    (folder / "meta.txt").write_text(" ".join(map(str, meta)))
    subprocess.run([str(exe)], cwd=folder, check=True, timeout=120)
    args = [mx.array(np.ascontiguousarray(d[n])) for n in ins if n != "mask"] + [mx.array(d["mask"]) if masked else None]
    if conv:
        ref = gdn_fused.gated_delta_conv_reference(*args, heads=(HK, DK, HV, DV), all_states=all_states)
    else:
        ref = gdn_fused.gated_delta_reference(*args, all_states=all_states)
    res: dict = {"ok": True}
    for n, r in zip(outs, ref):
        r = np.array(r).reshape(-1)
        got = np.fromfile(folder / f"out_{n}.bin", dtype=np.float32)
        err = float(np.abs(got - r).max() / max(np.abs(r).max(), 1e-6))
        exact = bool(np.array_equal(got, r))
        unwritten = int((got == UNWRITTEN).sum())
        res[n] = (err, exact, unwritten)
        res["ok"] &= err < 1e-4 and unwritten == 0 and (n != "conv_out" or exact)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cxx", default=shutil.which("g++") or "g++")
    ap.add_argument("--shapes", default="1x1,2x3,3x5", help="B x T, comma-separated")
    args = ap.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        for conv, masked, all_states in itertools.product((True, False), (False, True), (False, True)):
            folder = Path(tmp) / f"c{int(conv)}m{int(masked)}a{int(all_states)}"
            folder.mkdir()
            exe = build(folder, masked, all_states, args.cxx, conv)
            for B, T in shapes:
                r = run_case(exe, masked, all_states, B, T, seed=B * 10 + T, conv=conv)
                cells = ", ".join(f"{n} {e:.1e}{' exact' if x else ''}{f' UNWRITTEN {u}' if u else ''}"
                                  for n, (e, x, u) in ((k, v) for k, v in r.items() if k != "ok"))
                print(f"{'ok  ' if r['ok'] else 'FAIL'} conv={conv} masked={masked} all_states={all_states} B{B}T{T}: {cells}")
                bad += not r["ok"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
