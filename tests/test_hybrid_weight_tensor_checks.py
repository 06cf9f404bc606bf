"""A tensor hybrid_weight is checked before it mixes DNAS and softmax: values in [0, 1] (NaN is not), a 4-D
weight of (B, H, 1, 1) for this batch, and the modules' own u detached (a value for plots and logs)."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
import attnkit.nn as aknn


def _qkv(B: int = 2, H: int = 2, L: int = 4, D: int = 8):
    torch.manual_seed(0)
    return tuple(torch.randn(B, H, L, D) for _ in range(3))  # (B, H, L, D) each


@pytest.mark.parametrize("u", [torch.tensor([float("nan"), 0.5]), torch.tensor(float("nan")),
                               torch.full((2, 2, 1, 1), float("nan"))], ids=["per-head", "scalar", "4-D"])
def test_nan_hybrid_weight_is_refused(u):
    """NaN is not in [0, 1]: a check of u < 0 or u > 1 alone let it through, and the output held NaN in
    every row of the head (32 of 64 entries)."""
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"hybrid_weight has values outside \[0, 1\]"):
        ak.attention(q, k, v, "hnas", hybrid_weight=u)


@pytest.mark.parametrize("shape", [(3, 2, 1, 1), (2, 3, 1, 1), (2, 2, 4, 1)])
def test_four_d_hybrid_weight_of_another_batch_is_refused_with_the_expected_shape(shape):
    """A (B + 1, H, 1, 1) weight got torch's broadcasting RuntimeError ("The expanded size of the tensor
    (2) must match ...") instead of a ValueError that names the expected (B, H, 1, 1)."""
    q, k, v = _qkv()
    expected = r"a 4-D weight must be \(B, H, 1, 1\) with B = 2 \(or 1\) and H = 2"
    with pytest.raises(ValueError, match=expected):
        ak.attention(q, k, v, "hnas", hybrid_weight=torch.full(shape, 0.5))


def test_four_d_hybrid_weight_per_example_and_head_is_taken():
    """(B, H, 1, 1) and (1, H, 1, 1) are accepted, and example b's u is the same as a call of its own."""
    q, k, v = _qkv()
    u = torch.tensor([0.2, 0.9, 0.6, 0.4]).view(2, 2, 1, 1)  # (B, H, 1, 1)
    out = ak.attention(q, k, v, "hnas", hybrid_weight=u)
    for b in range(2):
        own = u[b:b + 1]  # (1, H, 1, 1)
        alone = ak.attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], "hnas", hybrid_weight=own)
        torch.testing.assert_close(out[b:b + 1], alone)


def test_module_u_and_hybrid_weights_are_detached():
    """u = sigmoid(theta) is read for plots and logs: it must not carry theta's graph (a u that requires
    grad kept the graph alive and made .numpy() fail)."""
    module = aknn.MultiheadAttention(8, 2, mechanism="hnas", batch_first=True)
    assert module.theta.requires_grad
    assert not module.u.requires_grad
    assert not aknn.hybrid_weights(module).requires_grad
    assert module.u.numpy().shape == (2,)
