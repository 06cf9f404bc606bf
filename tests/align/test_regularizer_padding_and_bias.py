"""AlignmentRegularizer against the standalone losses on queries and keys computed by hand.

The existing tests captured modules with zero projection biases and self-attention padding only (query mask ==
key mask), so a swap of ``b_q``/``b_k`` or of ``q_mask``/``k_mask`` gave the same numbers. Here the biases are
random, the queries carry their own padding, one sample has no real token, and gamma/weight are not the
defaults. Everything runs in float64.
"""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.align import AlignmentRegularizer, ct_loss, gan_loss, mmd, ot_loss

B, L, E, H = 2, 5, 8, 2


def _module():
    """A float64 attnkit MultiheadAttention with random (trained-like) projection biases."""
    torch.manual_seed(0)
    m = ak.nn.MultiheadAttention(E, H, mechanism="softmax", batch_first=True).double()
    with torch.no_grad():
        m.in_proj_bias.normal_()
    return m


def _x(batch: int = B):
    return torch.randn(batch, L, E, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def _heads(t):
    """``(b, L, E) -> (b, H, L, E / H)``."""
    return t.view(t.shape[0], L, H, E // H).transpose(1, 2)  # (b, H, L, d)


def _qk_by_hand(m, x):
    """``q = x W_q^T + b_q`` and ``k = x W_k^T + b_k``, split into heads: ``(b, H, L, d)`` each."""
    w_q, w_k, _ = m.in_proj_weight.chunk(3)
    b_q, b_k, _ = m.in_proj_bias.chunk(3)
    return _heads(x @ w_q.T + b_q), _heads(x @ w_k.T + b_k)


def _standalone(reg, q, k, q_mask, k_mask):
    """``(B, H)`` values of the regularizer's method from the public loss functions."""
    cfg = reg.config
    if cfg.method == "gan":
        return gan_loss(q, k, reg.discriminators[0], q_mask, k_mask, gamma=cfg.gamma)
    if cfg.method == "ct":
        return ct_loss(q, k, reg.critics[0], reg.navigators[0], q_mask, k_mask, rho=cfg.rho, gamma=cfg.gamma)
    if cfg.method == "ot":
        return ot_loss(q, k, q_mask, k_mask, blur=cfg.blur, scaling=cfg.scaling)
    return mmd(q, k, key_mask=k_mask, query_mask=q_mask)


@pytest.mark.parametrize("method", ["mmd", "gan", "ct", "ot"])
def test_loss_with_query_padding_matches_the_standalone_loss(method):
    """With a query_padding_mask (queries padded, keys all real) the loss passed the key mask as the query
    mask or the other way round: mmd 3.495352 instead of 3.216769, ct 0.290536 instead of 0.254960, ot
    4.314238 instead of 4.566465, gan 1.376363 instead of 1.373496."""
    m, x = _module(), _x()
    qpad = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 0, 0, 1]], dtype=torch.bool)  # True = padded query
    torch.manual_seed(2)
    reg = AlignmentRegularizer(m, method=method, weight=1.0)
    m(x, x, x, query_padding_mask=qpad)
    q, k = _qk_by_hand(m, x)
    want = _standalone(reg, q, k, ~qpad, torch.ones(B, L, dtype=torch.bool)).mean()
    torch.testing.assert_close(reg.loss(), want, atol=1e-10, rtol=1e-9)


def test_captured_queries_and_keys_carry_their_own_projection_bias():
    """``b_q`` and ``b_k`` were swapped in the capture of a MultiheadAttention: the captured q was 2.68 off
    ``x W_q^T + b_q`` and the mmd loss read 2.667 instead of 3.060."""
    m, x = _module(), _x()
    reg = AlignmentRegularizer(m, method="mmd", weight=1.0)
    m(x, x, x)
    q, k = _qk_by_hand(m, x)
    torch.testing.assert_close(reg.loss(), mmd(q, k).mean(), atol=1e-10, rtol=1e-9)
    torch.testing.assert_close(reg.mmd_per_head()[0].double(), mmd(q, k).mean(0), atol=1e-5, rtol=1e-5)


def test_a_sample_without_real_tokens_is_left_out_of_the_means():
    """A sample whose tokens are all padding was averaged in as a 0: the loss read 0.804591 instead of
    1.206887 and mmd_per_head [0.903, 0.706] instead of [1.355, 1.059] (means over the two real samples)."""
    m, x = _module(), _x(3)
    pad = torch.zeros(3, L, dtype=torch.bool)
    pad[1] = True  # sample 1: no real token
    pad[2, 3:] = True
    reg = AlignmentRegularizer(m, method="mmd", weight=1.0)
    m(x, x, x, key_padding_mask=pad)
    q, k = _qk_by_hand(m, x)
    per = mmd(q, k, key_mask=~pad, query_mask=~pad)  # (3, H)
    assert per[[0, 2]].min().item() > 0.1
    torch.testing.assert_close(reg.loss(), per[[0, 2]].mean(), atol=1e-10, rtol=1e-9)
    torch.testing.assert_close(reg.mmd_per_head()[0].double(), per[[0, 2]].mean(0), atol=1e-5, rtol=1e-5)


def _critic_grads(gamma: float):
    m, x = _module(), _x()
    torch.manual_seed(2)
    reg = AlignmentRegularizer(m, method="ct", weight=1.0, gamma=gamma)
    m(x, x, x)
    reg.loss().backward()
    return [p.grad.clone() for p in reg.critics.parameters()], m.in_proj_weight.grad.clone()


def test_ct_critic_gradient_is_reversed_and_scaled_by_gamma():
    """ct's gradient-reversal factor was fixed at 1: with gamma=3 the critic's gradient summed to 4.85 in
    absolute value instead of 14.54 (3 times that of gamma=1); the model's own gradient is unchanged."""
    grads_1, model_1 = _critic_grads(1.0)
    grads_3, model_3 = _critic_grads(3.0)
    assert sum(g.abs().sum() for g in grads_1).item() > 0.1
    for g1, g3 in zip(grads_1, grads_3):
        torch.testing.assert_close(g3, 3.0 * g1, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(model_3, model_1, atol=1e-12, rtol=1e-10)


def test_zero_weight_keeps_the_regularizer_parameters_in_the_graph():
    """With weight=0 the loss was detached: reg.loss().requires_grad was False and the critic's gradients
    None instead of zeros after backward (DDP without find_unused_parameters and sync_gradients need them)."""
    m, x = _module(), _x()
    reg = AlignmentRegularizer(m, method="ct", weight=0.0)
    out, _ = m(x, x, x)
    loss = reg.loss()
    assert loss.requires_grad
    assert loss.item() == 0.0
    (out.sum() + loss).backward()
    grads = [p.grad for p in reg.parameters()]
    assert grads and all(g is not None for g in grads)
    assert all(torch.count_nonzero(g).item() == 0 for g in grads)


def test_a_float_key_padding_mask_reads_small_negative_biases_as_real_tokens():
    """capture read torch's additive key padding mask by "> MASKED_BIAS"; a mutant reading ">= 0" (every
    negative bias as padding, as an ALiBi-like -0.5 would be) survived every test."""
    from attnkit.align.capture import _real

    mask = torch.tensor([[0.0, -0.5, -30.0, float("-inf"), -1e9]])  # (B, L) additive: -inf / huge = padding
    assert _real(mask, 1, 5, "cpu").tolist() == [[True, True, True, False, False]]
    assert _real(mask == float("-inf"), 1, 5, "cpu").tolist() == [[True, True, True, False, True]]
    assert _real(None, 1, 5, "cpu").all()
