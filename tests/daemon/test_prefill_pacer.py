"""The prefill pacer's arithmetic (pure: the worker times the phases and feeds it)."""

from __future__ import annotations

import pytest

from daemon.config import ConfigError, load_config
from daemon.engine_thread.prefill_pacer import MIN_PIECE, PrefillPacer

pytestmark = pytest.mark.quick


def test_it_fits_a_forwards_fixed_cost_and_its_cost_per_token():
    p = PrefillPacer(bound=3.0)
    for n in (256, 16, 64, 256, 40, 128):
        p.prefill_done(n, 0.004 + 0.002 * n)  # 4 ms a forward, 2 ms a token
    a, b = p.cost()
    assert a == pytest.approx(0.004) and b == pytest.approx(0.002)


def test_the_piece_fills_what_the_bound_leaves_after_the_decode_phase():
    p = PrefillPacer(bound=3.0)
    for n in (256, 32) * 20:  # the fit's early error (one size seen: all per token) fades
        p.prefill_done(n, 0.004 + 0.002 * n)
    p.decode_done(0.050)
    # (3 - 1) * 50 ms = 100 ms for the prefill phase: (100 - 4) / 2 = 48 tokens, less what is
    # left of the early error's margin (a fraction of a token).
    assert p.allowance(decoding=True, chunk=256) in (47, 48)
    assert p.to_dict()["last_piece"] in (47, 48) and p.to_dict()["paced_iterations"] == 1
    assert p.allowance(decoding=True, chunk=32) == 32  # never more than a chunk
    p.bound = 100.0
    assert p.allowance(decoding=True, chunk=256) == 256


def test_whole_chunks_when_nobody_decodes_off_or_unmeasured():
    p = PrefillPacer(bound=3.0)
    assert p.allowance(decoding=True, chunk=256) is None  # nothing measured yet
    p.decode_done(0.05)
    assert p.allowance(decoding=True, chunk=256) is None  # no prefill sample yet
    p.prefill_done(256, 0.5)
    assert p.allowance(decoding=False, chunk=256) is None and p.to_dict()["last_piece"] is None
    assert p.allowance(decoding=True, chunk=256) == 51  # one size only: all per token, 100 ms / 1.95 ms
    p.bound = 0.0
    assert p.allowance(decoding=True, chunk=256) is None


def test_a_piece_never_goes_below_the_floor():
    p = PrefillPacer(bound=1.5)
    p.prefill_done(256, 0.030 + 0.002 * 256)
    p.prefill_done(16, 0.030 + 0.002 * 16)
    p.decode_done(0.010)  # half a decode phase (5 ms) is less than a forward's fixed 30 ms
    assert p.allowance(decoding=True, chunk=256) == MIN_PIECE
    assert p.allowance(decoding=True, chunk=8) == 8


def test_the_estimates_follow_a_changing_decode_phase():
    p = PrefillPacer(bound=3.0)
    p.prefill_done(100, 0.2)
    for _ in range(30):
        p.decode_done(0.010)
    for _ in range(30):
        p.decode_done(0.040)
    assert p.decode_s == pytest.approx(0.040, rel=0.01)


@pytest.mark.parametrize("bound", [0.5, 1.0])
def test_a_bound_of_one_decode_phase_or_less_is_refused(bound):
    with pytest.raises(ConfigError, match="decode_gap_bound"):
        load_config(overrides={"scheduler": {"decode_gap_bound": bound}})
    assert load_config(overrides={"scheduler": {"decode_gap_bound": 0}}).scheduler.decode_gap_bound == 0


def test_a_scattered_prefill_cost_leaves_a_margin():
    exact, noisy = PrefillPacer(bound=3.0), PrefillPacer(bound=3.0)
    for i, n in enumerate((256, 32, 128, 64, 200, 16, 100, 50)):
        exact.prefill_done(n, 0.002 * n)
        noisy.prefill_done(n, 0.002 * n * (1.3 if i % 2 else 0.7))
    for p in (exact, noisy):
        p.decode_done(0.1)
    assert exact.to_dict()["prefill_error_ms"] == pytest.approx(0.0, abs=1e-6)
    assert exact.allowance(decoding=True, chunk=256) == 100
    assert noisy.to_dict()["prefill_error_ms"] > 10
    assert MIN_PIECE <= noisy.allowance(decoding=True, chunk=256) < 90
