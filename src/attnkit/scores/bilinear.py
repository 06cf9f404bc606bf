"""General / bilinear scores (Luong et al., 2015, "general").

"Effective Approaches to Attention-based Neural Machine Translation" (arXiv:1508.04025); docs/design.md
section 1:

    s_ij = q_i^T W k_j
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

__all__ = ["bilinear", "BilinearScore"]


def bilinear(q: Tensor, k: Tensor, weight: Tensor) -> Tensor:
    """``q (B, H, Lq, Dq)``, ``k (B, H, Lk, Dk)``, ``weight (Dq, Dk)`` or ``(H, Dq, Dk)`` -> ``(B, H, Lq,
    Lk)``."""
    Dq, Dk = q.shape[-1], k.shape[-1]
    if tuple(weight.shape[-2:]) != (Dq, Dk) or weight.dim() not in (2, 3):
        raise ValueError(
            f"bilinear weight has shape {tuple(weight.shape)}; expected ({Dq}, {Dk}) or (H, "
            f"{Dq}, {Dk})"
        )
    if weight.dim() == 3:
        weight = weight[None]  # (1, H, Dq, Dk)
    return (q @ weight) @ k.transpose(-2, -1)  # (B, H, Lq, Dk) @ (B, H, Dk, Lk)


class BilinearScore(nn.Module):
    """Learnable ``s_ij = q_i^T W k_j``; one ``W`` shared by all heads, or one per head if ``num_heads`` is
    set."""

    def __init__(self, query_dim: int, key_dim: int, num_heads: int | None = None) -> None:
        super().__init__()
        shape = (query_dim, key_dim) if num_heads is None else (num_heads, query_dim, key_dim)
        self.weight = nn.Parameter(torch.empty(shape))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(
            self.weight, std=1.0 / math.sqrt(self.weight.shape[-2] * self.weight.shape[-1]) ** 0.5
        )

    def forward(self, q: Tensor, k: Tensor) -> Tensor:
        return bilinear(q, k, self.weight)

    def extra_repr(self) -> str:
        return f"query_dim={self.weight.shape[-2]}, key_dim={self.weight.shape[-1]}"
