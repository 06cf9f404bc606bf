"""Masked reductions shared by the mechanisms, written so that no entry ever becomes NaN.

Invalid entries are excluded; a slice with no valid entry yields a finite placeholder (0) whose
weights are then zeroed by the caller, so neither the forward nor the backward pass sees ``inf - inf``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["masked_logsumexp", "masked_softmax", "masked_mean", "NEG_INF"]

NEG_INF = float("-inf")


def masked_logsumexp(x: Tensor, valid: Optional[Tensor], dim: int) -> Tensor:
    """Log-sum-exp of ``x`` over ``dim`` restricted to ``valid`` entries (keepdim).

    Slices without any valid entry return 0 (a finite placeholder).
    """
    if valid is None:
        return torch.logsumexp(x, dim=dim, keepdim=True)
    x = x.masked_fill(~valid, NEG_INF)
    empty = ~valid.any(dim=dim, keepdim=True)
    x = x.masked_fill(empty, 0.0)  # keeps empty slices finite; their weights are zeroed by the caller
    return torch.logsumexp(x, dim=dim, keepdim=True).masked_fill(empty, 0.0)


def masked_softmax(x: Tensor, valid: Optional[Tensor], dim: int = -1) -> Tensor:
    """Softmax over ``dim`` restricted to ``valid``; invalid entries and empty slices get exactly 0."""
    if valid is None:
        return torch.softmax(x, dim=dim)
    lse = masked_logsumexp(x, valid, dim)
    return torch.exp(x.masked_fill(~valid, NEG_INF) - lse)


def masked_mean(x: Tensor, valid: Optional[Tensor]) -> Tensor:
    """Mean of ``x (B, H, Lq, Lk)`` over its last two dims restricted to ``valid``; shape ``(B, H, 1, 1)``.

    A matrix with no valid entry has mean 0.
    """
    if valid is None:
        return x.mean(dim=(-2, -1), keepdim=True)
    valid = valid.expand_as(x)
    total = x.masked_fill(~valid, 0.0).sum(dim=(-2, -1), keepdim=True)
    count = valid.sum(dim=(-2, -1), keepdim=True).clamp_min(1)
    return total / count
