"""Additive (MLP) scores of Bahdanau et al. (2015).

"Neural Machine Translation by Jointly Learning to Align and Translate" (arXiv:1409.0473);
docs/design.md section 1:

    s_ij = w^T tanh(W_q q_i + W_k k_j + b)

The sum is broadcast over (Lq, Lk), so this score costs ``O(Lq * Lk * A)`` memory for hidden size ``A``,
as in the original model.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn

__all__ = ["additive", "AdditiveScore"]


def additive(
    q: Tensor, k: Tensor, w_q: Tensor, w_k: Tensor, w: Tensor, bias: Optional[Tensor] = None
) -> Tensor:
    """``q (B, H, Lq, Dq)``, ``k (B, H, Lk, Dk)``, ``w_q (A, Dq)``, ``w_k (A, Dk)``, ``w (A,)`` -> ``(B, H,
    Lq, Lk)``."""
    A = w.shape[-1]
    if w_q.shape != (A, q.shape[-1]) or w_k.shape != (A, k.shape[-1]) or w.dim() != 1:
        raise ValueError(
            f"additive weights have shapes w_q={tuple(w_q.shape)}, w_k={tuple(w_k.shape)}, "
            f"w={tuple(w.shape)}; "
            f"expected ({A}, {q.shape[-1]}), ({A}, {k.shape[-1]}), ({A},)"
        )
    hq = q @ w_q.T  # (B, H, Lq, A)
    hk = k @ w_k.T  # (B, H, Lk, A)
    if bias is not None:
        hq = hq + bias
    return torch.tanh(hq.unsqueeze(-2) + hk.unsqueeze(-3)) @ w  # (B, H, Lq, Lk, A) @ (A,) -> (B, H, Lq, Lk)


class AdditiveScore(nn.Module):
    """Learnable Bahdanau score ``w^T tanh(W_q q + W_k k + b)`` with hidden size ``hidden_dim``."""

    def __init__(self, query_dim: int, key_dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w_q = nn.Parameter(torch.empty(hidden_dim, query_dim))
        self.w_k = nn.Parameter(torch.empty(hidden_dim, key_dim))
        self.bias = nn.Parameter(torch.empty(hidden_dim))
        self.w = nn.Parameter(torch.empty(hidden_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.xavier_uniform_(self.w_q)
        nn.init.xavier_uniform_(self.w_k)
        nn.init.zeros_(self.bias)
        nn.init.uniform_(self.w, -1 / math.sqrt(self.w.numel()), 1 / math.sqrt(self.w.numel()))

    def forward(self, q: Tensor, k: Tensor) -> Tensor:
        return additive(q, k, self.w_q, self.w_k, self.w, self.bias)

    def extra_repr(self) -> str:
        return f"query_dim={self.w_q.shape[1]}, key_dim={self.w_k.shape[1]}, hidden_dim={self.w.shape[0]}"
