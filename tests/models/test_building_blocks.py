"""Input checks shared by the small models."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from attnkit.models import CTCModel, MemN2N, RNNSeq2Seq, Seq2SeqTransformer, ShowAttendTell
from attnkit.models.building_blocks import check_positive_int


def test_positive_int_accepts_numpy_integers_as_python_ints():
    """np.int64(30) was refused ("expected a positive integer") while nn.Embedding and check_id take it."""
    for value in (30, np.int64(30), np.int32(30), np.uint8(30)):
        out = check_positive_int("vocab_size", value)
        assert out == 30 and type(out) is int


@pytest.mark.parametrize("value", [0, -1, np.int64(0), True, 3.0, np.float64(3.0), "3", None])
def test_positive_int_refuses_what_is_no_positive_integer(value):
    with pytest.raises(ValueError, match=re.escape(f"size={value!r}; expected a positive integer")):
        check_positive_int("size", value)


def test_models_take_numpy_sizes_and_store_python_ints():
    V = np.int64(30)
    for model in (RNNSeq2Seq(V, V), CTCModel(V, V), Seq2SeqTransformer(V, V), MemN2N(V), ShowAttendTell(V)):
        names = ("src_vocab_size", "tgt_vocab_size", "vocab_size")
        sizes = [getattr(model, n) for n in names if hasattr(model, n)]
        assert sizes and all(type(s) is int and s == 30 for s in sizes)
    tokens, _ = RNNSeq2Seq(30, 30).eval().greedy_decode(torch.tensor([[4, 5]]), max_len=np.int64(5))
    assert tokens.shape[1] <= 5


def test_every_model_stores_numpy_special_ids_as_python_ints():
    """ee2e71e made pad_id an int in two models: RNNSeq2Seq kept NumPy pad/bos/eos ids, CTCModel its pad and
    blank ids, the runner's no-attention baseline its pad_id (and took any pad_id unchecked)."""
    from attnkit.runner.baseline import MeanPoolClassifier

    n = np.int64
    rnn = RNNSeq2Seq(30, 30, pad_id=n(0), bos_id=n(1), eos_id=n(2))
    ctc = CTCModel(30, 30, pad_id=n(0), blank_id=n(0))
    base = MeanPoolClassifier(30, 3, 8, 16, 0.0, pad_id=n(0))
    ids = [rnn.pad_id, rnn.bos_id, rnn.eos_id, ctc.pad_id, ctc.blank_id, base.pad_id]
    assert all(type(i) is int for i in ids), [type(i) for i in ids]
    with pytest.raises(ValueError, match="pad_id"):
        MeanPoolClassifier(30, 3, 8, 16, 0.0, pad_id=30)


def test_the_image_and_classifier_models_take_numpy_sizes_and_store_python_ints():
    # DRAW passed a NumPy hidden_dim on and was refused naming an inner state_dim it was never given;
    # TransformerClassifier kept a NumPy num_classes
    from attnkit.models import DRAW, DRAWClassifier, RecurrentAttentionModel, TransformerClassifier

    n = np.int64
    draw = DRAW(n(16), n(16), hidden_dim=n(8))
    assert type(draw.hidden_dim) is int and type(draw.height) is int
    assert type(DRAWClassifier(16, 16, hidden_dim=n(8)).hidden_dim) is int
    clf = TransformerClassifier(20, n(3), d_model=n(16), nhead=2)
    assert clf(torch.tensor([[1, 2, 3]])).shape == (1, 3)
    ram = RecurrentAttentionModel(num_classes=n(10), glimpses=n(2))
    assert type(ram.steps) is int and type(ram.num_classes) is int


def test_a_numpy_integer_pad_id_is_an_id():
    """``pad_id=np.int64(0)`` was refused as "expected an id in [0, 12)", where every other id and size
    argument takes NumPy integers."""
    import numpy as np

    from attnkit.models.building_blocks import TokenEmbedding

    embedding = TokenEmbedding(12, 8, np.int64(0))
    assert embedding.embedding.padding_idx == 0 and not embedding.embedding.weight[0].any()
    from attnkit.models import Seq2SeqTransformer, TransformerClassifier

    classifier = TransformerClassifier(12, 3, d_model=8, nhead=2, num_layers=1, pad_id=np.int64(0))
    seq2seq = Seq2SeqTransformer(12, 12, d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                                 pad_id=np.int64(0))
    assert type(classifier.pad_id) is int and type(seq2seq.pad_id) is int
    with pytest.raises(ValueError, match=r"pad_id=12; expected an id in \[0, vocab_size\) = \[0, 12\)"):
        TokenEmbedding(12, 8, 12)
