"""Stochastic hard attention: REINFORCE unbiasedness, straight-through Gumbel, masks, soft = expectation."""

import pytest
import torch

from attnkit.nn import HardAttention
from attnkit.nn.hard import (
    MovingAverageBaseline,
    gumbel_straight_through,
    hard_attention,
    reinforce_loss,
)


def test_reinforce_estimator_is_unbiased_on_known_gradient():
    # J(theta) = sum_i softmax(theta)_i r_i has the gradient p * (r - J); the estimator averages
    # (r_s - b) grad log p(s) over samples s ~ p. With N = 400k samples its standard error per entry is
    # below 0.002; the tolerance is 0.01 (5 standard errors).
    torch.manual_seed(0)
    theta = torch.tensor([0.5, -1.0, 0.2, 1.3, 0.0], dtype=torch.float64, requires_grad=True)
    r = torch.tensor([1.0, -2.0, 0.5, 3.0, -1.0], dtype=torch.float64)
    p = torch.softmax(theta, 0)
    exact = (p * (r - (p * r).sum())).detach()
    N = 400_000
    scores = theta.expand(N, -1)
    out = hard_attention(
        scores,
        torch.zeros(N, 5, 1, dtype=torch.float64),
        mode="reinforce",
        generator=torch.Generator().manual_seed(1),
    )
    reward = r[out.index]
    for baseline in (0.0, 1.7):  # any constant baseline leaves the estimate unbiased
        (grad,) = torch.autograd.grad(
            reinforce_loss(out.log_prob, reward, baseline), theta, retain_graph=True
        )
        torch.testing.assert_close(-grad, exact, atol=0.01, rtol=0)
    # the samples follow alpha
    freq = torch.bincount(out.index, minlength=5).double() / N
    torch.testing.assert_close(freq, p.detach(), atol=0.005, rtol=0)


def test_gumbel_straight_through_forward_is_one_hot_with_soft_gradient():
    torch.manual_seed(0)
    logits = torch.randn(64, 7, requires_grad=True)
    y = gumbel_straight_through(logits, tau=0.5)
    assert set(y.detach().unique().tolist()) <= {0.0, 1.0}
    assert torch.equal(y.detach().sum(-1), torch.ones(64))
    (y * torch.arange(7.0)).sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_gumbel_samples_follow_softmax():
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0]).expand(100_000, -1)
    y = gumbel_straight_through(logits, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(y.mean(0), torch.softmax(logits[0], 0), atol=0.01, rtol=0)


def test_soft_mode_is_expectation_of_hard_samples():
    torch.manual_seed(0)
    scores, values = torch.randn(3, 6, dtype=torch.float64), torch.randn(3, 6, 4, dtype=torch.float64)
    soft = hard_attention(scores, values, mode="soft")
    torch.testing.assert_close(soft.context, torch.einsum("bl,bld->bd", torch.softmax(scores, -1), values))
    N = 100_000
    hard = hard_attention(
        scores.repeat(N, 1),
        values.repeat(N, 1, 1),
        mode="reinforce",
        generator=torch.Generator().manual_seed(0),
    )
    torch.testing.assert_close(hard.context.view(N, 3, 4).mean(0), soft.context, atol=0.03, rtol=0)


@pytest.mark.parametrize("mode", ["soft", "reinforce", "gumbel", "argmax"])
def test_masked_locations_are_never_chosen_and_empty_rows_are_zero(mode):
    torch.manual_seed(0)
    scores = torch.randn(200, 5) * 3
    values = torch.randn(200, 5, 2)
    mask = torch.ones(200, 5, dtype=torch.bool)
    mask[:, 3:] = False
    mask[0] = False  # no real location
    out = hard_attention(scores, values, mode=mode, key_mask=mask)
    assert torch.all(out.weights[~mask] == 0) and torch.all(out.selection[~mask] == 0)
    assert torch.all(out.context[0] == 0) and torch.isfinite(out.log_prob).all() and out.log_prob[0] == 0
    torch.testing.assert_close(out.weights[1:].sum(-1), torch.ones(199))


def test_moving_average_baseline_decays_at_point_nine():
    b = MovingAverageBaseline(0.9)
    assert b.update(torch.tensor([2.0, 4.0])) == 3.0  # first batch: its own mean
    assert b.update(torch.tensor([13.0])) == 3.0  # the estimate before this batch
    assert b.value.item() == pytest.approx(0.9 * 3.0 + 0.1 * 13.0)
    with pytest.raises(ValueError, match="decay"):
        MovingAverageBaseline(1.0)


def test_module_picks_argmax_in_eval_and_rejects_unknown_mode():
    torch.manual_seed(0)
    att = HardAttention(8, 4, 16, mode="reinforce")
    q, k = torch.randn(5, 8), torch.randn(5, 9, 4)
    att.eval()
    out = att(q, k)
    assert torch.equal(out.index, out.weights.argmax(-1))
    with pytest.raises(ValueError, match="mode='hardest'"):
        HardAttention(8, 4, mode="hardest")
    assert "mode=reinforce" in repr(att)


@pytest.mark.parametrize("tau", [0.0, -1.0, float("inf"), float("nan"), "1"])
def test_a_temperature_that_is_not_finite_and_positive_is_named(tau):
    with pytest.raises(ValueError, match="expected a finite temperature > 0"):
        HardAttention(4, 4, mode="gumbel", tau=tau)
    with pytest.raises(ValueError, match="expected a finite temperature > 0"):
        gumbel_straight_through(torch.zeros(2, 3), tau=tau)
