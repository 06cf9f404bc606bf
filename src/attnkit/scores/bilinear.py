"""General / bilinear scores (Luong et al., 2015, "general").

"Effective Approaches to Attention-based Neural Machine Translation" (arXiv:1508.04025); docs/design.md
section 1:

    s_ij = q_i^T W k_j
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..validators import check_float_tensor, check_int
from ._checks import check_query_key, check_weight

__all__ = ["bilinear", "BilinearScore"]


def bilinear(q: Tensor, k: Tensor, weight: Tensor) -> Tensor:
    """``q (B, H, Lq, Dq)``, ``k (B, H, Lk, Dk)``, ``weight (Dq, Dk)`` or ``(H, Dq, Dk)`` -> ``(B, H, Lq,
    Lk)``.

    Any leading dims that broadcast (with ``weight``'s ``H``) work in place of ``(B, H)``. A ``ValueError``
    names a weight of the wrong shape, ``D = 0``, mixed dtypes or devices, and non-floating inputs.
    """
    check_query_key("bilinear", q, k, same_dim=False)
    check_float_tensor(weight, "bilinear: weight")
    Dq, Dk = q.shape[-1], k.shape[-1]
    if tuple(weight.shape[-2:]) != (Dq, Dk) or weight.dim() not in (2, 3):
        raise ValueError(
            f"bilinear weight has shape {tuple(weight.shape)}; expected ({Dq}, {Dk}) or (H, "
            f"{Dq}, {Dk})"
        )
    try:
        torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], weight.shape[:-2])
    except RuntimeError:
        raise ValueError(
            f"bilinear weight has shape {tuple(weight.shape)} ({weight.shape[0]} heads) but q has shape "
            f"{tuple(q.shape)}; pass one (Dq, Dk) weight or one per head, (H, Dq, Dk) with H = "
            f"{q.shape[-3] if q.dim() >= 3 else 1}"
        ) from None
    check_weight("bilinear", "weight", weight, q)
    # matmul broadcasts (H, Dq, Dk) over the leading dims as it does for dot: the result has the inputs' rank
    # (a per-head weight gave 3-D inputs a leading dimension of 1)
    return (q @ weight) @ k.transpose(-2, -1)  # (B, H, Lq, Dk) @ (B, H, Dk, Lk)


class BilinearScore(nn.Module):
    """Learnable ``s_ij = q_i^T W k_j``; one ``W`` shared by all heads, or one per head if ``num_heads`` is
    set."""

    def __init__(self, query_dim: int, key_dim: int, num_heads: int | None = None) -> None:
        super().__init__()
        for name, value in (("query_dim", query_dim), ("key_dim", key_dim)):
            check_int(value, f"BilinearScore({name}={value!r})", "expected a positive integer", low=1)
        if num_heads is not None:
            check_int(
                num_heads, f"BilinearScore(num_heads={num_heads!r})", "expected a positive integer or None",
                low=1,
            )
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
