"""Depth 0 in the batch: rows whose mode keeps the MTP head fed (fast, pinned depth 0) vs rows
that never draft (speculation off): aggregate tok/s, ABAB, 4 concurrent rows, 6 rounds.

    PYTHONPATH=$PWD .venv/bin/python bench/probes/head_feed_cost.py

Why: on the CPU council the default (exact) arm ran 0.59x of mlx_lm.server against off's
0.70x; this says how much of that the head's feed at depth 0 can be (a daemon on the bundled
model, the tests' harness starts it)."""
import pathlib
import statistics
import sys
import tempfile
import time

sys.path[:0] = ["tests/e2e", "tests", "."]
from e2e_harness import start_daemon  # noqa: E402
from daemon.paths import BUNDLED_MODEL  # noqa: E402
from protocol.client import Client  # noqa: E402


def main() -> None:
    d = start_daemon(pathlib.Path(tempfile.mkdtemp()), BUNDLED_MODEL, config="[scheduler]\nmax_active = 4\n")
    prompts = ["def fibonacci(n):\n", "The council met at dawn to decide", "import os\nimport sys\n", "class Council:\n"]
    res = {"fast d0 (head fed)": [], "off": []}
    with Client(d.endpoint, seat="obs", timeout_s=120) as c:
        assert c.governor("pin_depth", 0).ok
        for rnd in range(6):
            for arm, mode in (("fast d0 (head fed)", "fast"), ("off", "off"))[:: 1 if rnd % 2 else -1]:
                t = time.time()
                ss = [c.generate(prompts[i] + f"# {rnd}\n", max_tokens=128, speculation=mode) for i in range(4)]
                toks = sum(s.result().usage.completion_tokens for s in ss)
                res[arm].append(toks / (time.time() - t))
    for arm, v in res.items():
        print(f"{arm}: median {statistics.median(v):.1f} tok/s ({min(v):.1f}-{max(v):.1f})")
    print("ratio fed/off per round:", [round(a / b, 3) for a, b in zip(res["fast d0 (head fed)"], res["off"])])
    d.stop()


if __name__ == "__main__":
    main()
