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


def test_padded_nan_and_inf_keys_and_values_equal_truncation():
    """Padded keys holding inf raised "scores contain NaN"; padded values holding NaN made the context NaN."""
    torch.manual_seed(3)
    attn = ak.nn.MixedAttention(6, 6, kernel_size=3).double()
    q, keys = torch.randn(2, 6, dtype=torch.float64), torch.randn(2, 6, 6, dtype=torch.float64)
    values = torch.randn(2, 6, 2, dtype=torch.float64)
    mask = torch.arange(6)[None, :] < torch.tensor([6, 4])[:, None]
    keys[1, 4:] = float("inf")
    values[1, 4:] = float("nan")
    prev = ak.nn.MixedAttention.initial_weights(mask).double()
    context, weights = attn(q, keys, prev, values, key_mask=mask)
    context[1].sum().backward()
    grads = [p.grad.clone() for p in attn.parameters()]
    attn.zero_grad()
    c1, w1 = attn(q[1:], keys[1:, :4], prev[1:, :4], values[1:, :4])
    c1.sum().backward()
    torch.testing.assert_close(context[1], c1[0], atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(weights[1, :4], w1[0], atol=1e-12, rtol=1e-10)
    for g, p in zip(grads, attn.parameters()):
        torch.testing.assert_close(g, p.grad, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("mechanism", ["dnas", "hnas", "sinkhorn"])
def test_query_normalized_mechanisms_are_refused(mechanism):
    """A step has one query: dnas gave uniform weights (every key 1/Lk) without a word."""
    with pytest.raises(ValueError, match=f"mechanism='{mechanism}' normalizes over queries.*'softmax'"):
        ak.nn.MixedAttention(4, 4, mechanism=mechanism)


def test_no_keys_give_a_zero_context():
    """Lk = 0 raised torch's "Kernel size can't be greater than actual input size"; ContentAttention
    returns a zero context there, and so does MixedAttention."""
    attn = ak.nn.MixedAttention(4, 4, kernel_size=3)
    context, weights = attn(torch.randn(2, 4), torch.randn(2, 0, 4), torch.zeros(2, 0), torch.randn(2, 0, 3))
    assert context.shape == (2, 3) and torch.all(context == 0) and weights.shape == (2, 0)


def test_bad_inputs_name_the_value_and_the_fix():
    attn = ak.nn.MixedAttention(4, 5, kernel_size=3)
    q, keys, prev = torch.randn(2, 4), torch.randn(2, 6, 5), torch.zeros(2, 6)
    with pytest.raises(ValueError, match=r"query has dtype torch.float64 but MixedAttention's parameters are "
                       r"torch.float32; cast the inputs with .to\(torch.float32\) or the module"):
        attn(q.double(), keys.double(), prev.double())
    with pytest.raises(ValueError, match=r"query has shape \(2, 3\); expected \(B, query_dim\) = \(B, 4\)"):
        attn(torch.randn(2, 3), keys, prev)
    with pytest.raises(ValueError, match=r"keys has shape \(2, 6, 4\); expected \(B, Lk, key_dim\)"):
        attn(q, torch.randn(2, 6, 4), prev)
    with pytest.raises(ValueError, match="values has dtype torch.int64; expected a floating dtype"):
        attn(q, keys, prev, torch.ones(2, 6, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"values has shape \(2, 5, 3\); expected \(B, Lk, Dv\) = \(2, 6,"):
        attn(q, keys, prev, torch.ones(2, 5, 3))


def test_non_finite_previous_weights_on_real_keys_are_named():
    """A NaN in prev_weights surfaced as "scores contain NaN", pointing at the score function."""
    attn = ak.nn.MixedAttention(4, 4, kernel_size=3)
    prev = torch.zeros(2, 5)
    prev[0, 1] = float("nan")
    with pytest.raises(ValueError, match="prev_weights contains NaN or inf on a real key"):
        attn(torch.randn(2, 4), torch.randn(2, 5, 4), prev)
    mask = torch.tensor([[True, False, True, True, True]] * 2)  # a NaN on a padded key does not matter
    assert torch.isfinite(attn(torch.randn(2, 4), torch.randn(2, 5, 4), prev, key_mask=mask)[0]).all()
