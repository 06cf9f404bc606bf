r"""Stochastic hard attention over locations, its REINFORCE estimator, and soft attention as its mean.

"Show, Attend and Tell: Neural Image Caption Generation with Visual Attention" (Xu et al., ICML 2015,
arXiv:1502.03044), section 4.1 (eqs. 8-12) and 4.2 (eq. 13); "Categorical Reparameterization with
Gumbel-Softmax" (Jang, Gu and Poole, ICLR 2017, arXiv:1611.01144) for the straight-through alternative.

Scores ``e_i`` over ``L`` locations give ``alpha = softmax(e)`` (eq. 5). The attention picks one location:

.. math::
    s \sim \text{Multinoulli}_L(\alpha), \qquad \hat z = \sum_i s_i a_i \quad \text{(eqs. 8-9)}

Its gradient is estimated with REINFORCE (eqs. 11-12), a moving-average baseline
``b_k = 0.9 b_{k-1} + 0.1 R_k`` and an entropy bonus:

.. math::
    \nabla \approx \frac{1}{N} \sum_n \big[\nabla \log p(y | \tilde s^n)
    + \lambda_r (R^n - b) \nabla \log p(\tilde s^n) + \lambda_e \nabla H[\tilde s^n]\big]

Modes: ``"soft"`` is the expectation ``E[\hat z] = \sum_i \alpha_i a_i`` (eq. 13, deterministic, exact
gradient); ``"reinforce"`` samples ``s`` (no gradient through the choice; train the scores with
:func:`reinforce_loss`); ``"gumbel"`` takes the argmax of ``(e + g) / tau``, ``g ~ Gumbel(0, 1)``,
forward exactly one-hot, backward through ``softmax((e + g) / tau)`` (straight-through). ``"argmax"``
picks the most likely location (deterministic hard attention, for evaluation).

Masks are boolean, True = real location; a ``-inf`` score marks a location that may not be chosen, exactly as
``key_mask`` False does. Masked locations get ``alpha = 0``, are never sampled, and whatever their scores and
values hold (NaN and inf included) never reaches the output: a padded batch gives, on each row, the result of
the row alone. A row with no allowed location (every location masked or ``-inf``) is an empty row: zero
weights, selection, context, log-probability and entropy (never NaN), no gradient into its scores or
values, and an arbitrary ``index``. ``"soft"`` takes ``L = 0`` (all rows empty); the modes that choose a
location need ``L >= 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..scores import AdditiveScore
from ..validators import NotScriptable, check_not_traced, check_number
from .module_utils import (
    all_finite,
    check_like_parameters,
    check_same_device_dtype,
    flag,
    readable,
    zero_where,
)

__all__ = [
    "HARD_MODES",
    "HardAttention",
    "HardAttentionOutput",
    "MovingAverageBaseline",
    "gumbel_straight_through",
    "hard_attention",
    "reinforce_loss",
]

HARD_MODES = ("soft", "reinforce", "gumbel", "argmax")


@dataclass
class HardAttentionOutput:
    """``context (B, D)``; ``weights`` = alpha ``(B, L)``; ``selection (B, L)`` (one-hot, or alpha for
    ``"soft"``); ``index (B,)`` of the chosen location (None for ``"soft"``); ``log_prob (B,)`` of the choice
    (zeros for ``"soft"``); ``entropy (B,)`` of alpha."""

    context: Tensor
    weights: Tensor
    selection: Tensor
    index: Tensor | None
    log_prob: Tensor
    entropy: Tensor


def _check_mode(mode: str) -> None:
    if mode not in HARD_MODES:
        raise ValueError(f"mode={mode!r}; expected one of {HARD_MODES}")


def _check_tau(tau: float) -> float:
    # tau = inf makes softmax((e + g) / tau) uniform: the straight-through gradient would be zero
    expected = "expected a finite temperature > 0"
    return check_number(tau, f"tau={tau!r}", expected, low=0.0, low_open=True, sep="; ")


def _check_key_mask(key_mask, B: int, L: int, device: torch.device) -> None:
    """``key_mask`` is ``None`` or a bool ``(B, L)`` tensor on the scores' device."""
    if key_mask is None:
        return
    if not isinstance(key_mask, Tensor):
        raise ValueError(f"key_mask must be a bool tensor (B, L) = ({B}, {L}), got {type(key_mask).__name__}")
    if key_mask.shape != (B, L) or key_mask.dtype != torch.bool:
        raise ValueError(
            f"key_mask has shape {tuple(key_mask.shape)} dtype {key_mask.dtype}; "
            f"expected bool (B, L) = ({B}, {L})"
        )
    if key_mask.device != device:
        raise ValueError(
            f"key_mask is on {key_mask.device} but the scores on {device}; move it with .to(device)"
        )


def gumbel_straight_through(
    logits: Tensor, tau: float = 1.0, generator: torch.Generator | None = None
) -> Tensor:
    """One-hot sample of ``softmax(logits)`` with the gradient of ``softmax((logits + g) / tau)``.

    ``logits (..., L)`` (masked entries ``-inf``) -> ``(..., L)`` whose forward values are exactly 0 or 1
    (``y_hard + (y_soft - y_soft.detach())`` adds an exact zero).
    """
    tau = _check_tau(tau)
    # the noise, the sum and the choice in float32 for bfloat16 / float16 logits: bfloat16 noise is coarse and
    # cut off near 5.5, and the rounded sums tie (a location of probability 0.0009 was drawn 23x too rarely);
    # only the returned one-hot and its straight-through term are in the logits' dtype
    work = torch.promote_types(logits.dtype, torch.float32)
    u = torch.rand(logits.shape, generator=generator, dtype=work, device=logits.device)
    g = -torch.log(-torch.log(u.clamp_min(torch.finfo(work).tiny)))  # Gumbel(0, 1)
    z = logits.to(work) + g
    top = z.amax(dim=-1, keepdim=True).detach()
    z = z - torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # <= 0: a tiny tau cannot overflow
    # a tau below the work dtype's smallest normal (1e-46 in float32) would round to 0 there: 0 / 0 at the top
    y_soft = torch.softmax(z / max(tau, torch.finfo(work).tiny), dim=-1)
    index = z.detach().argmax(dim=-1, keepdim=True)
    y_hard = torch.zeros_like(y_soft).scatter(-1, index, 1.0)
    return (y_hard + (y_soft - y_soft.detach())).to(logits.dtype)


def hard_attention(
    scores: Tensor,
    values: Tensor,
    *,
    mode: str = "reinforce",
    key_mask: Tensor | None = None,
    tau: float = 1.0,
    generator: torch.Generator | None = None,
) -> HardAttentionOutput:
    """Attend to one of ``L`` locations (or their mean for ``mode="soft"``).

    Shapes: ``scores (B, L)``, ``values (B, L, D)``, ``key_mask (B, L)`` bool True = real.
    """
    _check_mode(mode)
    for name, t in (("scores", scores), ("values", values)):
        if not isinstance(t, Tensor) or not t.dtype.is_floating_point:
            what = t.dtype if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a floating tensor, got {what}")
    if scores.dim() != 2 or values.dim() != 3 or values.shape[:2] != scores.shape:
        raise ValueError(
            f"scores {tuple(scores.shape)} and values {tuple(values.shape)}; expected (B, L) and (B, L, D)"
        )
    check_same_device_dtype(scores, "scores", values, "values", plural=True)
    B, L = scores.shape
    _check_key_mask(key_mask, B, L, scores.device)
    if L == 0 and mode != "soft":
        raise ValueError(
            f"mode={mode!r} chooses one of L locations, but scores {tuple(scores.shape)} have L = 0; give at "
            "least one location, or use mode='soft' (a zero context)"
        )
    if scores.device.type == "cpu":  # no device sync per step on an accelerator
        bad = torch.isnan(scores) | torch.isposinf(scores)  # (B, L)
        if key_mask is not None:
            bad = bad & key_mask  # masked locations may hold anything
        if bool(readable(bad).any()):  # inside torch.func.vmap: every example's
            raise ValueError(
                "scores contain NaN or +inf, which have no weight; check the score function's inputs, and "
                "mark locations that may not be chosen with -inf or key_mask"
            )
    allowed = ~torch.isneginf(scores)  # (B, L): -inf marks a location that may not be chosen
    if key_mask is not None:
        allowed = allowed & key_mask
    # selects, never 0 * x: what a forbidden location holds (NaN, inf) reaches neither output nor gradient
    scores = scores.masked_fill(~allowed, float("-inf"))
    values = zero_where(allowed[:, :, None], values)  # (B, L, D)
    any_real = allowed.any(dim=-1, keepdim=True)  # (B, 1)
    scores = torch.where(any_real, scores, torch.zeros_like(scores))  # empty rows: finite, zeroed below
    log_alpha = torch.log_softmax(scores, dim=-1)  # (B, L)
    alpha = log_alpha.exp() * any_real  # (B, L)
    entropy = -(alpha * log_alpha.masked_fill(alpha == 0, 0.0)).sum(-1)  # (B,)
    if mode == "soft":
        selection, index, log_prob = alpha, None, torch.zeros_like(entropy)
    else:
        if mode == "gumbel":
            selection = gumbel_straight_through(scores, tau=tau, generator=generator)
            index = selection.detach().argmax(-1)
        else:
            if mode == "argmax":
                index = alpha.detach().argmax(-1)
            else:
                empty = alpha.detach().sum(-1, keepdim=True) == 0  # (B, 1)
                probs = torch.where(empty, 1.0, alpha.detach())  # empty rows: any index, zeroed below
                index = torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # (B,)
            selection = torch.zeros_like(alpha).scatter(-1, index[:, None], 1.0)
        log_prob = log_alpha.gather(-1, index[:, None]).squeeze(-1)  # (B,)
        selection = selection * any_real
        log_prob = torch.where(any_real.squeeze(-1), log_prob, 0.0)  # (B,)
    context = torch.einsum("bl,bld->bd", selection, values)  # (B, D)
    return HardAttentionOutput(context, alpha, selection, index, log_prob, entropy)


def reinforce_loss(
    log_prob: Tensor,
    reward: Tensor,
    baseline=0.0,
    entropy: Tensor | None = None,
    reward_weight: float = 1.0,
    entropy_weight: float = 0.0,
) -> Tensor:
    r"""Surrogate loss whose gradient is minus the REINFORCE estimate (Show-Attend-Tell eq. 12):

    ``-mean(lambda_r (R - b) log p(s) + lambda_e H)``; ``R - b`` is detached. ``log_prob (N,)`` is the sum
    of the log-probabilities of the choices made for sample n, ``reward (N,)``, ``baseline`` a finite float or
    ``(N,)``. An empty batch (``N = 0``) has no mean and raises a ``ValueError``, as the models' losses do.
    """
    if log_prob.shape != reward.shape:
        raise ValueError(
            f"log_prob {tuple(log_prob.shape)} and reward {tuple(reward.shape)} differ; expected (N,) each"
        )
    if log_prob.numel() == 0:
        raise ValueError(
            f"log_prob and reward are empty {tuple(log_prob.shape)}; the loss is a mean over samples: "
            "skip the batch"
        )
    if reward.device.type == "cpu" and not all_finite(reward):  # no device sync per step
        raise ValueError("reward contains NaN or inf; check the reward computation")
    if isinstance(baseline, Tensor):
        # one value, or one per sample in reward's own shape: a (N,) baseline against (N, 1) rewards
        # broadcast to (N, N), every sample's advantage taken against every baseline
        if baseline.numel() != 1 and tuple(baseline.shape) != tuple(reward.shape):
            raise ValueError(
                f"baseline has shape {tuple(baseline.shape)}; expected a float, a one-element tensor or "
                f"reward's shape {tuple(reward.shape)}"
            )
        if baseline.device.type == "cpu" and not all_finite(baseline):
            raise ValueError("baseline contains NaN or inf; check the baseline (e.g. MovingAverageBaseline)")
    else:
        expected = "expected a finite number or a tensor (N,)"
        check_number(baseline, f"baseline={baseline!r}", expected, sep="; ")
    for name, weight in (("reward_weight", reward_weight), ("entropy_weight", entropy_weight)):
        check_number(weight, f"{name}={weight!r}", "expected a finite number", sep="; ")
    if entropy is not None and (not isinstance(entropy, Tensor) or entropy.shape != log_prob.shape):
        got = tuple(entropy.shape) if isinstance(entropy, Tensor) else type(entropy).__name__
        raise ValueError(f"entropy has shape {got}; expected (N,) = {tuple(log_prob.shape)}, like log_prob")
    advantage = (reward - baseline).detach()
    surrogate = reward_weight * advantage * log_prob
    if entropy is not None:
        surrogate = surrogate + entropy_weight * entropy
    return -surrogate.mean()


def _leave_one_out_mean(reward: Tensor) -> Tensor:
    """``(N,) -> (N,)``: the mean of the other samples' rewards; zeros for a single sample."""
    n = reward.numel()
    if n == 1:
        return torch.zeros_like(reward)
    return (reward.sum() - reward) / (n - 1)


class MovingAverageBaseline(nn.Module):
    """``b_k = decay * b_{k-1} + (1 - decay) * mean(R_k)`` (Show-Attend-Tell sec. 4.1, decay 0.9).

    ``update(reward (N,))`` returns the baseline to subtract from this batch, then folds the batch in: the
    estimate before the batch (a scalar), or on the first call, when there is none yet, each sample's
    leave-one-out mean ``(sum_m R_m - R_n) / (N - 1)`` (``reward``'s shape; zeros when ``N = 1``: log it with
    ``.mean()``, not ``float()``). A baseline that
    contains a sample's own reward biases its REINFORCE gradient by ``1 - 1/N`` (none at all at ``N = 1``);
    the leave-one-out one does not. The value is a buffer (saved with ``state_dict``)."""

    def __init__(self, decay: float = 0.9) -> None:
        super().__init__()
        decay = check_number(decay, f"decay={decay!r}", "expected 0 <= decay < 1 (0.9 in Show-Attend-Tell)",
                             low=0.0, high=1.0, high_open=True, sep="; ")
        self.decay = decay
        self.register_buffer("value", torch.zeros(()))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Forget the batches seen (as BatchNorm's ``reset_running_stats``): after ``to_empty()`` the
        buffers hold whatever memory held."""
        self.value.zero_()
        self.count.zero_()

    @torch.no_grad()
    def update(self, reward: Tensor) -> Tensor:
        mean = reward.detach().float().mean()
        if not torch.isfinite(mean):
            raise ValueError(f"reward has non-finite mean {mean.item()}; check the reward computation")
        if self.count == 0:  # reward's own shape: an (N, 1) column with a flat (N,) broadcast to (N, N)
            current = _leave_one_out_mean(reward.detach().float().reshape(-1)).reshape(reward.shape)
            self.value.copy_(mean)
        else:
            current = self.value.clone()
            self.value.copy_(self.decay * self.value + (1 - self.decay) * mean)
        self.count += 1
        return current

    def extra_repr(self) -> str:
        return f"decay={self.decay}"


class HardAttention(NotScriptable, nn.Module):
    """Show-Attend-Tell attention ``e_i = f_att(a_i, h)`` (additive MLP, eq. 4) with a hard or soft choice.

    ``mode`` is used in training; in ``eval()`` a ``"reinforce"`` or ``"gumbel"`` module picks the argmax
    location unless ``sample_in_eval``. ``forward(query (B, Dq), keys (B, L, Dk), values=None (keys),
    key_mask=None, mode=None, generator=None) -> HardAttentionOutput``.
    """

    def __init__(
        self,
        query_dim: int,
        key_dim: int,
        hidden_dim: int = 64,
        mode: str = "reinforce",
        tau: float = 1.0,
        sample_in_eval: bool = False,
    ) -> None:
        super().__init__()
        _check_mode(mode)
        self.mode, self.tau = mode, _check_tau(tau)
        self.sample_in_eval = flag(sample_in_eval, "sample_in_eval")
        self.score = AdditiveScore(query_dim, key_dim, hidden_dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.score.reset_parameters()

    def scores(self, query: Tensor, keys: Tensor) -> Tensor:
        """``query (B, Dq)``, ``keys (B, L, Dk)`` -> ``(B, L)``."""
        return self.score(query[:, None, None, :], keys[:, None, :, :])[:, 0, 0, :]  # (B, 1, 1, L) -> (B, L)

    def forward(
        self,
        query: Tensor,
        keys: Tensor,
        values: Tensor | None = None,
        key_mask: Tensor | None = None,
        mode: str | None = None,
        generator: torch.Generator | None = None,
    ) -> HardAttentionOutput:
        check_not_traced(type(self).__name__)
        mode = self.mode if mode is None else mode
        if not self.training and mode in ("reinforce", "gumbel") and not self.sample_in_eval:
            mode = "argmax"
        self._check_inputs(query, keys)
        values = keys if values is None else values
        if key_mask is not None:
            _check_key_mask(key_mask, keys.shape[0], keys.shape[1], keys.device)
            # padded keys (even NaN) never reach the scores or their gradient
            keys = zero_where(key_mask[:, :, None], keys)  # (B, L, Dk)
        return hard_attention(
            self.scores(query, keys),
            values,
            mode=mode,
            key_mask=key_mask,
            tau=self.tau,
            generator=generator,
        )

    def _check_inputs(self, query: Tensor, keys: Tensor) -> None:
        """``query (B, query_dim)`` and ``keys (B, L, key_dim)`` of the module's dtype and device."""
        Dq, Dk = self.score.w_q.shape[1], self.score.w_k.shape[1]
        if not isinstance(query, Tensor) or query.dim() != 2 or query.shape[1] != Dq:
            got = tuple(query.shape) if isinstance(query, Tensor) else type(query).__name__
            raise ValueError(
                f"query has shape {got}; expected (B, query_dim) = (B, {Dq}), or build the module with the "
                "query's size as query_dim"
            )
        if not isinstance(keys, Tensor) or keys.dim() != 3 or keys.shape[0] != query.shape[0] or (
            keys.shape[2] != Dk
        ):
            got = tuple(keys.shape) if isinstance(keys, Tensor) else type(keys).__name__
            raise ValueError(
                f"keys has shape {got}; expected (B, L, key_dim) = ({query.shape[0]}, L, {Dk}), or build the "
                "module with the keys' size as key_dim"
            )
        for name, t in (("query", query), ("keys", keys)):
            check_like_parameters(t, self.score.w_q, name, "HardAttention")

    def extra_repr(self) -> str:
        return f"mode={self.mode}, tau={self.tau:g}"
