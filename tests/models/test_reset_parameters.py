"""Every model's ``reset_parameters`` covers all its parameters: a model built on the meta device, then
``to_empty`` (memory as found) and ``reset_parameters``, as torch's deferred initialization does, holds no
leftover value."""

from __future__ import annotations

import pytest

import attnkit as ak
from attnkit.models import (
    DRAW,
    CTCModel,
    DRAWClassifier,
    MemN2N,
    RecurrentAttentionModel,
    RNNSeq2Seq,
    Seq2SeqTransformer,
    ShowAttendTell,
    TransformerClassifier,
)
from tests.nn.test_reset_parameters import assert_reset_leaves_no_leftover_memory

BUILDERS = {
    "rnn_seq2seq_additive": lambda: RNNSeq2Seq(12, 11, embed_dim=8, hidden_dim=8),
    "rnn_seq2seq_gmm_lstm": lambda: RNNSeq2Seq(12, 11, embed_dim=8, hidden_dim=8, cell="lstm",
                                               attention="gmm"),
    "rnn_seq2seq_mixed": lambda: RNNSeq2Seq(12, 11, embed_dim=8, hidden_dim=8, attention="mixed"),
    "rnn_seq2seq_none": lambda: RNNSeq2Seq(12, 11, embed_dim=8, hidden_dim=8, attention="none"),
    "ctc": lambda: CTCModel(12, 11, embed_dim=8, hidden_dim=8),
    "seq2seq_transformer": lambda: Seq2SeqTransformer(12, 11, d_model=8, nhead=2, dim_feedforward=16),
    "nn_transformer_hnas": lambda: ak.nn.Transformer(d_model=8, nhead=2, num_encoder_layers=1,
                                                     num_decoder_layers=1, dim_feedforward=16,
                                                     positional="learned"),
    "classifier": lambda: TransformerClassifier(12, 3, d_model=8, nhead=2),
    "memn2n": lambda: MemN2N(12, dim=8, memory_size=4, sentence_len=3),
    "show_attend_tell": lambda: ShowAttendTell(12),
    "ram": lambda: RecurrentAttentionModel(num_classes=3, glimpses=2),
    "draw": lambda: DRAW(8, 8, steps=2, read_n=2, write_n=2, hidden_dim=8, latent_dim=2),
    "draw_classifier": lambda: DRAWClassifier(8, 8, num_classes=3, read_n=2, steps=2, hidden_dim=8),
}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_reset_parameters_after_to_empty_leaves_no_leftover_memory(name):
    """RNNSeq2Seq and CTCModel had no reset_parameters, and the Transformer models' re-initialized only their
    matrices (as nn.Transformer does): after to_empty, biases and LayerNorm weights held leftover memory."""
    assert_reset_leaves_no_leftover_memory(BUILDERS[name], name)
