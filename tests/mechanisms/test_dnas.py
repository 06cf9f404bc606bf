"""Doubly-normalized attention (DNAS), "Doubly-Normalized Attention" eqs. (6)-(8) and Lemma 1 (Appendix B)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit as ak
from tests._reference import random_qkv


def _random_problem(B, Lq, Lk, spread, seed, self_attention):
    g = torch.Generator().manual_seed(seed)
    if self_attention:
        Lk = Lq
    s = torch.randn(B, 2, Lq, Lk, generator=g, dtype=torch.float64) * spread
    lk = torch.randint(1, Lk + 1, (B, 1), generator=g)
    key_mask = torch.arange(Lk)[None] < lk
    query_mask = (
        key_mask.clone()
        if self_attention
        else torch.arange(Lq)[None] < torch.randint(1, Lq + 1, (B, 1), generator=g)
    )
    return s, key_mask, query_mask


def _check_lemma1(w, key_mask, query_mask):
    n_k = key_mask.sum(-1).double()  # (B,)
    key_sums = w.sum(-2)  # (B, H, Lk): sum_i pi_ij
    has_query = query_mask.any(-1)  # (B,)
    for b in range(w.shape[0]):
        if not has_query[b]:
            continue
        valid_keys = key_sums[b][:, key_mask[b]]
        assert valid_keys.min() >= 1.0 / n_k[b] - 1e-12, (valid_keys.min().item(), 1.0 / n_k[b].item())


@settings(max_examples=40, deadline=None)
@given(
    B=st.integers(1, 3),
    Lq=st.integers(1, 7),
    Lk=st.integers(1, 7),
    spread=st.floats(0.1, 40.0),
    seed=st.integers(0, 2**16),
    self_attention=st.booleans(),
)
def test_lemma1_lower_bound(B, Lq, Lk, spread, seed, self_attention):
    """min_j sum_i pi_ij >= 1 / n_k for every valid key, padding included."""
    s, key_mask, query_mask = _random_problem(B, Lq, Lk, spread, seed, self_attention)
    w = ak.normalize(s, "dnas", key_mask=key_mask, query_mask=query_mask)
    _check_lemma1(w, key_mask, query_mask)


@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 2), L=st.integers(1, 6), scale=st.floats(0.5, 8.0), seed=st.integers(0, 2**16))
def test_lemma1_lower_bound_through_attention(B, L, scale, seed):
    q, k, v = random_qkv(B, 2, L, L, D=4, seed=seed, scale=scale)
    mask = torch.arange(L)[None] < torch.randint(
        1, L + 1, (B, 1), generator=torch.Generator().manual_seed(seed)
    )
    _, w = ak.attention(q, k, v, "dnas", key_mask=mask, query_mask=mask, return_weights=True)
    _check_lemma1(w, mask, mask)


def test_softmax_can_explain_away_where_dnas_cannot():
    """A key that no query prefers: softmax gives it almost nothing, DNAS at least 1 / n_k."""
    s = torch.tensor([[[[5.0, 5.0, -5.0], [5.0, 5.0, -5.0], [5.0, 5.0, -5.0]]]], dtype=torch.float64)
    soft = ak.normalize(s, "softmax").sum(-2)[0, 0, 2]
    doubly = ak.normalize(s, "dnas").sum(-2)[0, 0, 2]
    assert soft < 1e-3 and doubly >= 1 / 3 - 1e-12


@settings(max_examples=30, deadline=None)
@given(B=st.integers(1, 3), Lq=st.integers(1, 6), Lk=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_rows_sum_to_one(B, Lq, Lk, seed):
    s, key_mask, query_mask = _random_problem(B, Lq, Lk, 3.0, seed, False)
    w = ak.normalize(s, "dnas", key_mask=key_mask, query_mask=query_mask)
    rows = w.sum(-1)  # (B, H, Lq)
    real = query_mask[:, None, :].expand_as(rows)
    torch.testing.assert_close(rows[real], torch.ones_like(rows[real]), atol=1e-12, rtol=0)
    assert torch.all(rows[~real] == 0)


def test_equals_softmax_with_per_key_bias(backend):
    """docs/design.md section 2: DNAS is softmax attention with the bias -c_j, c_j = LSE over queries."""
    q, k, v = random_qkv(2, 2, 5, 4, seed=5)
    s = ak.scores.scaled_dot(q, k)
    c = torch.logsumexp(s, dim=-2, keepdim=True)  # (B, H, 1, Lk)
    expected = torch.softmax(s - c, dim=-1) @ v
    torch.testing.assert_close(
        ak.attention(q, k, v, "dnas", backend=backend), expected, atol=1e-12, rtol=1e-10
    )


def test_single_query_attends_uniformly(backend):
    """Known answer: with one query, xi_j1 = 1 for every key, so pi_1j = 1 / n_k."""
    q, k, v = random_qkv(2, 2, 1, 5, seed=6, scale=4.0)
    key_mask = torch.tensor([[True] * 5, [True, True, False, True, False]])
    out = ak.attention(q, k, v, "dnas", key_mask=key_mask, backend=backend)
    expected = torch.stack([v[0].mean(-2, keepdim=True), v[1][:, [0, 1, 3]].mean(-2, keepdim=True)])
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=1e-10)


def test_padded_queries_do_not_enter_the_key_normalizer():
    s = torch.randn(1, 1, 4, 3, dtype=torch.float64)
    query_mask = torch.tensor([[True, True, False, False]])
    w = ak.normalize(s, "dnas", query_mask=query_mask)
    s2 = s.clone()
    s2[..., 2:, :] = 50.0  # huge scores on padded queries must change nothing
    torch.testing.assert_close(ak.normalize(s2, "dnas", query_mask=query_mask), w, atol=0, rtol=0)
