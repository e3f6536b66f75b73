"""Exact requests where a verify does not reproduce serial steps (MLX on CUDA): a real
daemon, told by its test-only knob to treat this CPU as such a backend."""

from __future__ import annotations

import json

import pytest

from daemon.paths import BUNDLED_MODEL
from protocol.client import Client

from e2e_harness import start_daemon

PROMPT = "def fibonacci(n):\n"


@pytest.fixture(scope="module")
def inexact_daemon(tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("inexact"), BUNDLED_MODEL, config="debug_inexact_verify = true\n")
    yield d
    assert d.stop() == 0


@pytest.mark.quick
def test_exact_greedy_requests_decode_serially_there(inexact_daemon):
    with Client(inexact_daemon.endpoint, seat="exact", timeout_s=60) as c:
        assert c.status().detail["exact_decode"] == "serial"
        assert c.governor("pin_depth", 2).ok
        serial = c.complete(PROMPT, max_tokens=32, speculation="off")
        exact = c.complete(PROMPT, max_tokens=32, speculation="exact")
        assert exact.text == serial.text
        assert exact.speculation is None  # served by serial decode, the only exact path here
        fast = c.complete(PROMPT, max_tokens=32, speculation="fast")
        assert fast.speculation is not None and fast.speculation.mode == "fast" and fast.speculation.drafted > 0
        sampled = c.complete(PROMPT, max_tokens=16, speculation="exact", temperature=0.8, seed=3)
        # Sampling is exact in distribution whatever the rounding: it still speculates.
        assert sampled.speculation is not None and sampled.speculation.mode == "exact"
        assert c.governor("auto").ok
    (probe,) = [e for e in inexact_daemon.events() if e["event"] == "speculation.exactness"]
    assert probe["verify_bit_identical"] is False and probe["forced_inexact"] is True
    assert probe["exact_requests"] == "serial" and "decode serially" in probe["reason"]


def test_this_cpu_speculates_exact_requests_and_a_restart_reads_the_verdicts_back(tmp_path):
    """Without the knob the probe finds CPU verifies bit-identical, and says so. A restart on
    the same stack and model reads the compiled step's self-check and both probes' verdicts
    back from the cache folder instead of probing; the knob still forces the inexact policy over a cached bit-identical verdict, and
    under the guarded policy exact requests speculate (with the near-tie guard)."""
    cache = {"COUNCILD_CACHE_DIR": str(tmp_path / "cache")}
    (tmp_path / "first").mkdir()
    (tmp_path / "again").mkdir()
    # The learned costs are asserted below: a CPU load that moves by more than the governor's
    # stale_load_delta restarts a depth's window (governor/cost_model.py stale), and on a CI box
    # whose other core runs other tests' daemons it moved enough to leave no depth with
    # trust_samples cycles. Load staleness is the cost model's own tests' business, not this one's.
    d = start_daemon(tmp_path / "first", BUNDLED_MODEL, env=cache, config="[governor]\nstale_load_delta = 100.0\n")
    try:
        with Client(d.endpoint, seat="exact", timeout_s=60) as c:
            detail = c.status().detail
            assert detail["exact_decode"] == "speculate" and detail["decode_path"] == "compiled"
            assert detail["batch_decode_path"] == "compiled"  # batched steps too (their own self-check)
            # something for the governor to learn: enough cycles (~25) that one depth reaches
            # trust_samples (8) even when a probe of another depth takes some of them
            c.complete(PROMPT, max_tokens=64)
    finally:
        assert d.stop() == 0
    (probe,) = [e for e in d.events() if e["event"] == "speculation.exactness"]
    assert probe["verify_bit_identical"] is True and probe["exact_requests"] == "speculate"
    (batch,) = [e for e in d.events() if e["event"] == "batch.ready"]
    assert probe["verdict"] == "probed" and batch["verdict"] == "probed"
    # The compiled step's self-checks run after ready, between requests (engine_thread/warming.py).
    (loaded,) = [e for e in d.events() if e.get("part") == "compiled_step"]
    assert loaded["switched_in"] is True
    assert loaded["compile_check"] == "probed" and loaded["batch_compile_check"] == "probed"
    assert loaded["batch_decode_path"] == "compiled"
    assert list((tmp_path / "cache" / "probe-verdicts").glob("*.json"))
    # What the governor learned went to the cache folder at the stop, for the next start.
    (saved,) = [e for e in d.events() if e["event"] == "learned.saved"]
    (learned_file,) = (tmp_path / "cache").glob("learned-*.json")
    assert saved["path"] == str(learned_file)
    learned = json.loads(learned_file.read_text())
    assert learned["kind"] == "learned" and learned["cost_s"] and "1" in learned["depths"]
    assert learned["rows"] >= 1  # max_active = "auto" (the default): the row limit it ran at

    again = start_daemon(tmp_path / "again", BUNDLED_MODEL, env=cache,
                         config='debug_inexact_verify = true\n[speculation]\nexact_on_inexact_backend = "guarded"\n')
    try:
        with Client(again.endpoint, seat="exact", timeout_s=60) as c:
            assert c.status().detail["exact_decode"] == "guarded"
            assert c.governor("pin_depth", 1).ok
            exact = c.complete(PROMPT, max_tokens=32, speculation="exact")
            assert exact.speculation is not None and exact.speculation.mode == "exact" and exact.speculation.drafted > 0
    finally:
        assert again.stop() == 0
    # The restart's governor started from it: the solo depth where the first run left it.
    (loaded,) = [e for e in again.events() if e["event"] == "learned.loaded"]
    assert loaded["depths"] == learned["depths"]
    (start,) = [e for e in again.events() if e["event"] == "governor.decision" and e["decision"] == "start_depth"]
    assert start["depth_to"] == learned["depths"]["1"] and "learned profile" in start["sentence"]
    # ... and the row limit where the first run left it (the bundled model's rows fit this box).
    (rows,) = [e for e in again.events() if e["event"] == "governor.decision" and e["decision"] == "rows_start"]
    assert rows["rows_learned"] == learned["rows"] and rows["rows_to"] == learned["rows"]
    assert loaded["rows"] == learned["rows"]
    (probe,) = [e for e in again.events() if e["event"] == "speculation.exactness"]
    (batch,) = [e for e in again.events() if e["event"] == "batch.ready"]
    assert probe["verdict"] == "cached" and batch["verdict"] == "cached"
    (loaded,) = [e for e in again.events() if e.get("part") == "compiled_step"]
    assert loaded["switched_in"] is True
    assert loaded["compile_check"] == "cached" and loaded["batch_compile_check"] == "cached"
    assert loaded["batch_decode_path"] == "compiled"
    assert probe["verify_bit_identical"] is False and probe["forced_inexact"] is True
    assert probe["exact_requests"] == "guarded" and probe["near_tie_guard"] == "on"
    # The batch's own verdict is read back too; where the batch speculates, exact rows may
    # join it only if the verify is exact as well, which debug_inexact_verify denies.
    assert batch["exact_rows_batch"] is (not batch["speculates"])
