"""Dot-product scores (Luong "dot"; Vaswani et al. scaled dot product).

"Effective Approaches to Attention-based Neural Machine Translation" (arXiv:1508.04025) and "Attention Is All
You Need" (arXiv:1706.03762); docs/design.md section 1:

    dot:         s_ij = q_i . k_j
    scaled dot:  s_ij = q_i . k_j / sqrt(D)
"""

from __future__ import annotations

import math
from typing import Optional

from torch import Tensor

__all__ = ["dot", "scaled_dot"]


def dot(q: Tensor, k: Tensor) -> Tensor:
    """``q (B, H, Lq, D)``, ``k (B, H, Lk, D)`` -> scores ``(B, H, Lq, Lk)``."""
    return q @ k.transpose(-2, -1)


def scaled_dot(q: Tensor, k: Tensor, scale: Optional[float] = None) -> Tensor:
    """``scale * q . k`` with ``scale = 1/sqrt(D)`` by default; ``(B, H, Lq, Lk)``."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return (q * scale) @ k.transpose(-2, -1)
