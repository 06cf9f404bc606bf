"""ak.nn.hybrid_weights: the (layers, heads) matrix of u = sigmoid(theta) of every HNAS module."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
import attnkit.nn as aknn


def test_collects_u_in_module_order():
    model = torch.nn.Sequential(
        aknn.MultiheadAttention(8, 4, mechanism="hnas"),
        aknn.MultiheadAttention(8, 4, mechanism="softmax"),
        aknn.TransformerEncoderLayer(8, 4, 16, mechanism=ak.Hybrid(u0=0.2)),
    )
    with torch.no_grad():
        model[0].theta.copy_(torch.tensor([0.0, 1.0, -1.0, 2.0]))
    u = aknn.hybrid_weights(model)
    assert u.shape == (2, 4) and not u.requires_grad
    torch.testing.assert_close(u[0], torch.sigmoid(torch.tensor([0.0, 1.0, -1.0, 2.0])))
    torch.testing.assert_close(u[1], torch.full((4,), 0.2))


def test_u_moves_with_training():
    module = aknn.MultiheadAttention(8, 2, mechanism="hnas")
    before = aknn.hybrid_weights(module).clone()
    x = torch.randn(2, 5, 8)
    opt = torch.optim.SGD(module.parameters(), lr=1.0)
    module(x, x, x)[0].pow(2).sum().backward()
    opt.step()
    assert not torch.allclose(aknn.hybrid_weights(module), before)


def test_no_hybrid_module_raises():
    with pytest.raises(ValueError, match="no hnas attention module"):
        aknn.hybrid_weights(aknn.TransformerEncoderLayer(8, 2, 16, mechanism="dnas"))


def test_different_head_counts_raise():
    model = torch.nn.ModuleList(
        [aknn.MultiheadAttention(8, 2, mechanism="hnas"), aknn.MultiheadAttention(8, 4, mechanism="hnas")]
    )
    with pytest.raises(ValueError, match="different head counts"):
        aknn.hybrid_weights(model)
