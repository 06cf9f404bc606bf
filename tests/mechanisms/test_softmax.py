"""Softmax (LNAS) attention, "Doubly-Normalized Attention" eq. (1)/(3): rows sum to 1 over valid keys."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit as ak
from tests._reference import random_qkv


def test_matches_torch_sdpa(backend):
    q, k, v = random_qkv(2, 3, 5, 7, D=8, Dv=4, seed=3)
    mask = torch.rand(2, 1, 5, 7, generator=torch.Generator().manual_seed(0)) < 0.7
    mask[..., 0] = True  # SDPA returns NaN on rows without a valid key
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(ak.attention(q, k, v, "softmax", attn_mask=mask, backend=backend), expected)
    torch.testing.assert_close(
        ak.attention(q, k, v, "softmax", causal=True, backend=backend)[:, :, :, :],
        F.scaled_dot_product_attention(q, k, v, is_causal=True),
    )


@settings(max_examples=30, deadline=None)
@given(
    B=st.integers(1, 3),
    Lq=st.integers(1, 6),
    Lk=st.integers(1, 6),
    spread=st.floats(0.1, 30.0),
    seed=st.integers(0, 2**16),
)
def test_rows_sum_to_one(B, Lq, Lk, spread, seed):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(B, 2, Lq, Lk, generator=g, dtype=torch.float64) * spread
    key_mask = torch.rand(B, Lk, generator=g) < 0.7
    query_mask = torch.rand(B, Lq, generator=g) < 0.8
    w = ak.normalize(s, "softmax", key_mask=key_mask, query_mask=query_mask)
    has_key = (key_mask.any(-1)[:, None] & query_mask)[:, None, :].expand(B, 2, Lq)  # (B, H, Lq)
    rows = w.sum(-1)
    torch.testing.assert_close(rows[has_key], torch.ones_like(rows[has_key]), atol=1e-12, rtol=0)
    assert torch.all(rows[~has_key] == 0)
    assert torch.all(w >= 0)
    assert torch.all(w[~(key_mask[:, None, None, :] & query_mask[:, None, :, None]).expand_as(w)] == 0)
