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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gumbel_samples_in_half_precision_follow_softmax_in_the_tail(dtype):
    """The noise was drawn and summed in the logits' dtype: in bfloat16 a location of probability 0.0009 was
    drawn 23x too rarely (0.00004) and one of 0.0184 at 0.0164, float16 less so. 400k samples: each
    frequency within 5 standard errors of the float32 softmax."""
    logits = torch.tensor([0.0, -3.0, -6.0, 0.5])
    p = torch.softmax(logits, 0).double()
    N = 400_000
    y = gumbel_straight_through(logits.to(dtype).expand(N, -1), generator=torch.Generator().manual_seed(0))
    assert y.dtype == dtype
    freq = y.double().mean(0)
    z = (freq - p) / (p * (1 - p) / N).sqrt()
    assert z.abs().max() < 5, (freq.tolist(), p.tolist())


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
    assert b.update(torch.tensor([2.0, 4.0])).tolist() == [4.0, 2.0]  # first batch: the others' mean
    assert b.value.item() == 3.0  # the estimate is the first batch's mean
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


@pytest.mark.parametrize("mode", ["soft", "reinforce", "gumbel", "argmax"])
def test_padded_nan_and_inf_scores_and_values_equal_truncation(mode):
    """Padded values holding NaN made every context NaN (0 * NaN), padded NaN scores raised; what a padded
    location holds must reach neither the outputs nor the gradients."""
    torch.manual_seed(0)
    scores = torch.randn(3, 5, dtype=torch.float64)
    values = torch.randn(3, 5, 2, dtype=torch.float64)
    lengths = [5, 3, 1]
    mask = torch.arange(5)[None, :] < torch.tensor(lengths)[:, None]
    scores[~mask] = float("nan")
    values[1, 3] = float("nan")
    values[2, 1:] = float("inf")
    scores.requires_grad_(True)
    out = hard_attention(scores, values, mode=mode, key_mask=mask, generator=torch.Generator().manual_seed(0))
    (out.context.sum() + out.log_prob.sum() + out.entropy.sum()).backward()
    assert torch.isfinite(scores.grad).all() and torch.all(scores.grad[~mask] == 0)
    for b, n in enumerate(lengths):
        alone = hard_attention(scores.detach()[b : b + 1, :n], values[b : b + 1, :n], mode="soft")
        torch.testing.assert_close(out.weights[b, :n], alone.weights[0])
        torch.testing.assert_close(out.entropy[b], alone.entropy[0])
        if mode == "soft":
            torch.testing.assert_close(out.context[b], alone.context[0])
        else:
            assert out.index[b] < n
            torch.testing.assert_close(out.context[b], values[b, out.index[b]])
            torch.testing.assert_close(out.log_prob[b], alone.weights[0, out.index[b]].log())


@pytest.mark.parametrize("mode", ["soft", "reinforce", "gumbel", "argmax"])
def test_a_row_with_no_allowed_location_is_an_empty_row_like_a_fully_masked_one(mode):
    """-inf marks a forbidden location; a row of them gave a NaN context (soft, gumbel), a context from a
    forbidden location and a NaN log_prob (argmax) or a RuntimeError (reinforce). It is an empty row, as a
    row with key_mask all False: zero weights, selection, context, log_prob and entropy, no NaN gradient."""
    inf = float("inf")
    scores = torch.tensor([[-inf, -inf, -inf], [-inf, -inf, 0.3], [0.1, 0.2, 0.3], [0.5, -inf, 0.1]])
    mask = torch.tensor([[True] * 3, [True, True, False], [False] * 3, [True] * 3])
    scores.requires_grad_(True)
    values = torch.randn(4, 3, 2, requires_grad=True)
    out = hard_attention(scores, values, mode=mode, key_mask=mask, generator=torch.Generator().manual_seed(0))
    (out.context.sum() + out.log_prob.sum() + out.entropy.sum()).backward()
    for row in range(3):  # rows 0 and 1 have no allowed location, row 2 no real one: all three alike
        for t in (out.weights, out.selection, out.context):
            assert torch.equal(t[row], torch.zeros_like(t[row]))
        assert out.log_prob[row].item() == 0 and out.entropy[row].item() == 0
    assert torch.isfinite(scores.grad).all() and torch.all(scores.grad[:3] == 0)
    assert torch.isfinite(values.grad).all() and torch.all(values.grad[:3] == 0)
    assert out.weights[3, 1] == 0 and (out.index is None or out.index[3] != 1)  # -inf is never chosen


def test_padded_nan_keys_leave_the_module_gradients_finite():
    """The module scores all keys: a NaN padded key gave NaN scores there and NaN parameter gradients."""
    torch.manual_seed(0)
    att = HardAttention(4, 3, 5, mode="soft").double()
    q, keys = torch.randn(2, 4, dtype=torch.float64), torch.randn(2, 4, 3, dtype=torch.float64)
    mask = torch.tensor([[True] * 4, [True, True, False, False]])
    keys[1, 2:] = float("nan")
    att(q, keys, key_mask=mask).context[1].sum().backward()
    grads = [p.grad.clone() for p in att.parameters()]
    att.zero_grad()
    att(q[1:], keys[1:, :2]).context.sum().backward()
    for g, p in zip(grads, att.parameters()):
        torch.testing.assert_close(g, p.grad)


def test_hard_attention_names_mixed_dtypes_and_zero_locations():
    with pytest.raises(ValueError, match="scores have dtype torch.float32 but values torch.float64; cast"):
        hard_attention(torch.randn(2, 3), torch.randn(2, 3, 4, dtype=torch.float64), mode="soft")
    for mode in ("reinforce", "gumbel", "argmax"):
        with pytest.raises(ValueError, match=f"mode='{mode}' chooses one of L locations.*L = 0"):
            hard_attention(torch.randn(2, 0), torch.randn(2, 0, 4), mode=mode)
    out = hard_attention(torch.randn(2, 0), torch.randn(2, 0, 4), mode="soft")  # all rows empty
    assert torch.equal(out.context, torch.zeros(2, 4)) and torch.equal(out.log_prob, torch.zeros(2))


def test_reinforce_loss_refuses_a_non_finite_baseline_and_an_empty_batch():
    log_prob, reward = torch.zeros(3, requires_grad=True), torch.ones(3)
    nan, inf = float("nan"), float("inf")
    for baseline in (nan, inf, "0", torch.tensor(nan), torch.tensor([0.0, inf, 1.0])):
        with pytest.raises(ValueError, match="baseline"):
            reinforce_loss(log_prob, reward, baseline)
    with pytest.raises(ValueError, match=r"baseline has shape \(2,\)"):
        reinforce_loss(log_prob, reward, torch.zeros(2))
    with pytest.raises(ValueError, match="empty .*skip the batch"):
        reinforce_loss(torch.zeros(0), torch.zeros(0))
    assert torch.isfinite(reinforce_loss(log_prob, reward, torch.ones(3)))


def test_module_names_query_and_key_sizes_and_dtypes():
    """A wrong query size gave "additive weights have shapes w_q=(64, 3) ..." without naming query_dim."""
    att = HardAttention(4, 3, 8, mode="soft")
    q, keys = torch.randn(2, 4), torch.randn(2, 5, 3)
    with pytest.raises(ValueError, match=r"query has shape \(2, 5\); expected \(B, query_dim\) = \(B, 4\)"):
        att(torch.randn(2, 5), keys)
    with pytest.raises(ValueError, match=r"keys has shape \(2, 5, 4\); expected \(B, L, key_dim\) = \(2,"):
        att(q, torch.randn(2, 5, 4))
    with pytest.raises(ValueError, match="query has dtype torch.float64 but HardAttention's parameters are"):
        att(q.double(), keys.double())
    assert att(q, keys).context.shape == (2, 3)


def test_a_tiny_temperature_gives_a_one_hot_sample_not_nan():
    """At tau=1e-38 (logits + g) / tau overflowed to inf - inf: the selection and its context were NaN."""
    from attnkit.nn.hard import gumbel_straight_through

    logits = torch.tensor([[10.0, 20.0, float("-inf")]], requires_grad=True)
    # below float32's smallest normal (1e-46, 1e-300) tau rounded to 0 there: 0 / 0, all NaN
    for tau, dtype in [(1e-38, torch.float32), (1e-46, torch.float32), (1e-300, torch.bfloat16),
                       (1e-300, torch.float16), (1e-300, torch.float64)]:
        x = logits.detach().to(dtype).requires_grad_()
        y = gumbel_straight_through(x, tau=tau, generator=torch.Generator().manual_seed(0))
        assert torch.isfinite(y).all() and y.sum().item() == 1.0 and y[0, 2] == 0, (tau, dtype, y)
        assert torch.isfinite(torch.autograd.grad(y[0, 1], x)[0]).all(), (tau, dtype)


def test_entropy_is_minus_sum_alpha_log_alpha_over_the_allowed_locations():
    """Its sign flipped (SAT's entropy bonus then penalised entropy) passed every test."""
    from attnkit.nn.hard import hard_attention

    scores = torch.tensor([[0.0, 1.0, 2.0, 5.0], [0.3, -1.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, False], [True, True, True, True]])
    out = hard_attention(scores, torch.randn(2, 4, 3, dtype=torch.float64), mode="soft", key_mask=mask)
    for b in range(2):
        alpha = torch.softmax(scores[b][mask[b]], 0)
        torch.testing.assert_close(out.entropy[b], -(alpha * alpha.log()).sum(), atol=1e-12, rtol=0)


def test_the_straight_through_gradient_is_that_of_softmax_of_logits_plus_gumbel_over_tau():
    """Dropping the / tau passed every test (the gradient moved by 0.55 at tau = 0.3)."""
    from attnkit.nn.hard import gumbel_straight_through

    logits = torch.tensor([[0.2, -0.5, 1.0, 0.1]], dtype=torch.float64, requires_grad=True)
    weights = torch.tensor([[0.3, -1.0, 2.0, 0.5]], dtype=torch.float64)
    for tau in (0.3, 1.0, 2.5):
        sample = gumbel_straight_through(logits, tau=tau, generator=torch.Generator().manual_seed(7))
        (grad,) = torch.autograd.grad((sample * weights).sum(), logits)
        u = torch.rand(logits.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
        soft = torch.softmax((logits + -torch.log(-torch.log(u))) / tau, -1)
        (expected,) = torch.autograd.grad((soft * weights).sum(), logits)
        torch.testing.assert_close(grad, expected, atol=1e-10, rtol=0)
        assert sample.detach().sum() == 1 and sample.detach().max() == 1


def test_first_batch_baseline_leaves_each_reward_out_so_reinforce_is_unbiased():
    """Before, the first batch's baseline was its own mean: the REINFORCE gradient of sample n was scaled by
    1 - 1/N (no signal at all for a batch of one). Here the expected gradient of a 3-way categorical policy
    over batches of 2 matches the exact gradient of E[R] (to Monte Carlo error) only with leave-one-out."""
    logits = torch.zeros(3, requires_grad=True)
    rewards = torch.tensor([1.0, 0.0, 0.0])
    g = torch.Generator().manual_seed(0)
    total = torch.zeros(3)
    trials = 4000
    for _ in range(trials):
        choice = torch.multinomial(torch.ones(3), 2, replacement=True, generator=g)  # (N=2,)
        log_prob = torch.log_softmax(logits, -1)[choice]
        reward = rewards[choice]
        baseline = MovingAverageBaseline(0.9).update(reward)  # always a first call
        (grad,) = torch.autograd.grad(reinforce_loss(log_prob, reward, baseline), logits)
        total -= grad
    exact = torch.tensor([2.0, -1.0, -1.0]) / 9  # d E[R] / d logits at uniform p: p_j (R_j - E[R])
    torch.testing.assert_close(total / trials, exact, atol=0.012, rtol=0)
    single = MovingAverageBaseline(0.9).update(torch.tensor([5.0]))
    assert single.tolist() == [0.0]  # a batch of one: no other sample to compare with


def test_first_batch_baseline_of_column_rewards_keeps_their_shape_and_stays_unbiased():
    """Rewards as an (N, 1) column got a flat (N,) leave-one-out baseline, which reinforce_loss broadcast to
    (N, N): the mean over that grid is the own-batch-mean baseline again (loss -0.9023 where the flat rewards
    give -1.2030). The baseline now takes the rewards' shape, and a baseline of another shape is refused."""
    g = torch.Generator().manual_seed(0)
    log_prob = torch.randn(4, generator=g)
    reward = torch.tensor([1.0, 0.0, 2.0, 5.0])
    flat = reinforce_loss(log_prob, reward, MovingAverageBaseline(0.9).update(reward))
    column_baseline = MovingAverageBaseline(0.9).update(reward[:, None])
    assert column_baseline.shape == (4, 1)
    column = reinforce_loss(log_prob[:, None], reward[:, None], column_baseline)
    torch.testing.assert_close(column, flat)
    with pytest.raises(ValueError, match=r"baseline has shape \(4,\); expected .*reward's shape \(4, 1\)"):
        reinforce_loss(log_prob[:, None], reward[:, None], column_baseline.reshape(-1))
