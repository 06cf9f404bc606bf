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
