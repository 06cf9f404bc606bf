"""Softmax attention (LNAS, upper-normalized).

"Doubly-Normalized Attention", eq. (1)/(3); docs/design.md section 2:

    pi_ij = exp(s_ij - r_i),   r_i = LSE_j s_ij   (over valid keys j)

Invariant: every query with a valid key has weights summing to 1; a query without one gets zeros.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from .masked import masked_softmax

__all__ = ["softmax_weights"]


def softmax_weights(scores: Tensor, valid: Optional[Tensor] = None) -> Tensor:
    """Row-normalized weights ``(B, H, Lq, Lk)`` from scores ``(B, H, Lq, Lk)``."""
    return masked_softmax(scores, valid, dim=-1)
