"""reinforce_loss's entropy bonus rewards exploration (its sign), and GMMLocationAttention starts from the
window its docstring promises: alpha = 1, beta = 0.5, a step of init_offset positions, weights near zero."""

from __future__ import annotations

import math

import pytest
import torch

from attnkit.nn.hard import hard_attention, reinforce_loss
from attnkit.nn.location import PARAMETERIZATIONS, GMMLocationAttention


def _entropy(p: torch.Tensor) -> float:
    return float(-(p * p.log()).sum())


def test_entropy_only_loss_is_minus_the_weighted_mean_entropy():
    """-mean(lambda_r (R - b) log p + lambda_e H): with the reward term zero the loss is -lambda_e * mean(H).
    An entropy bonus subtracted from the surrogate gave +0.075 here instead of -0.075."""
    log_prob = torch.tensor([-0.5, -1.5])
    entropy = torch.tensor([0.5, 1.0])
    loss = reinforce_loss(log_prob, torch.zeros(2), entropy=entropy, reward_weight=0.0, entropy_weight=0.1)
    torch.testing.assert_close(loss, torch.tensor(-0.075))


def test_entropy_bonus_gradient_step_raises_the_entropy():
    """A gradient step on the entropy-only loss must spread the attention (lambda_e > 0 rewards exploration);
    with the bonus's sign flipped the step sharpened it (entropy 0.524 -> 0.511, not 0.538)."""
    scores = torch.tensor([[2.0, 0.0, -1.0]], requires_grad=True)  # (B, L)
    generator = torch.Generator().manual_seed(0)
    out = hard_attention(scores, torch.randn(1, 3, 4), mode="reinforce", generator=generator)
    loss = reinforce_loss(out.log_prob, torch.zeros(1), entropy=out.entropy, reward_weight=0.0,
                          entropy_weight=1.0)
    loss.backward()
    with torch.no_grad():
        before = _entropy(torch.softmax(scores, -1))
        after = _entropy(torch.softmax(scores - 0.1 * scores.grad, -1))
    torch.testing.assert_close(float(out.entropy.detach()), before)
    assert after > before + 1e-3


@pytest.mark.parametrize("parameterization", PARAMETERIZATIONS)
@pytest.mark.parametrize("init_offset", [1.0, 3.0, 0.25])
def test_initial_window_is_alpha_one_beta_half_and_a_step_of_init_offset(parameterization, init_offset):
    """A zero query reads the initial bias: alpha = 1, beta = 0.5 (a window about two positions wide) and
    kappa_1 = kappa_0 + init_offset. The bias once ignored init_offset (kappa 1.0 for init_offset 3.0) and
    once started beta at 1.0."""
    torch.manual_seed(0)
    K = 2
    module = GMMLocationAttention(4, K, parameterization=parameterization, init_offset=init_offset)
    kappa0 = torch.full((1, K), 2.0)  # (B, K)
    alpha, beta, kappa = module.parameters_from(torch.zeros(1, 4), kappa0)  # (B, K) each
    torch.testing.assert_close(alpha, torch.ones(1, K))
    torch.testing.assert_close(beta, torch.full((1, K), 0.5))
    torch.testing.assert_close(kappa, kappa0 + init_offset)
    _, _, stepped = module(torch.zeros(1, 4), torch.randn(1, 6, 3), module.initial_kappa(1))
    torch.testing.assert_close(stepped, torch.full((1, K), init_offset))


@pytest.mark.parametrize("parameterization", PARAMETERIZATIONS)
def test_initial_projection_weight_is_xavier_with_gain_one_tenth(parameterization):
    """The projection starts near its bias (xavier_uniform with gain 0.1), so that every query starts from
    the steady window; gain 1.0 drew weights ten times as large."""
    torch.manual_seed(0)
    module = GMMLocationAttention(16, 4, parameterization=parameterization)
    fan_in, fan_out = 16, 3 * 4
    bound = 0.1 * math.sqrt(6.0 / (fan_in + fan_out))
    largest = float(module.proj.weight.detach().abs().max())
    assert 0.8 * bound < largest <= bound
