"""WordTokenizer and CharTokenizer: vocabularies, padding masks, truncation, round trips."""

from __future__ import annotations

import pytest
import torch

from attnkit.data import CharTokenizer, WordTokenizer


def test_word_vocab_is_ordered_by_frequency_with_specials_first():
    tok = WordTokenizer.fit(["b a a", "c a b"], max_vocab=None)
    assert tok.vocab == ["<pad>", "<unk>", "a", "b", "c"]


def test_word_max_vocab_and_min_freq_limit_the_vocabulary():
    texts = ["a a a b b c", "a b d"]
    assert WordTokenizer.fit(texts, max_vocab=4).vocab == ["<pad>", "<unk>", "a", "b"]
    assert WordTokenizer.fit(texts, min_freq=2).vocab == ["<pad>", "<unk>", "a", "b"]


def test_word_encode_pads_masks_and_maps_unknown_words():
    tok = WordTokenizer.fit(["the cat sat", "the dog"])
    ids, mask = tok.encode(["The cat!", "the zebra sat on", ""], max_length=10)
    assert ids.dtype == torch.long and mask.dtype == torch.bool and ids.shape == mask.shape == (3, 4)
    assert mask.tolist() == [[True, True, True, False], [True, True, True, True], [False] * 4]
    assert ids[1, 1].item() == tok.unk_id and ids[0, 2].item() == tok.unk_id  # "zebra", "!" unseen
    assert (ids[~mask] == tok.pad_id).all()


def test_word_encode_truncates_at_max_length():
    tok = WordTokenizer.fit(["a b c d e"])
    ids, mask = tok.encode(["a b c d e", "a"], max_length=3)
    assert ids.shape == (2, 3) and mask.sum(1).tolist() == [3, 1]


def test_empty_batch_element_keeps_one_position():
    ids, mask = WordTokenizer.fit(["a"]).encode([""], max_length=5)
    assert ids.shape == (1, 1) and not mask.any()


def test_word_tokenizer_round_trips_through_dict():
    tok = WordTokenizer.fit(["x y z y"])
    again = WordTokenizer.from_dict(tok.to_dict())
    assert again.vocab == tok.vocab and torch.equal(again.encode(["z y q"])[0], tok.encode(["z y q"])[0])


def test_word_fit_rejects_bad_arguments():
    with pytest.raises(ValueError, match="max_vocab=1"):
        WordTokenizer.fit(["a"], max_vocab=1)
    with pytest.raises(ValueError, match="one string"):
        WordTokenizer.fit("a b c")
    with pytest.raises(ValueError, match="max_length=0"):
        WordTokenizer.fit(["a"]).encode(["a"], max_length=0)


def test_char_encode_decode_round_trip_with_bos_eos():
    tok = CharTokenizer()
    texts = ["x=85,y=-523,x*y", "-44455"]
    ids, mask = tok.encode(texts, add_bos=True, add_eos=True)
    assert ids[0, 0].item() == tok.bos_id and ids[1, 7].item() == tok.eos_id
    assert mask.sum(1).tolist() == [len(texts[0]) + 2, len(texts[1]) + 2]
    assert tok.decode(ids) == texts
    assert len({tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id}) == 4


def test_char_decode_stops_at_eos():
    tok = CharTokenizer()
    seq = [tok.bos_id, *tok.encode_ids("12"), tok.eos_id, *tok.encode_ids("99")]
    assert tok.decode(seq) == ["12"]
    assert tok.decode(torch.tensor([seq, seq])) == ["12", "12"]


def test_char_fit_and_unknown_characters():
    tok = CharTokenizer.fit(["ab", "ba c"])
    assert tok.chars == [" ", "a", "b", "c"]
    assert tok.encode_ids("az") == [tok.index["a"], tok.unk_id]
    assert CharTokenizer.from_dict(tok.to_dict()).vocab == tok.vocab


@pytest.mark.parametrize("ids", [[99], [-1], [2, 6]])
def test_decode_rejects_ids_outside_the_vocabulary(ids):
    word, char = WordTokenizer.fit(["a b c"]), CharTokenizer("ab")
    with pytest.raises(ValueError, match="not in the vocabulary"):
        word.decode(ids)
    with pytest.raises(ValueError, match="not in the vocabulary"):
        char.decode(ids)


def test_decode_reads_numpy_arrays_and_rejects_non_integer_ids():
    import numpy as np

    tok = CharTokenizer("ab")
    assert tok.decode(np.array([[4, 5, 2], [5, 0, 0]])) == ["ab", "b"]
    assert WordTokenizer.fit(["a b"]).decode(np.array([2, 3, 0])) == "a b"
    with pytest.raises(ValueError, match="4.0"):
        tok.decode([4.0])
    with pytest.raises(ValueError, match="expected a batch"):
        tok.decode(torch.tensor(4))


@pytest.mark.parametrize(
    "sequences, pad_id, message",
    [
        ([[1.5]], 0, "sequence 0 holds 1.5"),
        ([[1], "ab"], 0, "sequence 1 is 'ab'"),
        ([[[1]]], 0, r"holds \[1\]"),
        ([[1]], None, "pad_id=None"),
        ([[1]], True, "pad_id=True"),
    ],
)
def test_pad_batch_rejects_non_integer_ids(sequences, pad_id, message):
    from attnkit.data import pad_batch

    with pytest.raises(ValueError, match=message):
        pad_batch(sequences, pad_id)


def test_pad_batch_accepts_numpy_integers_and_tensors():
    import numpy as np

    from attnkit.data import pad_batch

    ids, mask = pad_batch([torch.tensor([3, 4]), np.array([5])], np.int64(0), max_length=np.int64(2))
    assert ids.tolist() == [[3, 4], [5, 0]] and mask.tolist() == [[True, True], [True, False]]


@pytest.mark.parametrize(
    "cls, state, message",
    [
        (WordTokenizer, {"type": "word"}, r"lacks \['vocab', 'lowercase'\]"),
        (WordTokenizer, ["<pad>"], "type='list'"),
        (CharTokenizer, {"type": "char"}, r"lacks \['alphabet'\]"),
        (CharTokenizer, {"type": "char", "alphabet": 5}, "alphabet is 5"),
        # the string "false" is truthy: it lowercased every text
        (WordTokenizer, {"type": "word", "vocab": ["<pad>", "<unk>", "hello"], "lowercase": "false"},
         "lowercase: expected True or False"),
    ],
)
def test_from_dict_names_a_broken_state(cls, state, message):
    with pytest.raises(ValueError, match=message):
        cls.from_dict(state)


def test_vocab_and_alphabet_must_hold_strings():
    with pytest.raises(ValueError, match="vocab holds 3"):
        WordTokenizer(["<pad>", "<unk>", 3])
    with pytest.raises(ValueError, match="single characters"):
        CharTokenizer([1])


@pytest.mark.parametrize("text", [5, None, ["a", "b"], b"ab"])
def test_encode_ids_of_something_that_is_not_one_string_is_named(text):
    from attnkit.data.transduction import TokenVocab

    for tokenizer in (WordTokenizer.fit(["a b"]), CharTokenizer(), TokenVocab(["a", "b"], "chars")):
        with pytest.raises(ValueError, match="expected one string"):
            tokenizer.encode_ids(text)


def test_token_vocab_refuses_one_string_where_a_list_is_expected():
    from attnkit.data.transduction import TokenVocab

    vocab = TokenVocab.fit(["ab"], "chars")
    with pytest.raises(ValueError, match="got one string; wrap it"):
        vocab.encode("ab")  # would be two one-character sequences
    with pytest.raises(ValueError, match="got one string; wrap it"):
        TokenVocab.fit("ab", "chars")


def test_char_decode_of_an_empty_sequence_is_one_empty_string():
    """A 1-D ``(L,)`` tensor is one sequence: with ``L = 0`` decode returned ``[]`` (a batch of none), so
    ``decode(ids)[0]`` failed; a ``(B, 0)`` batch keeps ``B`` strings and a ``(0, L)`` one none."""
    import numpy as np

    tok = CharTokenizer()
    assert tok.decode(torch.tensor([], dtype=torch.long)) == [""]
    assert tok.decode(np.array([], dtype=np.int64)) == [""]
    assert tok.decode(torch.zeros(2, 0, dtype=torch.long)) == ["", ""]
    assert tok.decode(torch.zeros(0, 3, dtype=torch.long)) == []
    assert tok.decode(torch.tensor([tok.eos_id, 4])) == [""]  # a sequence that ends at once


def test_a_generated_bos_or_pad_before_eos_reads_as_unknown_never_as_nothing():
    """A model's output -<bos>9<pad>90<eos> decoded to "-990" and scored as an exact match of "-990"."""
    from attnkit.data.tokenizers import GENERATED_BOS, GENERATED_PAD, CharTokenizer

    tok = CharTokenizer()
    ids = tok.encode_ids("-99")
    out = [ids[0], tok.bos_id, ids[1], tok.pad_id, ids[2], tok.eos_id, tok.pad_id]
    assert tok.decode(out) == ["-99"]  # a target: its <bos> and padding are not text
    assert tok.decode(out, generated=True) == [f"-{GENERATED_BOS}9{GENERATED_PAD}9"]
    # not U+FFFD: a gold holding <unk> decodes to it, and a generated <pad> there scored as exact
    assert tok.decode([ids[0], tok.pad_id], generated=True) != tok.decode([ids[0], tok.unk_id])


@pytest.mark.parametrize("text, words", [
    ("हिन्दी भाषा", ["हिन्दी", "भाषा"]),  # vowel signs (Mc) and the virama (Mn) were tokens of their own
    ("cafe\u0301 nai\u0308ve", ["café", "naïve"]),  # decomposed accents split "cafe" from "\u0301"
    ("\u0301a \u20dd", ["\u0301", "a", "\u20dd"]),  # a mark with no word before it is its own token
])
def test_combining_marks_stay_in_their_word(text, words):
    tok = WordTokenizer.fit(["x"])
    assert tok.tokenize(text) == words


def test_decomposed_and_composed_text_give_the_same_tokens():
    import unicodedata

    text = "Ça déçoit, naïve Zoë! Ångström, ﬁnal; ḱ"
    tok = WordTokenizer.fit([unicodedata.normalize("NFD", text)])
    for form in ("NFC", "NFD"):
        assert tok.tokenize(unicodedata.normalize(form, text)) == tok.tokenize(text)
        assert tok.unk_id not in tok.encode_ids(unicodedata.normalize(form, text))


@pytest.mark.parametrize("text, words", [
    ("Don't e-mail me at 3.14 p.m., U.S.A.!", ["don", "'", "t", "e", "-", "mail", "me", "at", "3", ".", "14",
                                              "p", ".", "m", ".", ",", "u", ".", "s", ".", "a", ".", "!"]),
    ("snake_case (x2) costs $5 -- 100%?", ["snake_case", "(", "x2", ")", "costs", "$", "5", "-", "-", "100",
                                          "%", "?"]),
    ("It's   the\tend\n", ["it", "'", "s", "the", "end"]),
])
def test_english_text_is_split_as_before(text, words):
    assert WordTokenizer.fit(["x"]).tokenize(text) == words
