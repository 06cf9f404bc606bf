"""The marks decoded text shows for special tokens (``DISPLAY_MARKS``): never a vocabulary's token, and the
decode flags that choose them are booleans."""

from __future__ import annotations

import pytest

from attnkit.data.digits_canvas import CaptionVocab
from attnkit.data.tokenizers import (
    DISPLAY_MARKS, GENERATED_BOS, GENERATED_EOS, GENERATED_PAD, UNKNOWN, CharTokenizer,
)
from attnkit.data.transduction import TokenVocab


def test_display_marks_are_the_unk_and_generated_special_marks():
    assert DISPLAY_MARKS == (UNKNOWN, GENERATED_PAD, GENERATED_BOS, GENERATED_EOS)


@pytest.mark.parametrize("mark", DISPLAY_MARKS)
def test_fit_reads_a_display_mark_in_a_text_as_unk(mark):
    # "x ▷ y" made ▷ a real character, which then read exactly like a generated <bos>
    tok = CharTokenizer.fit([f"x {mark} y"])
    assert mark not in tok.chars and tok.encode_ids(mark) == [tok.unk_id]
    for split in ("words", "chars"):
        vocab = TokenVocab.fit([f"set {mark}"], split)
        assert mark not in vocab.tokens and vocab.encode_ids(mark) == [vocab.unk_id]


@pytest.mark.parametrize("mark", DISPLAY_MARKS)
def test_the_constructors_refuse_a_display_mark(mark):
    code = f"U\\+{ord(mark):04X}"
    with pytest.raises(ValueError, match=code):
        CharTokenizer(f"ab{mark}")
    with pytest.raises(ValueError, match=code):
        CharTokenizer.from_dict({"type": "char", "alphabet": f"ab{mark}"})
    with pytest.raises(ValueError, match=code):
        TokenVocab(["a", mark], "words")


def test_a_generated_pad_never_equals_a_gold_holding_the_empty_set():
    # CharTokenizer.fit(["A ∩ B = ∅"]): a generated <pad> where ∅ belongs decoded to the gold exactly
    gold_text = "A \u2229 B = \u2205"
    tok = CharTokenizer.fit([gold_text])
    gold = tok.decode(tok.encode_ids(gold_text, add_bos=True, add_eos=True))[0]
    pred = tok.decode(tok.encode_ids(gold_text[:-1]) + [tok.pad_id, tok.eos_id], generated=True)[0]
    assert pred != gold
    vocab = TokenVocab.fit(["set \u2205"], "words")
    generated = vocab.decode_ids([vocab.index["set"], vocab.pad_id, vocab.eos_id], generated=True)
    assert generated != vocab.decode_ids(vocab.encode_ids("set \u2205", add_bos=True, add_eos=True))


@pytest.mark.parametrize("bad", ["False", None, 2, 0])
def test_decode_flags_that_are_not_bools_are_refused(bad):
    # generated="False" acted as True, eos_ends=None as False
    vocab = TokenVocab.fit(["a b"], "words")
    with pytest.raises(ValueError, match="generated="):
        vocab.decode_ids([vocab.pad_id], generated=bad)
    with pytest.raises(ValueError, match="eos_ends="):
        vocab.decode_ids([vocab.eos_id], eos_ends=bad)
    with pytest.raises(ValueError, match="generated="):
        CharTokenizer().decode([0], generated=bad)
    with pytest.raises(ValueError, match="generated="):
        CaptionVocab().decode([0, 3], generated=bad)


def test_a_reference_decode_ends_at_eos_and_shows_no_mark():
    # decode_ids(gold, eos_ends=False) showed the gold's <eos> as ◁ and read on
    vocab = TokenVocab.fit(["a b c"], "words")
    gold = vocab.encode_ids("a b", add_bos=True, add_eos=True) + [vocab.index["c"], vocab.pad_id]
    for eos_ends in (True, False):
        assert vocab.decode_ids(gold, eos_ends=eos_ends) == ["a", "b"]
    # a CTC model's output still shows its <eos> and reads on
    assert vocab.decode_ids(gold[1:], generated=True, eos_ends=False) == ["a", "b", GENERATED_EOS, "c",
                                                                          GENERATED_PAD]
