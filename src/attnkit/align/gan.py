r"""Adversarial alignment: a discriminator shared across the heads of a layer tells keys from queries, and
gradient reversal makes the query/key projections confuse it ("Alignment Attention by Matching Key and Query
Distributions", arXiv:2110.12567, sec. 2.3.1, eq. 2).

Discriminator: highway layer, then ``Linear(d, hidden) -> LeakyReLU -> Linear(hidden, 1)`` (logit). For one
sample and head with real tokens :math:`i = 1..n`,

.. math::
    \mathcal{L}_{\text{gan}} = -\frac{1}{n_k}\sum_j \log D(\mathrm{GRL}(k_j))
        - \frac{1}{n_q}\sum_i \log\big(1 - D(\mathrm{GRL}(q_i))\big)

the binary cross-entropy of the discriminator ``D``, which minimizes it. ``GRL`` (gradient reversal, factor
``-gamma``) hands the projections the gradient of ``-L``: they maximize the discriminator's error, so the
value the model minimizes is ``-L`` and its minimum ``-2 log 2`` (at the optimal ``D``,
``L = 2 log 2 - 2 JS``) is reached when queries and keys have the same distribution. One optimizer step trains
both sides.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._common import Highway, check_module, check_pair, grad_reverse, valid_mask

__all__ = ["Discriminator", "gan_loss"]


class Discriminator(nn.Module):
    """Highway + two-layer MLP, ``(..., d) -> (...)`` logits of "this is a key"."""

    def __init__(self, dim: int, hidden: int = 16) -> None:
        super().__init__()
        self.dim, self.hidden = dim, hidden
        self.highway = Highway(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, 1)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.highway.reset_parameters()
        self.fc1.reset_parameters()
        self.fc2.reset_parameters()

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.leaky_relu(self.fc1(self.highway(x)), 0.2)).squeeze(-1)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, hidden={self.hidden}"


def gan_loss(
    q: Tensor,
    k: Tensor,
    discriminator: nn.Module,
    q_mask: Optional[Tensor] = None,
    k_mask: Optional[Tensor] = None,
    *,
    gamma: float = 1.0,
) -> Tensor:
    """The discriminator's cross-entropy per sample and head, with gradient reversal on ``q`` and ``k``.

    Args:
        q: ``(B, H, Lq, d)``; k: ``(B, H, Lk, d)``; masks ``(B, L)`` bool True = real (default all real).
        discriminator: maps ``(..., d)`` to logits ``(...)``; shared by every head.
        gamma: gradient-reversal factor.

    Returns:
        ``(B, H)`` cross-entropies (0 for a sample without real queries or keys).
    """
    check_pair(q, k)
    check_module(discriminator, q, "discriminator")
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    qm = valid_mask(q_mask, B, Lq, q.device, "q_mask").to(q.dtype)[:, None, :]  # (B, 1, Lq)
    km = valid_mask(k_mask, B, Lk, q.device, "k_mask").to(q.dtype)[:, None, :]  # (B, 1, Lk)
    # padded positions enter the discriminator as zeros: a non-finite padded value would make the weight
    # gradients NaN through 0 * NaN even where its loss term is dropped below
    q = torch.where(qm[..., None] > 0, q, torch.zeros_like(q))
    k = torch.where(km[..., None] > 0, k, torch.zeros_like(k))
    logit_q = discriminator(grad_reverse(q, gamma))  # (B, H, Lq)
    logit_k = discriminator(grad_reverse(k, gamma))  # (B, H, Lk)
    bce_q = F.binary_cross_entropy_with_logits(logit_q, torch.zeros_like(logit_q), reduction="none")
    bce_k = F.binary_cross_entropy_with_logits(logit_k, torch.ones_like(logit_k), reduction="none")
    # padded positions: where() (not a product), their terms dropped
    bce_q = torch.where(qm > 0, bce_q, torch.zeros_like(bce_q)).sum(-1) / qm.sum(-1).clamp_min(1)  # (B, H)
    bce_k = torch.where(km > 0, bce_k, torch.zeros_like(bce_k)).sum(-1) / km.sum(-1).clamp_min(1)  # (B, H)
    real = (qm.sum(-1) > 0) & (km.sum(-1) > 0)  # (B, 1)
    values = bce_q + bce_k
    return torch.where(real, values, torch.zeros_like(values))
