"""Module arguments read strictly: ``is_causal`` as a flag, ``Sinkhorn(iters=0)`` (softmax) accepted wherever
softmax is, ``u0`` agreeing with the config within float32 precision."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnkit as ak
from attnkit.models.rnn_seq2seq import RNNSeq2Seq

SOFTMAX_SINKHORN = ak.Sinkhorn(iters=0)  # no column normalization: softmax (docs/design.md section 2)


@pytest.mark.parametrize("value", ["False", "no", "True", 0.5])
def test_is_causal_that_is_not_a_flag_raises_naming_the_value(value):
    """``is_causal="False"`` applied a causal mask (``bool("False")`` is True)."""
    torch.manual_seed(0)
    x = torch.randn(1, 3, 4)
    mha = ak.nn.MultiheadAttention(4, 1, batch_first=True)
    layer = ak.nn.TransformerEncoderLayer(4, 1, 8, dropout=0.0, batch_first=True)
    encoder = ak.nn.TransformerEncoder(layer, 2)
    decoder = ak.nn.TransformerDecoder(ak.nn.TransformerDecoderLayer(4, 1, 8, batch_first=True), 1)
    calls = [lambda: mha(x, x, x, is_causal=value), lambda: layer(x, is_causal=value),
             lambda: encoder(x, is_causal=value), lambda: decoder(x, x, tgt_is_causal=value)]
    for call in calls:
        with pytest.raises(ValueError, match=rf"is_causal={value!r}; expected True or False"):
            call()


def test_is_causal_flags_equal_to_true_or_false_are_read_as_such():
    torch.manual_seed(0)
    x = torch.randn(1, 3, 4)
    mha = ak.nn.MultiheadAttention(4, 1, batch_first=True).eval()
    plain, causal = mha(x, x, x)[0], mha(x, x, x, is_causal=True)[0]
    assert not torch.allclose(plain, causal)
    for value in (False, np.bool_(False), 0, None):
        torch.testing.assert_close(mha(x, x, x, is_causal=value)[0], plain)
    for value in (np.bool_(True), 1):
        torch.testing.assert_close(mha(x, x, x, is_causal=value)[0], causal)


def test_sinkhorn_with_zero_iterations_is_accepted_wherever_softmax_is():
    """The decoder layers, ak.nn.Transformer, MixedAttention and ContentAttention refused it as normalizing
    over queries, which it does not."""
    torch.manual_seed(0)
    ak.nn.TransformerDecoderLayer(4, 1, 8, self_mechanism=SOFTMAX_SINKHORN)
    ak.nn.TransformerDecoderLayer(4, 1, 8, cross_mechanism=SOFTMAX_SINKHORN)
    ak.nn.Transformer(8, 2, 1, 1, 16, decoder_mechanism=SOFTMAX_SINKHORN, cross_mechanism=SOFTMAX_SINKHORN)
    query, keys = torch.randn(2, 4), torch.randn(2, 5, 3)
    torch.manual_seed(1)
    mixed = ak.nn.MixedAttention(4, 3, mechanism=SOFTMAX_SINKHORN)
    torch.manual_seed(1)
    reference = ak.nn.MixedAttention(4, 3, mechanism="softmax")
    prev = torch.softmax(torch.randn(2, 5), -1)
    torch.testing.assert_close(mixed(query, keys, prev)[1], reference(query, keys, prev)[1])
    dot = ak.nn.DotAttention(mechanism=SOFTMAX_SINKHORN)
    torch.testing.assert_close(dot(torch.randn(2, 3), keys)[1].sum(-1), torch.ones(2))  # one step's weights
    RNNSeq2Seq(10, 10, embed_dim=4, hidden_dim=4, mechanism=SOFTMAX_SINKHORN)
    for mechanism in ("sinkhorn", ak.Sinkhorn(iters=1)):  # one iteration or more normalizes over queries
        with pytest.raises(ValueError, match="not allowed in a decoder"):
            ak.nn.TransformerDecoderLayer(4, 1, 8, self_mechanism=mechanism)
        with pytest.raises(ValueError, match="normalizes over queries"):
            ak.nn.MixedAttention(4, 3, mechanism=mechanism)


def test_u0_equal_to_the_config_within_float32_precision_agrees():
    """``u0=np.float32(0.3)`` with ``ak.Hybrid(u0=0.3)`` raised "contradicts the config"."""
    m = ak.nn.MultiheadAttention(8, 2, mechanism=ak.Hybrid(u0=0.3), u0=np.float32(0.3))
    assert m.config == ak.Hybrid(u0=0.3)
    torch.testing.assert_close(m.u, torch.full((2,), 0.3))
    with pytest.raises(ValueError, match="u0=0.31 contradicts the config Hybrid"):
        ak.nn.MultiheadAttention(8, 2, mechanism=ak.Hybrid(u0=0.3), u0=0.31)
