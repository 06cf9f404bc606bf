"""Graves' Gaussian-mixture location attention: the window of the lecture's formula, monotonic kappa,
masks."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit as ak


@pytest.mark.parametrize("parameterization", ["exp", "softplus"])
def test_kappa_is_non_decreasing_over_steps(parameterization):
    torch.manual_seed(0)
    attn = ak.nn.GMMLocationAttention(8, 3, parameterization=parameterization).double()
    torch.nn.init.normal_(attn.proj.weight, std=2.0)  # large, varied pre-activations
    values = torch.randn(4, 10, 5, dtype=torch.float64)
    kappa = attn.initial_kappa(4)
    for _ in range(12):
        _, _, new = attn(torch.randn(4, 8, dtype=torch.float64), values, kappa)
        assert torch.all(new > kappa)
        kappa = new


@pytest.mark.parametrize("parameterization", ["exp", "softplus"])
def test_window_matches_the_lecture_formula_float64(parameterization):
    torch.manual_seed(1)
    attn = ak.nn.GMMLocationAttention(6, 2, parameterization=parameterization).double()
    f = torch.exp if parameterization == "exp" else torch.nn.functional.softplus
    q = torch.randn(2, 6, dtype=torch.float64)
    values = torch.randn(2, 7, 3, dtype=torch.float64)
    prev = torch.tensor([[0.5, 1.0], [2.0, 0.0]], dtype=torch.float64)
    window, phi, kappa = attn(q, values, prev)
    raw = (q @ attn.proj.weight.T + attn.proj.bias).detach()  # (B, 3K): alpha_hat, beta_hat, kappa_hat
    for b in range(2):
        a, be, kh = f(raw[b, :2]), f(raw[b, 2:4]), raw[b, 4:]
        kap = prev[b] + f(kh)
        torch.testing.assert_close(kappa[b], kap, atol=1e-12, rtol=1e-10)
        expected = torch.tensor(
            [
                sum(float(a[k]) * math.exp(-float(be[k]) * (float(kap[k]) - u) ** 2) for k in range(2))
                for u in range(1, 8)  # positions u = 1 .. U, as in Graves and the lecture
            ],
            dtype=torch.float64,
        )
        torch.testing.assert_close(phi[b], expected, atol=1e-12, rtol=1e-10)
        torch.testing.assert_close(window[b], expected @ values[b], atol=1e-12, rtol=1e-10)


def test_padding_equals_truncation():
    torch.manual_seed(2)
    attn = ak.nn.GMMLocationAttention(6, 3).double()
    q = torch.randn(2, 6, dtype=torch.float64)
    values = torch.randn(2, 9, 4, dtype=torch.float64)
    mask = torch.arange(9)[None, :] < torch.tensor([9, 5])[:, None]
    kappa = torch.tensor([[1.0, 2.0, 3.0], [3.0, 4.0, 4.5]], dtype=torch.float64)
    window, phi, new = attn(q, values, kappa, key_mask=mask)
    w1, p1, k1 = attn(q[1:], values[1:, :5], kappa[1:])
    torch.testing.assert_close(window[1], w1[0], atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(phi[1, :5], p1[0], atol=1e-12, rtol=1e-10)
    assert torch.all(phi[1, 5:] == 0)
    torch.testing.assert_close(new[1], k1[0])


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_padding_before_or_between_the_values_equals_truncation(dtype):
    """Positions were absolute (u = 1 .. U) while kappa starts at 0: two padded positions in front moved
    the window by two (up to 5.3 off the truncated sequence over 4 steps); the docstring promised
    padding = truncation."""
    torch.manual_seed(4)
    attn = ak.nn.GMMLocationAttention(6, 2).to(dtype)
    real = torch.tensor([True, True, False, True, True, True, False])  # (U,): 5 real values
    layouts = torch.stack([real, torch.cat([torch.tensor([False, False]), real[real]])])  # hole; left pad
    values = torch.randn(2, 7, 3, dtype=dtype)
    kappa = attn.initial_kappa(2).to(dtype)
    alone = [attn.initial_kappa(1).to(dtype) for _ in range(2)]  # each example's kappa, run alone
    tol = dict(atol=1e-12, rtol=1e-10) if dtype == torch.float64 else dict(atol=2e-2, rtol=2e-2)
    for _ in range(4):
        q = torch.randn(2, 6, dtype=dtype)
        window, phi, kappa = attn(q, values, kappa, key_mask=layouts)
        for b in range(2):
            w1, p1, alone[b] = attn(q[b:b + 1], values[b, layouts[b]][None], alone[b])  # (1, 5, 3) values
            torch.testing.assert_close(window[b], w1[0], **tol)
            torch.testing.assert_close(phi[b, layouts[b]], p1[0], **tol)
            assert torch.all(phi[b, ~layouts[b]] == 0)
            torch.testing.assert_close(kappa[b], alone[b][0], **tol)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="parameterization"):
        ak.nn.GMMLocationAttention(4, 2, parameterization="relu")
    with pytest.raises(ValueError, match="num_components"):
        ak.nn.GMMLocationAttention(4, 0)
    attn = ak.nn.GMMLocationAttention(4, 2)
    with pytest.raises(ValueError, match="initial_kappa"):
        attn(torch.randn(3, 4), torch.randn(3, 5, 2), torch.zeros(3, 3))


def test_the_first_step_is_centred_on_the_first_value():
    """Positions are u = 1..U with kappa_0 = 0 (Graves eqs. 46-51): at the initial bias (one position per
    step) step t peaks on value t. With u = 0..U-1 step 1 peaked on the second value, step U past the end."""
    attn = ak.nn.GMMLocationAttention(4, 1, parameterization="softplus")
    torch.nn.init.zeros_(attn.proj.weight)  # the initial bias alone
    U = 5
    values = torch.eye(U)[None]  # window = phi
    kappa = attn.initial_kappa(1)
    for t in range(1, U + 1):
        _, phi, kappa = attn(torch.zeros(1, 4), values, kappa)
        assert phi.argmax().item() == t - 1 and float(phi[0, t - 1]) == pytest.approx(1.0)


def test_padded_nan_and_inf_values_equal_truncation():
    """phi is 0 on padded positions, but 0 * NaN made the whole window NaN; padding must not matter, for the
    window or the gradients of the real values and of the projection."""
    torch.manual_seed(3)
    attn = ak.nn.GMMLocationAttention(6, 2).double()
    q = torch.randn(2, 6, dtype=torch.float64)
    values = torch.randn(2, 7, 3, dtype=torch.float64)
    values[1, 4] = float("nan")
    values[1, 5:] = float("inf")
    values.requires_grad_(True)
    mask = torch.arange(7)[None, :] < torch.tensor([7, 4])[:, None]
    kappa = attn.initial_kappa(2) + 1.5
    window, phi, _ = attn(q, values, kappa, key_mask=mask)
    window[1].sum().backward()
    grads = [p.grad.clone() for p in attn.parameters()]
    attn.zero_grad()
    alone = values.detach()[1:, :4].clone().requires_grad_(True)
    w1, _, _ = attn(q[1:], alone, kappa[1:])
    w1.sum().backward()
    torch.testing.assert_close(window[1], w1[0], atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(values.grad[1, :4], alone.grad[0], atol=1e-12, rtol=1e-10)
    assert torch.all(values.grad[1, 4:] == 0)
    for g, p in zip(grads, attn.parameters()):
        torch.testing.assert_close(g, p.grad, atol=1e-12, rtol=1e-10)


def test_a_nan_kappa_is_named_as_kappa_not_as_an_overflow():
    attn = ak.nn.GMMLocationAttention(4, 2)
    kappa = attn.initial_kappa(2)
    kappa[1, 0] = float("nan")
    with pytest.raises(ValueError, match="kappa contains NaN or inf; pass the kappa returned by"):
        attn(torch.randn(2, 4), torch.randn(2, 5, 3), kappa)


@pytest.mark.parametrize("offset", [float("inf"), float("nan"), 0.0, -1.0, True])
def test_init_offset_must_be_a_finite_positive_number(offset):
    with pytest.raises(ValueError, match=r"init_offset=.*expected a finite positive number"):
        ak.nn.GMMLocationAttention(4, 2, init_offset=offset)
