r"""Bidirectional conditional-transport alignment ("Alignment Attention by Matching Key and Query
Distributions", arXiv:2110.12567, sec. 2.3.3, eq. 4; Zheng & Zhou, "Exploiting Chain Rule and Bayes' Theorem
to Compare Probability Distributions", arXiv:2012.14100).

A navigator ``g`` (two-layer MLP, L2-normalized output) defines the forward and backward transport plans, a
critic ``f`` (highway + two-layer MLP, L2-normalized output) the point-to-point cost. For one sample and head
with real queries :math:`q_{1..n_q}` and keys :math:`k_{1..n_k}`:

.. math::
    c_{ij} = 1 - f(q_i)^\top f(k_j) \;(\text{the cosine distance; } f \text{ is unit-norm}), \qquad
    \pi_f(j \mid i) = \frac{e^{g(q_i)^\top g(k_j)}}{\sum_{j'} e^{g(q_i)^\top g(k_{j'})}}, \qquad
    \pi_b(i \mid j) = \frac{e^{g(q_i)^\top g(k_j)}}{\sum_{i'} e^{g(q_{i'})^\top g(k_j)}}

    \mathcal{L}_{\text{ct}} = \rho\, \frac{1}{n_q} \sum_i \sum_j c_{ij}\, \pi_f(j \mid i)
        + (1 - \rho)\, \frac{1}{n_k} \sum_j \sum_i c_{ij}\, \pi_b(i \mid j), \qquad \rho = 0.5

The model's projections and the navigator minimize ``L``; the critic maximizes it: its parameters enter
through gradient reversal (``L`` reaches them with the factor ``-gamma``), so one optimizer step trains all.
``L >= 0``, and 0 when the critic maps both sets to the same points that the navigator pairs.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from ._common import Highway, check_module, check_pair, grad_reverse, valid_mask

__all__ = ["Critic", "Navigator", "ct_loss", "RHO"]

RHO = 0.5


class Critic(nn.Module):
    """Highway + ``Linear(d, hidden) -> ReLU -> Linear(hidden, hidden)``, L2-normalized:
    ``(..., d) -> (..., hidden)``."""

    def __init__(self, dim: int, hidden: int = 16) -> None:
        super().__init__()
        self.dim, self.hidden = dim, hidden
        self.highway = Highway(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.highway.reset_parameters()
        self.fc1.reset_parameters()
        self.fc2.reset_parameters()

    def forward(self, x: Tensor) -> Tensor:
        return F.normalize(self.fc2(torch.relu(self.fc1(self.highway(x)))), dim=-1)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, hidden={self.hidden}"


class Navigator(nn.Module):
    """``Linear(d, hidden) -> ReLU -> Linear(hidden, hidden)``, L2-normalized:
    ``(..., d) -> (..., hidden)``."""

    def __init__(self, dim: int, hidden: int = 16) -> None:
        super().__init__()
        self.dim, self.hidden = dim, hidden
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.fc1.reset_parameters()
        self.fc2.reset_parameters()

    def forward(self, x: Tensor) -> Tensor:
        return F.normalize(self.fc2(torch.relu(self.fc1(x))), dim=-1)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, hidden={self.hidden}"


def _reversed(module: nn.Module, x: Tensor, gamma: float) -> Tensor:
    """``module(x)`` with every parameter behind gradient reversal (the input's gradient is unchanged)."""
    params = {name: grad_reverse(p, gamma) for name, p in module.named_parameters()}
    return functional_call(module, params, (x,))


def ct_loss(
    q: Tensor,
    k: Tensor,
    critic: nn.Module,
    navigator: nn.Module,
    q_mask: Optional[Tensor] = None,
    k_mask: Optional[Tensor] = None,
    *,
    rho: float = RHO,
    gamma: float = 1.0,
) -> Tensor:
    """Bidirectional CT cost per sample and head over the real tokens.

    Args:
        q: ``(B, H, Lq, d)``; k: ``(B, H, Lk, d)``; masks ``(B, L)`` bool True = real (default all real).
        critic, navigator: ``(..., d) -> (..., e)`` maps, shared by every head.
        rho: weight of the query-to-key direction.
        gamma: gradient-reversal factor of the critic.

    Returns:
        ``(B, H)`` costs (0 for a sample without real queries or keys).
    """
    check_pair(q, k)
    check_module(critic, q, "critic")
    check_module(navigator, q, "navigator")
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    qm = valid_mask(q_mask, B, Lq, q.device, "q_mask")
    km = valid_mask(k_mask, B, Lk, q.device, "k_mask")
    q = q.masked_fill(~qm[:, None, :, None], 0.0)
    k = k.masked_fill(~km[:, None, :, None], 0.0)
    fq, fk = _reversed(critic, q, gamma), _reversed(critic, k, gamma)  # (B, H, Lq, e), (B, H, Lk, e)
    cost = 1 - fq @ fk.transpose(-1, -2)  # (B, H, Lq, Lk): the paper's 1 - cos (the critic's f is unit-norm)
    logits = navigator(q) @ navigator(k).transpose(-1, -2)  # (B, H, Lq, Lk)
    pair = qm[:, None, :, None] & km[:, None, None, :]  # (B, 1, Lq, Lk)
    # |logits| <= 1 (unit vectors): -1e4 gives an exact 0 weight, and a row with no real key stays finite
    logits = logits.masked_fill(~pair, -1e4)
    forward_plan = torch.softmax(
        logits, dim=-1
    )  # (B, H, Lq, Lk), rows of real queries sum to 1 over real keys
    backward_plan = torch.softmax(logits, dim=-2)  # columns of real keys sum to 1 over real queries
    cost = cost.masked_fill(~pair, 0.0)
    to_keys = (cost * forward_plan).sum((-1, -2)) / qm.sum(-1).clamp_min(1)[:, None]  # (B, H)
    to_queries = (cost * backward_plan).sum((-1, -2)) / km.sum(-1).clamp_min(1)[:, None]  # (B, H)
    values = rho * to_keys + (1 - rho) * to_queries
    real = (qm.any(-1) & km.any(-1))[:, None]  # (B, 1)
    return torch.where(real, values, torch.zeros_like(values))
