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
    for n in (256, 32):
        p.prefill_done(n, 0.004 + 0.002 * n)
    p.decode_done(0.050)
    # (3 - 1) * 50 ms = 100 ms for the prefill phase: (100 - 4) / 2 = 48 tokens.
    assert p.allowance(decoding=True, chunk=256) == 48
    assert p.to_dict()["last_piece"] == 48 and p.to_dict()["paced_iterations"] == 1
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
