"""Negative L1 distance scores, the ``N`` matrix of CoDA: ``-||q_i - k_j||_1 / sqrt(D)``.

"Compositional De-Attention Networks" (Tay et al., NeurIPS 2019), eq. (10); docs/design.md section 3.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from ..kernels.l1_distance import l1_distance

__all__ = ["neg_l1_distance"]


def neg_l1_distance(q: Tensor, k: Tensor, scale: Optional[float] = None) -> Tensor:
    """``-||q_i - k_j||_1 * scale`` with ``scale = 1/sqrt(D)`` by default; ``(B, H, Lq, Lk)``.

    Uses ``attnkit.kernels.l1_distance.l1_distance`` (the C++ kernel on the CPU, ``torch.cdist(p=1)``
    elsewhere):
    no ``(Lq, Lk, D)`` temporary. Half-precision inputs are computed in float32 (``cdist`` has no bfloat16
    kernel) and the result is cast back to the input dtype.
    """
    B, H, Lq, D = q.shape
    Lk = k.shape[-2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    dtype = q.dtype
    if dtype in (torch.float16, torch.bfloat16):
        q, k = q.float(), k.float()
    dist = l1_distance(q.reshape(B * H, Lq, D), k.reshape(B * H, Lk, D))  # (B*H, Lq, Lk)
    return (-scale * dist.view(B, H, Lq, Lk)).to(dtype)  # (B, H, Lq, Lk)
