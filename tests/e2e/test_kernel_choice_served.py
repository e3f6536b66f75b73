"""The daemon's kernel choice (kernel_choice.py) through real daemons on the bundled model.

On this CPU MLX's kernels are invariant, so `auto` keeps them. `kernels = "invariant"`
forces the invariant classes (here they compute with the reference ops: the CUDA/Metal
kernels run on GPUs only); the probes prove them and exact rows batch and speculate with
serial's tokens. The test hook that perturbs multi-row products makes the probes fail, and
the daemon must refuse the invariant path, say why, and serve on MLX's kernels."""

from __future__ import annotations

import pytest
from daemon.paths import BUNDLED_MODEL
from protocol.client import Client

from e2e_harness import start_daemon

PROMPTS = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n", "import os\n\n\ndef walk(path):\n"]


@pytest.mark.quick
def test_auto_keeps_mlx_kernels_on_this_cpu(bundled_daemon):
    with Client(bundled_daemon.endpoint, seat="kernels", timeout_s=60) as c:
        detail = c.status().detail
    kernels = detail["kernels"]
    assert kernels["name"] == "mlx" and "CPU" in kernels["reason"], kernels
    (ev,) = [e for e in bundled_daemon.events() if e["event"] == "engine.kernels"]
    assert ev["kernels"] == "mlx" and ev["backend"] == "cpu"
    # The fused GatedDeltaNet recurrence is CUDA's: here mlx-lm's ops, and the status and log say why.
    (loaded,) = [e for e in bundled_daemon.events() if e["event"] == "model.loaded"]
    assert detail["recurrence"] == loaded["recurrence"] and detail["recurrence"].startswith("mlx-lm: not CUDA")
    # So the projections stay separate (mlx-lm's block would not read a merged one).
    assert detail["linears"] == loaded["linears"] == "separate: the GatedDeltaNet layers run mlx-lm's block"


def test_forced_invariant_kernels_are_proven_and_exact_rows_batch_with_serial_tokens(tmp_path):
    d = start_daemon(tmp_path, BUNDLED_MODEL, config='kernels = "invariant"\n')
    try:
        with Client(d.endpoint, seat="council", timeout_s=120) as c:
            detail = c.status().detail
            assert detail["kernels"]["name"] == "invariant", detail["kernels"]
            assert detail["exact_decode"] == "speculate"
            alone = {p: c.complete(p, max_tokens=24, speculation="off").text for p in PROMPTS}
            assert c.governor("pin_depth", 2).ok
            streams = [c.generate(p, max_tokens=24, speculation="exact") for p in PROMPTS]
            dones = [s.result() for s in streams]
        for p, done in zip(PROMPTS, dones):
            assert done.text == alone[p], p
            assert done.speculation is not None and done.speculation.drafted > 0
    finally:
        assert d.stop() == 0
    (ev,) = [e for e in d.events() if e["event"] == "engine.kernels"]
    assert ev["kernels"] == "invariant" and all(ev["probes"]["invariant"].values()), ev
    (ready,) = [e for e in d.events() if e["event"] == "batch.ready"]
    assert ready["exact_rows_batch"] is True


def test_a_restart_reads_the_swapped_kernels_compiled_step_verdict_instead_of_checking_again(tmp_path):
    """A swap to the invariant kernels re-traces the compiled step; its self-check (seconds on a
    GPU) is a verdict kept like the others, so the second start of a machine reads it."""
    cache = tmp_path / "own-cache"  # not the shared verdicts: the first start must probe
    seen = []
    for run in ("first", "second"):
        (tmp_path / run).mkdir()
        d = start_daemon(tmp_path / run, BUNDLED_MODEL, config='kernels = "invariant"\n',
                         env={"COUNCILD_CACHE_DIR": str(cache)})
        try:
            with Client(d.endpoint, seat="restart", timeout_s=120) as c:
                assert c.complete(PROMPTS[0], max_tokens=8, speculation="exact").usage.completion_tokens == 8
        finally:
            assert d.stop() == 0
        (ev,) = [e for e in d.events() if e["event"] == "engine.kernels"]
        assert ev["kernels"] == "invariant", ev
        seen.append(ev["compile_check"])
    assert seen == ["probed", "cached"]


def test_a_path_that_is_not_invariant_is_refused_and_the_daemon_serves_on(tmp_path):
    d = start_daemon(tmp_path, BUNDLED_MODEL,
                     config='kernels = "invariant"\ndebug_perturb_invariant_batch = true\n')
    try:
        with Client(d.endpoint, seat="council", timeout_s=120) as c:
            kernels = c.status().detail["kernels"]
            assert kernels["name"] == "mlx" and "refused" in kernels["reason"], kernels
            serial = c.complete(PROMPTS[0], max_tokens=16, speculation="off").text
            assert c.complete(PROMPTS[0], max_tokens=16, speculation="exact").text == serial
    finally:
        assert d.stop() == 0
    (ev,) = [e for e in d.events() if e["event"] == "engine.kernels"]
    assert ev["kernels"] == "mlx" and ev["probes"]["invariant"]["verify"] is False
    assert ev["probes"]["invariant"]["batch"] is False
