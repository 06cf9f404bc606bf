"""The naive peers of ``attnkit bench`` (kernels/naive_peer.py) compute what attnkit's mechanisms compute."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.kernels.naive_peer import naive_call, naive_dnas, naive_hnas, naive_sinkhorn


def _inputs(Lq=9, Lk=13, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((2, 3, Lq, 8), (2, 3, Lk, 8), (2, 3, Lk, 5))
    return [(2 * torch.randn(s, generator=g, dtype=torch.float64)).requires_grad_() for s in shapes]


def _assert_same_values_and_gradients(peer, ref, inputs):
    torch.testing.assert_close(peer, ref, atol=1e-12, rtol=1e-10)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(peer, inputs, g), torch.autograd.grad(ref, inputs, g)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_naive_dnas_matches_reference():
    q, k, v = _inputs()
    ref = ak.attention(q, k, v, "dnas", backend="reference")
    _assert_same_values_and_gradients(naive_dnas(q, k, v), ref, (q, k, v))


@pytest.mark.parametrize("iters", [1, 2, 5])
def test_naive_sinkhorn_matches_reference(iters):
    q, k, v = _inputs(seed=iters)
    ref = ak.attention(q, k, v, "sinkhorn", sinkhorn_iters=iters, backend="reference")
    _assert_same_values_and_gradients(naive_sinkhorn(q, k, v, iters=iters), ref, (q, k, v))


@pytest.mark.parametrize("u", [0.0, 0.3, 1.0])
def test_naive_hnas_matches_reference(u):
    q, k, v = _inputs(Lq=13, Lk=6, seed=4)
    ref = ak.attention(q, k, v, "hnas", hybrid_weight=u, backend="reference")
    _assert_same_values_and_gradients(naive_hnas(q, k, v, u=u), ref, (q, k, v))


def test_naive_call_uses_the_bench_settings_and_refuses_other_mechanisms():
    q, k, v = _inputs(seed=5)
    sinkhorn3 = ak.attention(q, k, v, "sinkhorn", sinkhorn_iters=3, backend="reference")
    torch.testing.assert_close(naive_call("sinkhorn", 3)(q, k, v), sinkhorn3)
    hnas = ak.attention(q, k, v, "hnas", backend="reference")  # u0 = 0.5, as the bench runs it
    torch.testing.assert_close(naive_call("hnas", 3)(q, k, v), hnas)
    with pytest.raises(ValueError, match="coda"):
        naive_call("coda", 3)
    with pytest.raises(ValueError, match="iters=0"):
        naive_sinkhorn(q, k, v, iters=0)
