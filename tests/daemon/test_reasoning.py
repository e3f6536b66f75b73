"""Thinking text apart from the answer (daemon/request_text/reasoning.py): the split, and that streaming
it in chunks cut anywhere gives exactly the final split."""

from __future__ import annotations

import pytest

from daemon.request_text.reasoning import ReasoningSplit

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)

QWEN = ReasoningSplit("<think>", "</think>", starts_inside=True)


@pytest.mark.parametrize("split, text, expected", [
    (QWEN, "weigh it\n</think>\n\nYes.", ("weigh it\n", "\n\nYes.")),
    (QWEN, "still thinking", ("still thinking", "")),
    (ReasoningSplit("<think>", "</think>", False), "\n\nNo thought.", ("", "\n\nNo thought.")),
    (ReasoningSplit("<think>", "</think>", False), "a<think>b</think>c<think>d", ("bd", "ac")),
    (QWEN, "</think>", ("", "")),
], ids=["opened-by-template", "never-closed", "thinking-off", "blocks-in-output", "empty"])
def test_split(split, text, expected):
    assert split.split(text) == expected


def test_a_cut_never_ends_inside_a_marker():
    text = "abc</think>xyz"
    for upto in range(len(text) + 1):
        cut = QWEN.safe_end(text, upto)
        assert cut <= upto
        # no proper prefix of a marker just before the cut (a whole marker is fine)
        assert not any(m.startswith(text[i:cut]) for m in ("<think>", "</think>")
                       for i in range(max(0, cut - len(m) + 1), cut)), (upto, cut)
    assert QWEN.safe_end(text, 5) == 3 and QWEN.safe_end(text, 11) == 11


@pytest.mark.parametrize("text", [
    "plan: add the numbers</think>\n\n3 + 4 = 7",
    "x" * 5 + "</think>" + "<think>" + "y</think>z<",
    "<<<</thi</think>>>",
])
def test_streaming_at_every_cut_rebuilds_the_final_split(text):
    """As Job streams: each chunk sends the growth of split(text[:safe cut]); the pieces
    must add up to split(text), whatever the chunk boundaries."""
    final = QWEN.split(text)
    for step in range(1, 6):
        sent_r = sent_a = ""
        sent_upto = 0
        for end in list(range(step, len(text), step)) + [len(text)]:
            live = end < len(text)
            upto = max(sent_upto, QWEN.safe_end(text, end)) if live else end
            r, a = QWEN.split(text[:upto])
            assert r.startswith(sent_r) and a.startswith(sent_a), (step, end)
            sent_r, sent_a, sent_upto = r, a, upto
        assert (sent_r, sent_a) == final
