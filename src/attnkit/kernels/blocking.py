"""Block sizes for the efficient kernels, which visit the score matrix in blocks of keys ``[j0, j1)`` (or
queries ``[i0, i1)``) and read the validity and bias of each block from the call's one ``MaskInfo``
(``attnkit.masks``: ``block_valid``, ``bias_block``, ``select``), never building ``(Lq, Lk)`` tensors."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["chunk_size", "head_groups", "reduce_to"]

# Elements of one score block (8 MiB in float32): large enough that each operation is one sizeable
# parallel region, small enough that the few live blocks stay far below the (Lq, Lk) matrix.
BLOCK_ELEMENTS = 1 << 21


def chunk_size(BH: int, length: int, total: int, budget: int = BLOCK_ELEMENTS) -> int:
    """Block width so that a ``(BH, length, width)`` block has about ``budget`` elements (at least 32)."""
    width = budget // max(1, BH * length)
    width = max(32, (width // 32) * 32)
    return min(total, width)


def head_groups(B: int, H: int, pairs: int, budget: int = BLOCK_ELEMENTS):
    """``(b0, b1, h0, h1)`` slices of the (batch, head) grid: as many heads per group as leave blocks
    of at least 64 keys (``pairs = Lq * 64`` elements per head) within ``budget``."""
    g = max(1, min(H, budget // max(1, pairs)))
    for b in range(B):
        for h0 in range(0, H, g):
            yield b, b + 1, h0, min(H, h0 + g)


def reduce_to(grad: Tensor, shape: torch.Size) -> Tensor:
    """Sum a gradient over the dimensions that were broadcast from ``shape``."""
    dims = tuple(d for d in range(grad.dim()) if shape[d] == 1 and grad.shape[d] != 1)
    return grad.sum(dim=dims, keepdim=True) if dims else grad
