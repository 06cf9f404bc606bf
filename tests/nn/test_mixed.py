"""Chorowski et al.'s mixed content + location attention: Bahdanau's score plus conv features, masks."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.scores import additive


def test_matches_the_formula_float64():
    torch.manual_seed(0)
    attn = ak.nn.MixedAttention(5, 6, hidden_dim=4, num_filters=3, kernel_size=3).double()
    q = torch.randn(2, 5, dtype=torch.float64)
    keys = torch.randn(2, 7, 6, dtype=torch.float64)
    prev = torch.softmax(torch.randn(2, 7, dtype=torch.float64), dim=-1)
    context, weights = attn(q, keys, prev)
    w_conv = attn.conv.weight[:, 0]  # (F, 3)
    padded = torch.nn.functional.pad(prev, (1, 1))  # (B, L + 2)
    for b in range(2):
        f = torch.stack(
            [torch.stack([w_conv[c] @ padded[b, j : j + 3] for c in range(3)]) for j in range(7)]
        )  # (L, F)
        e = torch.stack(
            [
                attn.w @ torch.tanh(attn.w_q @ q[b] + attn.w_k @ keys[b, j] + attn.w_f @ f[j] + attn.bias)
                for j in range(7)
            ]
        )
        torch.testing.assert_close(weights[b], torch.softmax(e, dim=0), atol=1e-12, rtol=1e-10)
        torch.testing.assert_close(context[b], torch.softmax(e, dim=0) @ keys[b], atol=1e-12, rtol=1e-10)


def test_zero_location_filters_reduce_to_additive_attention():
    torch.manual_seed(1)
    attn = ak.nn.MixedAttention(6, 6).double()
    torch.nn.init.zeros_(attn.conv.weight)
    q, keys = torch.randn(2, 6, dtype=torch.float64), torch.randn(2, 5, 6, dtype=torch.float64)
    _, weights = attn(q, keys, torch.rand(2, 5, dtype=torch.float64))
    scores = additive(q[:, None, None], keys[:, None], attn.w_q, attn.w_k, attn.w, attn.bias)[:, 0, 0]
    torch.testing.assert_close(weights, torch.softmax(scores, dim=-1), atol=1e-12, rtol=1e-10)


def test_padding_equals_truncation():
    torch.manual_seed(2)
    attn = ak.nn.MixedAttention(6, 6, kernel_size=5).double()
    q, keys = torch.randn(2, 6, dtype=torch.float64), torch.randn(2, 8, 6, dtype=torch.float64)
    mask = torch.arange(8)[None, :] < torch.tensor([8, 3])[:, None]
    prev = ak.nn.MixedAttention.initial_weights(mask).double()
    prev[1, 5] = 0.7  # junk on a padded position must not leak into the real ones
    context, weights = attn(q, keys, prev, key_mask=mask)
    c1, w1 = attn(q[1:], keys[1:, :3], ak.nn.MixedAttention.initial_weights(mask[1:, :3]).double())
    torch.testing.assert_close(context[1], c1[0], atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(weights[1, :3], w1[0], atol=1e-12, rtol=1e-10)
    assert torch.all(weights[1, 3:] == 0)


def test_initial_weights_put_mass_on_the_first_real_key():
    mask = torch.tensor([[True, True, False], [False, False, False]])
    w = ak.nn.MixedAttention.initial_weights(mask)
    assert w.tolist() == [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]]


def test_even_kernel_is_rejected():
    with pytest.raises(ValueError, match="odd"):
        ak.nn.MixedAttention(4, 4, kernel_size=4)
