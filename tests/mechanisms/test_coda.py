"""CoDA quasi-attention, "Compositional De-Attention Networks" eqs. (3)-(6) and (10); docs/design.md section
3."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit as ak
from tests._reference import random_qkv


def test_equals_eq10_of_the_coda_paper(backend):
    """A = (tanh(Q K^T / sqrt(dk)) * 2 sigmoid(G(Q, K) / sqrt(dk))) V, G the negated outer L1 distance."""
    q, k, v = random_qkv(2, 3, 5, 7, D=6, seed=1)
    dk = q.shape[-1]
    G = -torch.cdist(q, k, p=1)  # (B, H, Lq, Lk)
    E = q @ k.transpose(-2, -1) / math.sqrt(dk)
    expected = (torch.tanh(E) * 2 * torch.sigmoid(G / math.sqrt(dk))) @ v
    torch.testing.assert_close(
        ak.attention(q, k, v, "coda", backend=backend), expected, atol=1e-12, rtol=1e-10
    )
    centered = G / math.sqrt(dk) - (G / math.sqrt(dk)).mean(dim=(-2, -1), keepdim=True)
    expected_centered = (torch.tanh(E) * torch.sigmoid(centered)) @ v
    torch.testing.assert_close(
        ak.attention(q, k, v, ak.CoDA(gate="centered"), backend=backend),
        expected_centered,
        atol=1e-12,
        rtol=1e-10,
    )


GATES_AND_OPTIONS = st.fixed_dictionaries({
    "gate": st.sampled_from(["sigmoid", "scaled", "centered"]),
    "center_e": st.booleans(),
    "alpha": st.floats(0.05, 20.0),
    "beta": st.floats(0.05, 20.0),
})


@settings(max_examples=30, deadline=None)
@given(
    options=GATES_AND_OPTIONS, spread=st.floats(0.1, 30.0), seed=st.integers(0, 2**16), L=st.integers(1, 6)
)
def test_weights_lie_in_minus_one_one(options, spread, seed, L):
    q, k, v = random_qkv(2, 2, L, L + 1, D=4, seed=seed, scale=spread)
    km = torch.arange(L + 1)[None] < torch.tensor([[L + 1], [max(1, L // 2)]])
    _, w = ak.attention(q, k, v, ak.CoDA(**options), key_mask=km, return_weights=True)
    assert torch.isfinite(w).all()
    assert w.min() >= -1.0 and w.max() <= 1.0
    if options["gate"] == "sigmoid":  # a raw sigmoid of a non-positive N lies in (0, 0.5]
        assert w.abs().max() <= 0.5 + 1e-12


def test_raw_sigmoid_gate_is_at_most_one_half():
    q, k, v = random_qkv(2, 2, 6, 6, seed=3, scale=5.0)
    _, w = ak.attention(q, k, v, ak.CoDA(gate="sigmoid"), return_weights=True)
    assert w.abs().max() <= 0.5
    _, w2 = ak.attention(q, k, v, ak.CoDA(gate="scaled"), return_weights=True)
    torch.testing.assert_close(w2, 2 * w, atol=1e-12, rtol=0)


def test_masks_are_multiplicative():
    """Invalid pairs weigh exactly 0 (an additive -inf would give tanh(-inf) = -1)."""
    q, k, v = random_qkv(2, 2, 4, 5, seed=4)
    km = torch.tensor([[True] * 5, [True, True, False, False, False]])
    mask = torch.ones(4, 5, dtype=torch.bool).tril()
    _, w = ak.attention(q, k, v, "coda", key_mask=km, attn_mask=mask, return_weights=True)
    invalid = ~(km[:, None, None, :] & mask).expand_as(w)
    assert torch.all(w[invalid] == 0) and torch.all(w[~invalid] != 0)


def test_no_normalization_rows_do_not_sum_to_one():
    q, k, v = random_qkv(1, 2, 5, 5, seed=5)
    _, w = ak.attention(q, k, v, "coda", return_weights=True)
    assert (w.sum(-1) - 1).abs().max() > 0.1
    assert (w < 0).any(), "tanh(E) lets CoDA subtract values"


def test_large_alpha_saturates_to_the_sign_of_e():
    q, k, v = random_qkv(1, 2, 4, 4, seed=6)
    s = ak.scores.scaled_dot(q, k)
    n = ak.scores.neg_l1_distance(q, k)
    w = ak.normalize(s, ak.CoDA(alpha=1e4), gate_scores=n)
    torch.testing.assert_close(w, torch.sign(s) * 2 * torch.sigmoid(n), atol=1e-6, rtol=0)


def test_centered_means_run_over_valid_entries_only():
    q, k, v = random_qkv(1, 2, 4, 5, seed=7)
    km = torch.tensor([[True, True, True, False, False]])
    config = ak.CoDA(gate="centered", center_e=True)
    padded = ak.attention(q, k, v, config, key_mask=km)
    alone = ak.attention(q, k[:, :, :3], v[:, :, :3], config)
    torch.testing.assert_close(padded, alone, atol=1e-12, rtol=0)
