"""The prefill pacer's arithmetic (pure: the worker times the iterations and feeds it)."""

from __future__ import annotations

import pytest

from daemon.config import ConfigError, load_config
from daemon.engine_thread.prefill_pacer import MIN_PIECE, PrefillPacer

pytestmark = pytest.mark.quick


def _iterations(p: PrefillPacer, sizes, quiet=0.020, fixed=0.004, per_token=0.002, scatter=lambda i: 1.0):
    """Decoding iterations that prefilled each of ``sizes`` tokens, after quiet ones."""
    for _ in range(5):
        p.iteration_done(quiet, 0, decoding=True)
    for i, n in enumerate(sizes):
        p.iteration_done((quiet + fixed + per_token * n) * scatter(i), n, decoding=True)


def test_it_fits_an_iterations_cost_on_the_tokens_it_prefilled():
    p = PrefillPacer(bound=3.0)
    _iterations(p, (256, 16, 64, 256, 40, 128))
    c, b = p.cost()
    assert c == pytest.approx(0.024) and b == pytest.approx(0.002)  # the decode phase + a forward's fixed part
    assert p.quiet_s == pytest.approx(0.020)


def test_the_piece_keeps_the_iteration_within_bound_quiet_iterations():
    p = PrefillPacer(bound=3.0)
    _iterations(p, (256, 32) * 20)  # the fit's early error (one size seen) fades
    # 3 x 20 ms = 60 ms an iteration: 60 - 24 = 36 ms of prefill = 18 tokens (less what is
    # left of the early error's margin: a fraction of a token).
    assert p.allowance(decoding=True, chunk=256) in (17, 18)
    assert p.to_dict()["last_piece"] in (17, 18) and p.to_dict()["paced_iterations"] == 1
    p.bound = 10.0  # 200 ms: 88 tokens
    assert p.allowance(decoding=True, chunk=256) in (87, 88)
    assert p.allowance(decoding=True, chunk=32) == 32  # never more than a chunk
    p.bound = 1000.0
    assert p.allowance(decoding=True, chunk=256) == 256


def test_pieces_of_one_size_take_the_quiet_iteration_as_their_intercept():
    p = PrefillPacer(bound=3.0)
    _iterations(p, (40,) * 10, fixed=0.0)
    c, b = p.cost()
    assert c == pytest.approx(0.020) and b == pytest.approx(0.002)
    assert p.allowance(decoding=True, chunk=256) == 20  # (60 - 20) / 2


def test_whole_chunks_when_nobody_decodes_or_off_and_a_small_first_piece():
    p = PrefillPacer(bound=3.0)
    assert p.allowance(decoding=True, chunk=256) == MIN_PIECE  # nothing fitted yet: a small piece measures
    p.iteration_done(0.5, 256, decoding=False)  # no stream waited on it: says nothing of a gap
    assert p.cost() is None
    _iterations(p, (64,) * 5)
    assert p.allowance(decoding=False, chunk=256) is None and p.to_dict()["last_piece"] is None
    p.bound = 0.0
    assert p.allowance(decoding=True, chunk=256) is None


def test_a_piece_never_goes_below_the_floor():
    p = PrefillPacer(bound=1.5)
    _iterations(p, (256, 16) * 10, fixed=0.001)  # half a quiet iteration (10 ms) leaves 4.5 ms: 2 tokens
    assert p.allowance(decoding=True, chunk=256) == MIN_PIECE
    assert p.allowance(decoding=True, chunk=2) == 2  # a chunk below the floor: the chunk


def test_a_piece_holds_at_least_the_forwards_fixed_part_in_tokens():
    # A forward's fixed 30 ms is more than the bound leaves (half a quiet iteration): no piece
    # keeps it, and a 4-token piece would cost the rows 58 ms an iteration for 64 iterations a
    # chunk. The piece whose tokens cost what the fixed part does: 30 / 2 = 15 tokens.
    p = PrefillPacer(bound=1.5)
    _iterations(p, (256, 16) * 10, fixed=0.030)
    assert PrefillPacer.fixed_piece(*p.cost(), p.quiet_s, 0.0) == 15
    assert p.allowance(decoding=True, chunk=256) == 15 and p.to_dict()["fixed_piece"] == 15
    assert p.allowance(decoding=True, chunk=8) == 8  # never more than a chunk
    # A GPU-like forward (fixed 8 ms, 0.03 ms a token, quiet 10 ms) within twice a quiet
    # iteration: no piece keeps it (the fixed part alone is 0.8 of a quiet iteration, less the
    # margin); the piece is the fixed part's ~200-270 tokens, not 4.
    gpu = PrefillPacer(bound=2.0)
    _iterations(gpu, (4, 40, 12) * 16, quiet=0.010, fixed=0.008, per_token=0.00003,
                scatter=lambda i: 1.0 + 0.05 * (i % 4 - 1.5))
    c, b = gpu.cost()
    assert 2.0 * gpu.quiet_s - c - 2 * gpu.to_dict()["error_ms"] / 1e3 < 0  # no room
    assert 200 <= gpu.allowance(decoding=True, chunk=256) <= 256
    # A fixed part within the fit's scatter is no measure of it: the room's piece alone.
    assert PrefillPacer.fixed_piece(0.030, 0.002, 0.020, 0.006) == 0
    # Pieces of one size: the fit cannot part the fixed cost from the tokens', no such floor.
    one = PrefillPacer(bound=1.5)
    _iterations(one, (16,) * 10, fixed=0.030)
    assert PrefillPacer.fixed_piece(*one.cost(), one.quiet_s, 0.0) == 0
    assert one.allowance(decoding=True, chunk=256) == MIN_PIECE and one.to_dict()["fixed_piece"] == 0


def test_a_scattered_cost_leaves_a_margin():
    steady, scattered = PrefillPacer(bound=6.0), PrefillPacer(bound=6.0)
    sizes = (256, 32, 128, 64, 200, 16, 100, 50) * 3
    _iterations(steady, sizes, fixed=0.0)
    _iterations(scattered, sizes, fixed=0.0, scatter=lambda i: 1.3 if i % 2 else 0.7)
    assert steady.to_dict()["error_ms"] == pytest.approx(0.0, abs=1e-6)
    assert steady.allowance(decoding=True, chunk=256) == 50  # (120 - 20) / 2
    assert scattered.to_dict()["error_ms"] > 10
    assert MIN_PIECE <= scattered.allowance(decoding=True, chunk=256) < 40


def test_the_quiet_iteration_follows_a_changing_batch():
    p = PrefillPacer(bound=3.0)
    for _ in range(30):
        p.iteration_done(0.010, 0, decoding=True)
    for _ in range(30):
        p.iteration_done(0.040, 0, decoding=True)
    assert p.quiet_s == pytest.approx(0.040, rel=0.01)


@pytest.mark.parametrize("bound", [0.5, 1.0])
def test_a_bound_of_one_decode_phase_or_less_is_refused(bound):
    with pytest.raises(ConfigError, match="decode_gap_bound"):
        load_config(overrides={"scheduler": {"decode_gap_bound": bound}})
    assert load_config(overrides={"scheduler": {"decode_gap_bound": 0}}).scheduler.decode_gap_bound == 0
