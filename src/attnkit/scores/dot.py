"""Dot-product scores (Luong "dot"; Vaswani et al. scaled dot product).

"Effective Approaches to Attention-based Neural Machine Translation" (arXiv:1508.04025) and "Attention Is All
You Need" (arXiv:1706.03762); docs/design.md section 1:

    dot:         s_ij = q_i . k_j
    scaled dot:  s_ij = q_i . k_j / sqrt(D)
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from ._checks import check_query_key, check_scale

__all__ = ["dot", "scaled_dot"]


def dot(q: Tensor, k: Tensor) -> Tensor:
    """``q (B, H, Lq, D)``, ``k (B, H, Lk, D)`` -> scores ``(B, H, Lq, Lk)``.

    Any leading dims that broadcast work in place of ``(B, H)``. A ``ValueError`` names mismatched feature
    dims, ``D = 0``, mixed dtypes or devices, and non-floating inputs.
    """
    check_query_key("dot", q, k, same_dim=True)
    return q @ k.transpose(-2, -1)  # (B, H, Lq, D) @ (B, H, D, Lk)


def scaled_dot(q: Tensor, k: Tensor, scale: Optional[float] = None) -> Tensor:
    """``scale * q . k`` with ``scale = 1/sqrt(D)`` by default (a given ``scale`` must be a finite number
    > 0); shapes and checks as :func:`dot`; ``(B, H, Lq, Lk)``."""
    check_query_key("scaled_dot", q, k, same_dim=True)
    scale = check_scale(scale, q.shape[-1])
    return (q * scale) @ k.transpose(-2, -1)  # (B, H, Lq, D) @ (B, H, D, Lk)
