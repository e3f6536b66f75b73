"""Solo speculation by depth on MLX's kernels or on the invariant kernels: what the invariant
kernels cost a lone request.

    python3 bench/spec_kernels.py {mlx|invariant} [councild bench spec arguments]

Runs ``councild bench spec`` (serial vs speculative decode at each depth, interleaved) with
the loaded model's kernels set as the daemon's ``kernels`` setting sets them
(kernel_choice.swap_kernels: install, re-trace the compiled decode). Why: on the H200 the daemon's
governor measured a depth-1 cycle at 4-17x a depth-0 step with the invariant kernels in
place (council_http status), where the probe bench had a T=4 verify at 1.5x a serial step;
running both kernel sets through the same bench says whether the kernels are the cause.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from daemon.engine_thread import kernel_choice  # noqa: E402
from daemon.engine.model import loading  # noqa: E402
from daemon.measure import spec_bench  # noqa: E402


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in ("mlx", "invariant"):
        print(__doc__, file=sys.stderr)
        return 2
    kernels, rest = sys.argv[1], sys.argv[2:]
    load = loading.load_model

    def load_with_kernels(*args, **kwargs):
        lm = load(*args, **kwargs)
        if kernels == "invariant":
            kernel_choice.swap_kernels(lm, True, rows=8, compile_decode=True)
        print(f"kernels: {lm.kernels}, decode path: {lm.decode_path}", file=sys.stderr, flush=True)
        return lm

    loading.load_model = load_with_kernels  # spec_bench imports it when it runs
    return spec_bench.main(rest)


if __name__ == "__main__":
    sys.exit(main())
