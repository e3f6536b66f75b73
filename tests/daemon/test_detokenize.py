"""The text a request returns is the text its committed token ids mean (issue: the first
token's leading space was dropped by mlx-lm's streaming detokenizer)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from daemon.request_text.detokenize import CommittedText
from daemon.paths import BUNDLED_MODEL

pytestmark = pytest.mark.quick  # the quick tier: `make check` (tests/README.md)


@pytest.fixture(scope="module")
def byte_bpe():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(BUNDLED_MODEL))


@pytest.fixture(scope="module")
def metaspace():
    """A SentencePiece-style tokenizer (Metaspace pre-tokenizer and decoder, as Llama/Mistral
    conversions have): its decoder strips a sequence's leading space, which a continuation
    must keep."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    corpus = ["def fib(n):", "    return fib(n - 1) + fib(n - 2)", "the quick brown fox jumps over",
              "if x is None:", "        pass", "hello world, said the council"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def _stream(tok, prompt_ids, gen_ids, splits):
    text = CommittedText(tok, prompt_ids)
    seen = []
    i = 0
    for n in splits:
        text.add(gen_ids[i : i + n])
        seen.append(text.text)
        i += n
    text.add(gen_ids[i:])
    text.finalize()
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:] + [text.text])), "streamed text was rewritten"
    return text.text


def test_leading_indentation_survives(byte_bpe):
    prompt = byte_bpe.encode("def read_config(path):\n")
    gen = byte_bpe.encode('    """Read it."""\n    return 1')
    assert byte_bpe.decode(gen).startswith("    ")
    assert _stream(byte_bpe, prompt, gen, [1, 1, 1]) == byte_bpe.decode(gen)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_byte_level_bpe_text_is_the_decoding_of_the_ids(byte_bpe, data):
    vocab = len(byte_bpe)
    prompt = data.draw(st.lists(st.integers(0, vocab - 1), max_size=8))
    gen = data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=30))
    splits = data.draw(st.lists(st.integers(1, 4), max_size=10))
    # Byte-level BPE: the ids alone say what the text is, whatever precedes them.
    assert _stream(byte_bpe, prompt, gen, splits) == byte_bpe.decode(gen)


@settings(max_examples=60, deadline=None)
@given(words=st.lists(st.sampled_from(["def", "fib", "(n):", "return", "the", "fox", "    pass", "x", "None:"]),
                      min_size=2, max_size=12), cut=st.integers(1, 11), splits=st.lists(st.integers(1, 3), max_size=8))
def test_sentencepiece_continuation_keeps_its_space(metaspace, words, cut, splits):
    cut = min(cut, len(words) - 1)
    prompt_text, whole = " ".join(words[:cut]), " ".join(words)
    prompt = metaspace.encode(prompt_text)
    ids = metaspace.encode(whole)
    assert ids[: len(prompt)] == prompt  # word boundaries: the prompt's ids are a prefix
    gen = ids[len(prompt):]
    # What the continuation means is what it adds to the prompt's text: here a leading space
    # that decode(gen) alone would strip.
    expected = metaspace.decode(ids)[len(metaspace.decode(prompt)):]
    assert expected.startswith(" ")
    assert _stream(metaspace, prompt, gen, splits) == expected


def test_split_utf8_character_is_held_then_completed(byte_bpe):
    gen = byte_bpe.encode("naïve café ✓ 漢字")
    text = CommittedText(byte_bpe, [])
    for t in gen:
        text.add([t])
        assert "\ufffd" not in text.text
    text.finalize()
    assert text.text == "naïve café ✓ 漢字"
