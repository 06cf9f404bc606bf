"""CoDA quasi-attention in ``O(block * Lk)`` memory, chunked over queries with recomputation.

"Compositional De-Attention Networks", eqs. (1)-(6) and (10); docs/design.md section 3:

    E_ij = alpha * scale * q_i . k_j,    N_ij = -beta * scale * ||q_i - k_j||_1
    M    = f_E(E) * g(N),                out = M v

Each block of queries ``[i0, i1)`` builds its ``(B, H, C, Lk)`` slices of ``E`` and ``N`` (the L1
distances with ``l1_distance.l1_distance``, the C++ kernel on the CPU or ``torch.cdist(p=1)``, never a ``(C,
Lk, D)``
temporary), multiplies by ``v`` and drops
them; the backward pass recomputes the block (activation checkpointing), so the peak is one block.
The centred variants (eqs. 4 and 6) need the mean of ``E`` / ``N`` over the valid pairs of each
(batch, head) matrix: a first chunked sweep computes those sums, also with recomputation.
Masks are multiplicative: ``M_ij = 0`` on invalid pairs.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from ..config import CoDA
from ..mechanisms import coda_affinity, coda_gate
from ..masks import MaskInfo
from .blocking import chunk_size
from .l1_distance import l1_distance

__all__ = ["coda_attention", "coda_means"]


def coda_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    masks: MaskInfo,
    config: CoDA,
    *,
    scale: float,
    block: Optional[int] = None,
) -> Tensor:
    """CoDA output ``(B, H, Lq, Dv)``; the result equals ``coda_weights(E, N) @ v`` of the reference."""
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    dtype = q.dtype
    if dtype in (torch.float16, torch.bfloat16):
        q, k, v = q.float(), k.float(), v.float()
    width = block if block is not None else chunk_size(B * H, Lk, Lq)
    ranges = [(i0, min(Lq, i0 + width)) for i0 in range(0, Lq, width)]

    mean_e, mean_n = coda_means(q, k, masks, config, scale=scale, width=width)
    outs = [
        checkpoint(
            _block_out,
            q[:, :, i0:i1],
            k,
            v,
            mean_e,
            mean_n,
            masks,
            i0,
            i1,
            scale,
            config,
            use_reentrant=False,
        )
        for i0, i1 in ranges
    ]
    return torch.cat(outs, dim=2).to(dtype)  # (B, H, Lq, Dv)


def coda_means(
    q: Tensor, k: Tensor, masks: MaskInfo, config: CoDA, *, scale: float, width: Optional[int] = None
) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """The means of ``alpha E`` (for ``center_e``, eq. 6) and ``beta N`` (for ``gate="centered"``, eq. 4)
    over the valid pairs of each (batch, head) matrix, ``(B, H, 1, 1)`` each or ``None`` when not used.

    A chunked sweep over query blocks with recomputation (differentiable: the backward pass recomputes each
    block); ``q`` and ``k`` in the compute dtype.
    """
    if not config.uses_global_means:
        return None, None
    B, H, Lq, _ = q.shape
    width = width if width is not None else chunk_size(B * H, k.shape[2], Lq)
    sum_e = sum_n = count = 0
    for i0 in range(0, Lq, width):
        i1 = min(Lq, i0 + width)
        se, sn, cnt = checkpoint(
            _block_sums, q[:, :, i0:i1], k, masks, i0, i1, scale, config, use_reentrant=False
        )
        sum_e, sum_n, count = sum_e + se, sum_n + sn, count + cnt
    count = count.clamp_min(1)
    mean_e = sum_e / count if config.center_e else None  # (B, H, 1, 1)
    mean_n = sum_n / count if config.gate == "centered" else None  # (B, H, 1, 1)
    return mean_e, mean_n


def _affinity_distance(qb: Tensor, k: Tensor, scale: float, config: CoDA) -> tuple[Tensor, Tensor]:
    """``alpha * E`` and ``beta * N`` of a block of queries, ``(B, H, C, Lk)`` each."""
    B, H, C, D = qb.shape
    Lk = k.shape[2]
    e = torch.matmul(qb, k.transpose(-1, -2)) * (config.alpha * scale)  # (B, H, C, Lk)
    dist = l1_distance(qb.reshape(B * H, C, D), k.reshape(B * H, Lk, D))  # (B*H, C, Lk)
    n = dist.view(B, H, C, Lk) * (-config.beta * scale)  # (B, H, C, Lk)
    return e, n


def _block_sums(qb, k, masks: MaskInfo, i0, i1, scale, config):
    """Sums of ``alpha E`` and ``beta N`` over the valid pairs of the block, and their count; ``(B, H, 1,
    1)``."""
    e, n = _affinity_distance(qb, k, scale, config)
    valid = masks.block_valid(i0, i1, 0, masks.Lk)
    if valid is None:
        count = torch.full((1, 1, 1, 1), float(e.shape[-2] * e.shape[-1]), dtype=e.dtype, device=e.device)
        return e.sum(dim=(-2, -1), keepdim=True), n.sum(dim=(-2, -1), keepdim=True), count
    valid = valid.expand_as(e)
    count = valid.sum(dim=(-2, -1), keepdim=True).to(e.dtype)
    return (
        e.masked_fill(~valid, 0.0).sum(dim=(-2, -1), keepdim=True),
        n.masked_fill(~valid, 0.0).sum(dim=(-2, -1), keepdim=True),
        count,
    )


def _block_out(qb, k, v, mean_e, mean_n, masks: MaskInfo, i0, i1, scale, config):
    """``M[i0:i1] @ v`` for one block of queries, ``(B, H, C, Dv)``."""
    e, n = _affinity_distance(qb, k, scale, config)
    if mean_e is not None:
        e = e - mean_e  # eq. (6)
    if mean_n is not None:
        n = n - mean_n  # eq. (4)
    m = coda_affinity(e, config) * coda_gate(n, config)  # (B, H, C, Lk), eqs. (1) and (5)
    valid = masks.block_valid(i0, i1, 0, masks.Lk)
    if valid is not None:
        m = m.masked_fill(~valid, 0.0)
    return m @ v  # (B, H, C, Dv)
