"""How many of a prompts-together group's rows share a paced piece
(engine_thread/prefill_phase.rows_for_piece): the fewest rows that forward the most tokens."""

from __future__ import annotations

import pytest

from daemon.engine_thread.prefill_phase import rows_for_piece

pytestmark = pytest.mark.quick


def test_tails_longer_than_the_piece_go_one_after_another():
    # Eight ~250-token tails and a 44-token piece: the first row takes all 44 (evenly split,
    # each row advanced 5 and every tail took ~50 forwards).
    assert rows_for_piece([250, 256, 240, 256, 230, 256, 250, 256], 44) == 1
    assert rows_for_piece([256] * 8, 256) == 1


def test_short_tails_fill_the_piece_together():
    assert rows_for_piece([40, 35, 50, 20], 256) == 3  # 3 x 35 = 105 > 2 x 35, 4 x 20
    assert rows_for_piece([30, 30, 30, 30], 256) == 4  # 120: every row
    assert rows_for_piece([100, 100, 100], 256) == 3  # 3 x 85 = 255 over 2 x 100 = 200
    assert rows_for_piece([50, 50, 10], 100) == 2  # a short third row would cut the others to 10


def test_a_tie_keeps_the_fewer_rows():
    assert rows_for_piece([64, 64], 64) == 1  # 64 either way: the first row's tail goes whole
    assert rows_for_piece([5, 5, 5], 2) == 1  # 2 x 1 = 2 = 1 x 2
