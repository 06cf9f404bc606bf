r"""Maximum mean discrepancy between the queries and keys of each sample and head (the diagnostic of
"Alignment Attention by Matching Key and Query Distributions", arXiv:2110.12567, App. B.1.2, also usable as a
loss).

Gaussian kernel mixture with 5 bandwidths spaced by a factor 2 around the mean pairwise squared distance
``s`` of the pooled real points (Long et al., "Learning Transferable Features with Deep Adaptation Networks",
arXiv:1502.02791):

.. math::
    k(x, y) = \sum_{m=-2}^{2} \exp\!\big(-\|x - y\|^2 / (s\, 2^{m})\big), \qquad
    \mathrm{MMD}^2(q, k) = \overline{k(q_i, q_{i'})} + \overline{k(k_j, k_{j'})} - 2\, \overline{k(q_i, k_j)}

(the biased V-statistic: the means run over the real tokens only). ``s`` is treated as a constant
(no gradient), as in the reference implementation. The value is 0 when the two sets coincide and >= 0.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._common import check_pair, valid_mask

__all__ = ["mmd", "KERNEL_NUM", "KERNEL_MUL"]

KERNEL_NUM = 5
KERNEL_MUL = 2.0


def mmd(
    q: Tensor,
    k: Tensor,
    key_mask: Optional[Tensor] = None,
    query_mask: Optional[Tensor] = None,
) -> Tensor:
    """Gaussian-kernel MMD between the real queries and keys of each sample and head.

    Args:
        q: ``(B, H, Lq, d)`` queries.
        k: ``(B, H, Lk, d)`` keys.
        key_mask: ``(B, Lk)`` bool, True = real token (default: all real).
        query_mask: ``(B, Lq)`` bool (default: ``key_mask`` when ``Lq == Lk``, else all real).

    Returns:
        ``(B, H)`` MMD^2 values (0 for a sample without real queries or keys).

    The bandwidth is each sample's own (mean pairwise squared distance), so the value does not change when
    the sample is scaled; with one real query and one real key that leaves nothing to measure: the value is
    then ``2 sum_i (1 - exp(-2**(2 - i)))`` ~ 6.19 for any q != k (0 for q == k).
    """
    check_pair(q, k)
    B, H, Lq, d = q.shape
    Lk = k.shape[2]
    if query_mask is None and key_mask is not None and Lq == Lk:
        query_mask = key_mask
    qm = valid_mask(query_mask, B, Lq, q.device, "query_mask")
    km = valid_mask(key_mask, B, Lk, q.device, "key_mask")
    q = q.masked_fill(~qm[:, None, :, None], 0.0)  # padding never reaches the distances
    k = k.masked_fill(~km[:, None, :, None], 0.0)
    x = torch.cat([q, k], dim=2)  # (B, H, Lq + Lk, d)
    m = torch.cat([qm, km], dim=1).to(x.dtype)  # (B, Lq + Lk)
    sq = torch.cdist(x, x).pow(2)  # (B, H, L, L)
    pair = m[:, None, :, None] * m[:, None, None, :]  # (B, 1, L, L)
    n = m.sum(-1)[:, None]  # (B, 1)
    s = (sq.detach() * pair).sum((-1, -2)) / (n * n - n).clamp_min(1)  # (B, H) mean over distinct pairs
    s = s.clamp_min(torch.finfo(x.dtype).tiny) / KERNEL_MUL ** (KERNEL_NUM // 2)
    kernel = sum(
        torch.exp(-sq / (s * KERNEL_MUL**i)[..., None, None]) for i in range(KERNEL_NUM)
    )  # (B, H, L, L)
    wq = torch.cat([qm, torch.zeros_like(km)], 1).to(x.dtype) / qm.sum(-1, keepdim=True).clamp_min(
        1
    )  # (B, L)
    wk = torch.cat([torch.zeros_like(qm), km], 1).to(x.dtype) / km.sum(-1, keepdim=True).clamp_min(
        1
    )  # (B, L)
    w = (wq - wk)[:, None, :]  # (B, 1, L): +1/nq on queries, -1/nk on keys
    value = torch.einsum("bhi,bhij,bhj->bh", w.expand(B, H, -1), kernel, w.expand(B, H, -1))  # (B, H)
    real = (qm.any(-1) & km.any(-1))[:, None]  # (B, 1)
    return torch.where(real, value.clamp_min(0), torch.zeros_like(value))
