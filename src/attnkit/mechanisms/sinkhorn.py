"""Sinkhorn attention with k iterations, in the log domain.

"Attention that does not Explain Away" (arXiv:2009.14308), section 3.2 (relation to Sinkformers);
docs/design.md section 2.
With potentials ``a = 0`` and ``k`` rounds of

    b_j = -LSE_i (s_ij + a_i)          (column normalization over valid queries)
    a_i = -LSE_j (s_ij + b_j)          (row normalization over valid keys)

the weights are ``pi = exp(s + a + b)``. ``k = 0`` is softmax (one row normalization), ``k = 1`` is
DNAS; as ``k`` grows, rows sum to 1 and columns to ``n_q / n_k``. Sinkformers ("Sinkformers:
Transformers with Doubly Stochastic Attention", arXiv:2110.11773) count half-steps and start with a row
normalization: their ``n_it = 1`` is softmax (``k = 0``), and their ``n_it = 2k + 1`` is one row
normalization followed by ``k`` of the rounds above, which gives other weights than ``k`` rounds from
``a = 0`` (DNAS is not among their iterates).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .masked import masked_logsumexp
from .softmax import softmax_weights

__all__ = ["sinkhorn_weights", "sinkhorn_column_potential"]


def sinkhorn_column_potential(scores: Tensor, valid: Optional[Tensor], iters: int) -> Tensor:
    """The column potential ``b (B, H, 1, Lk)`` after ``iters`` rounds (zeros for ``iters = 0``)."""
    b = torch.zeros_like(scores[..., :1, :])  # (B, H, 1, Lk)
    for step in range(iters):
        a = 0.0 if step == 0 else -masked_logsumexp(scores + b, valid, dim=-1)  # (B, H, Lq, 1)
        b = -masked_logsumexp(scores + a, valid, dim=-2)  # (B, H, 1, Lk)
    return b


def sinkhorn_weights(scores: Tensor, valid: Optional[Tensor] = None, iters: int = 3) -> Tensor:
    """Sinkhorn weights ``(B, H, Lq, Lk)``; the last step is always a row normalization."""
    b = sinkhorn_column_potential(scores, valid, iters)
    return softmax_weights(scores + b, valid)
