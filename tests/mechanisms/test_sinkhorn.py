"""Sinkhorn attention with k iterations ("Doubly-Normalized Attention" section 4; "Attention that does not
Explain Away" (arXiv:2009.14308) section 3.2)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit as ak
from tests._reference import random_qkv


def test_zero_iterations_equal_softmax(backend):
    q, k, v = random_qkv(2, 2, 4, 6, seed=1)
    m = torch.tensor([[True] * 6, [True] * 3 + [False] * 3])
    torch.testing.assert_close(
        ak.attention(q, k, v, "sinkhorn", sinkhorn_iters=0, key_mask=m, backend=backend),
        ak.attention(q, k, v, "softmax", key_mask=m, backend=backend),
        atol=1e-12, rtol=0,
    )


def test_one_iteration_equals_dnas(backend):
    q, k, v = random_qkv(2, 2, 5, 6, seed=2)
    km = torch.tensor([[True] * 6, [True] * 3 + [False] * 3])
    qm = torch.tensor([[True] * 5, [True] * 2 + [False] * 3])
    torch.testing.assert_close(
        ak.attention(q, k, v, ak.Sinkhorn(iters=1), key_mask=km, query_mask=qm, backend=backend),
        ak.attention(q, k, v, "dnas", key_mask=km, query_mask=qm, backend=backend),
        atol=1e-12, rtol=0,
    )


@settings(max_examples=25, deadline=None)
@given(
    B=st.integers(1, 3),
    Lq=st.integers(1, 6),
    Lk=st.integers(1, 6),
    seed=st.integers(0, 2**16),
)
def test_many_iterations_give_rows_one_and_columns_nq_over_nk(B, Lq, Lk, seed):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(B, 2, Lq, Lk, generator=g, dtype=torch.float64)
    nq = torch.randint(1, Lq + 1, (B,), generator=g)
    nk = torch.randint(1, Lk + 1, (B,), generator=g)
    qm, km = torch.arange(Lq)[None] < nq[:, None], torch.arange(Lk)[None] < nk[:, None]
    w = ak.normalize(s, "sinkhorn", sinkhorn_iters=200, key_mask=km, query_mask=qm)
    for b in range(B):
        block = w[b, :, : nq[b], : nk[b]]
        torch.testing.assert_close(block.sum(-1), torch.ones_like(block.sum(-1)), atol=1e-7, rtol=0)
        cols = block.sum(-2)
        torch.testing.assert_close(
            cols, torch.full_like(cols, nq[b].item() / nk[b].item()), atol=1e-6, rtol=0
        )
        assert w[b].sum() == pytest.approx(2 * nq[b].item())  # H = 2 heads; nothing leaks into padding


def test_more_iterations_balance_the_columns():
    s = torch.randn(1, 2, 6, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 3
    gaps = [
        (ak.normalize(s, "sinkhorn", sinkhorn_iters=it).sum(-2) - 1).abs().max().item()
        for it in (0, 1, 5, 50)
    ]
    assert gaps[0] > 0.1 and gaps[2] > gaps[3] and gaps[3] < 1e-6, gaps
