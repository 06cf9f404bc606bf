"""TextClassificationData / Seq2SeqData reject inconsistent splits with messages naming the values."""

from __future__ import annotations

import pytest

from attnkit.data import Seq2SeqData, TextClassificationData


def _data(**kw):
    args = dict(
        name="t",
        train_texts=["a", "b"],
        train_labels=[0, 1],
        test_texts=["c"],
        test_labels=[1],
        label_names=["neg", "pos"],
    )
    return TextClassificationData(**{**args, **kw})


def test_valid_data_reports_classes_and_pairs():
    data = _data()
    assert data.num_classes == 2 and not data.is_pair and data.joined_texts("train") == ["a", "b"]
    pairs = _data(train_text_pairs=["x", "y"], test_text_pairs=["z"])
    assert pairs.is_pair and pairs.joined_texts("test", sep=" # ") == ["c # z"]


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"train_labels": [0]}, "train has 2 texts but 1 labels"),
        ({"test_labels": [2]}, r"test label 2 is not an integer in \[0, 2\)"),
        ({"train_labels": [0, True]}, "train label True"),
        ({"label_names": []}, "label_names is empty"),
        ({"train_text_pairs": ["x", "y"]}, "for both splits or for neither"),
        ({"train_text_pairs": ["x"], "test_text_pairs": ["z"]}, "1 second texts"),
    ],
)
def test_inconsistent_text_classification_data_raises(kw, message):
    with pytest.raises(ValueError, match=message):
        _data(**kw)


def test_joined_texts_rejects_unknown_split():
    with pytest.raises(ValueError, match="split='dev'"):
        _data().joined_texts("dev")


def test_seq2seq_lengths_must_match():
    assert Seq2SeqData("m", ["1+1"], ["2"], [], []).train_tgt == ["2"]
    with pytest.raises(ValueError, match="train has 2 sources but 1 targets"):
        Seq2SeqData("m", ["1+1", "2+2"], ["2"], [], [])
