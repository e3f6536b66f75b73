"""Where a one-row launch of the tensor-core matmul spends its time: copies of
engine/kernels/quant_mma.py whose chunk does less work, timed by a profiler against the real
kernel (bench/device/qmm_ablate_call.sh). Their outputs are wrong by design: they are written to
a folder for one device call and never installed.

    python3 bench/probes/qmm_ablations.py --out DIR        (DIR/qmm_<name>.py for each name below)

- ``nofma``: a nibble pair's two HFMA2 (the offset taken off, then scale and bias) become one
  LOP3 of the same inputs: what the dequantization's arithmetic costs (the 64 HFMA2 of a 4-bit
  chunk's ~226 instructions, sm_90). A layout that applies scale and bias once per group after
  its MMAs would save about that.
- ``nodeq``: a pair's whole dequantization (shift, LOP3, two HFMA2) becomes one LOP3: what any
  cheaper dequantization could save at most.
- ``feed``: the chunk's products (dequantization and MMAs) become an XOR of the words it was fed
  into one accumulator; the weights' shared-memory ring, the scale and bias copies and the
  activations' prefetch stay: how fast the feed alone streams the weights. Near the real kernel's
  time, the feed (latency, blocks in flight) bounds it and no arithmetic saving pays; far below,
  the arithmetic does. (On an H100 it was 87-95% of the kernel's time at one row:
  bench/results/h100_2026-12-07.)
- ``feed_noscale``, ``feed_nox``: ``feed`` without the scale and bias pairs' 4-byte copies (where
  one pair a row serves a chunk: every group size but 32 at 4 bits), or without the activations'
  loads after the first chunk's: which part of the feed its warps wait on.

With ``TILED=1`` the call times each copy also with the scales and biases tiled
(``quant_mma.tile_pairs``, arm "old tiled"): the feed from that layout.

Each copy's kernel source differs, so its name (a hash of the source) does too: MLX compiles it
as a module of its own beside the real one (bench/qmm_graph.py ``--old-source``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "daemon" / "engine" / "kernels" / "quant_mma.py"

_NIBBLE_LOP = 'asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(v) : "r"(q >> (4 * j)), "r"(mask), "r"(magic));  // (a & b) | c\n'
_NIBBLE_RETURN = "    return qmm_fma2<BF>(qmm_fma2<BF>(v, one, neg), s2, b2);\n"
# the chunk's products, from the A fragments' dequantization to the last MMA of a column tile
_PRODUCTS_FROM = "            unsigned A[2][4];\n"
_PRODUCTS_TO = "B[j][2], B[j][3]);\n            }\n"


def products_text(source: str) -> str:
    """The kernel text ``feed`` replaces (the A fragments and the MMAs of qmm_chunk4), or an empty
    string where the markers are gone."""
    start = source.find(_PRODUCTS_FROM)
    end = source.find(_PRODUCTS_TO, start)
    return source[start : end + len(_PRODUCTS_TO)] if start >= 0 and end >= 0 else ""


# XOR of everything the chunk was fed, kept alive through one accumulator (masked to a small
# positive float: never a NaN or an overflow that could slow the adds)
_FEED_ONLY = """            unsigned f = qa ^ qb ^ sa2[a] ^ ba2[a] ^ sb2[a] ^ bb2[a] ^ mask ^ magic;
            #pragma unroll
            for (int j = 0; j < MT; ++j) f ^= B[j][0] ^ B[j][1] ^ B[j][2] ^ B[j][3];
            acc[a][0][0] += __uint_as_float(f & 0x007FFFFFu);
"""
_IMPORT = "from . import custom_kernel_cache\n"
_IMPORT_ABSOLUTE = "from daemon.engine.kernels import custom_kernel_cache\n"

# name -> (old text, new text) pairs, each of which must occur exactly once in the source
ABLATIONS: dict[str, list[tuple[str, str]]] = {
    "nofma": [(_NIBBLE_RETURN, "    return v ^ s2 ^ b2;  // ablation nofma\n")],
    "nodeq": [(_NIBBLE_LOP, "v = 0u;  // ablation nodeq\n"),
              (_NIBBLE_RETURN, "    return q ^ s2 ^ b2;  // ablation nodeq\n")],
    "feed": [(products_text(SOURCE.read_text()) or _PRODUCTS_FROM, _FEED_ONLY)],
}
# The feed's parts, each dropped from ``feed`` in turn: which one its warps wait on.
_SCALE_COPY = "qmm_cp4(sbw0 + (p * NA + a) * 96 * 16, srow[a] + pair);\n"
_X_PREFETCH = "if (m < M && kn >= 0) xw[j][i] = qmm_load16(x + (size_t)m * K + kn + 8 * i, true);\n"
ABLATIONS["feed_noscale"] = ABLATIONS["feed"] + [(_SCALE_COPY, "// ablation feed_noscale: no scale and bias copies\n")]
ABLATIONS["feed_nox"] = ABLATIONS["feed"] + [(_X_PREFETCH, "// ablation feed_nox: no activations after the first chunk's\n")]


def ablated_source(name: str, source: str | None = None) -> str:
    """quant_mma.py's text with ablation ``name`` applied (importable from the repository root)."""
    text = SOURCE.read_text() if source is None else source
    for old, new in [(_IMPORT, _IMPORT_ABSOLUTE), *ABLATIONS[name]]:
        if text.count(old) != 1:
            raise SystemExit(f"ablation {name}: the kernel's text changed ({text.count(old)} places match "
                             f"{old.strip()[:60]!r}); update bench/probes/qmm_ablations.py")
        text = text.replace(old, new)
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="folder for qmm_<name>.py")
    ap.add_argument("--names", default=",".join(ABLATIONS), help="comma-separated: " + ", ".join(ABLATIONS))
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.names.split(","):
        path = args.out / f"qmm_{name}.py"
        path.write_text(ablated_source(name))
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
