"""Negative L1 distance scores, the ``N`` matrix of CoDA: ``-||q_i - k_j||_1 / sqrt(D)``.

"Compositional De-Attention Networks" (Tay et al., NeurIPS 2019), eq. (10); docs/design.md section 3.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from ..kernels.l1_distance import l1_distance
from ._checks import check_query_key, check_scale

__all__ = ["neg_l1_distance"]


def neg_l1_distance(q: Tensor, k: Tensor, scale: Optional[float] = None) -> Tensor:
    """``-||q_i - k_j||_1 * scale`` with ``scale = 1/sqrt(D)`` by default; ``q (B, H, Lq, D)``, ``k (B, H, Lk,
    D)`` -> ``(B, H, Lq, Lk)``.

    Any leading dims that broadcast work in place of ``(B, H)``; a given ``scale`` must be a finite number
    > 0. A ``ValueError`` names mismatched feature dims, ``D = 0``, mixed dtypes or devices, and non-floating
    inputs. Uses ``attnkit.kernels.l1_distance.l1_distance`` (the C++ kernel on the CPU, ``torch.cdist(p=1)``
    elsewhere): no ``(Lq, Lk, D)`` temporary. Half-precision inputs are computed in float32 (``cdist`` has no
    bfloat16 kernel) and the result is cast back to the input dtype.
    """
    batch = check_query_key("neg_l1_distance", q, k, same_dim=True)
    Lq, D = q.shape[-2:]
    Lk = k.shape[-2]
    scale = check_scale(scale, D)
    dtype = q.dtype
    if dtype in (torch.float16, torch.bfloat16):
        q, k = q.float(), k.float()
    N = math.prod(batch)
    q = q.expand(*batch, Lq, D).reshape(N, Lq, D)  # (B*H, Lq, D)
    k = k.expand(*batch, Lk, D).reshape(N, Lk, D)  # (B*H, Lk, D)
    dist = l1_distance(q, k)  # (B*H, Lq, Lk)
    return (-scale * dist.view(*batch, Lq, Lk)).to(dtype)  # (B, H, Lq, Lk)
