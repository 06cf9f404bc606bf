"""Block-wise access to the masks of one attention call, without ever building ``(Lq, Lk)`` tensors.

The efficient kernels visit the score matrix in blocks of keys ``[j0, j1)`` (or queries ``[i0, i1)``).
``BlockMasks`` keeps the masks in their factored form (``key_mask (B, 1, 1, Lk)``, ``query_mask
(B, 1, Lq, 1)``, the user's ``attn_mask`` as given, ``causal`` as a flag) and returns the validity and
the additive bias of one block on demand, so that the only ``O(Lq * Lk)`` memory is what the user passed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from ..masks import MaskInfo

__all__ = ["BlockMasks", "chunk_size", "head_groups", "reduce_to"]

# Elements of one score block (8 MiB in float32): large enough that each operation is one sizeable
# parallel region, small enough that the few live blocks stay far below the (Lq, Lk) matrix.
BLOCK_ELEMENTS = 1 << 21


@dataclass
class BlockMasks:
    """The masks of one call in factored form; every tensor is broadcastable to ``(B, H, Lq, Lk)``."""

    key: Optional[Tensor]  # (B, 1, 1, Lk) bool
    query: Optional[Tensor]  # (B, 1, Lq, 1) bool
    pair: Optional[Tensor]  # (B|1, H|1, Lq|1, Lk|1) bool, from attn_mask
    bias: Optional[Tensor]  # (B|1, H|1, Lq|1, Lk|1) float, finite, from a float attn_mask
    causal: bool
    Lq: int
    Lk: int

    @classmethod
    def from_info(cls, mask: MaskInfo, Lq: int, Lk: int) -> "BlockMasks":
        key = mask.key_mask[:, None, None, :] if mask.key_mask is not None else None  # (B, 1, 1, Lk)
        query = mask.query_mask[:, None, :, None] if mask.query_mask is not None else None  # (B, 1, Lq, 1)
        pair = None
        bias = None
        if mask.attn_mask is not None:
            m = mask.attn_mask
            m = m.reshape((1,) * (4 - m.dim()) + tuple(m.shape))  # (B|1, H|1, Lq|1, Lk|1)
            if m.dtype == torch.bool:
                pair = m
            else:
                finite = torch.isfinite(m)
                pair = None if bool(finite.all()) else finite
                bias = mask.bias if mask.bias is not None else m.masked_fill(~finite, 0.0)
        return cls(key=key, query=query, pair=pair, bias=bias, causal=bool(mask.causal), Lq=Lq, Lk=Lk)

    def select(self, b0: int, b1: int, h0: int, h1: int) -> "BlockMasks":
        """The masks of batch elements ``[b0, b1)`` and heads ``[h0, h1)``."""

        def _sub(t: Optional[Tensor]) -> Optional[Tensor]:
            if t is None:
                return None
            if t.shape[0] != 1:
                t = t[b0:b1]
            if t.shape[1] != 1:
                t = t[:, h0:h1]
            return t

        return BlockMasks(
            key=_sub(self.key), query=_sub(self.query), pair=_sub(self.pair), bias=_sub(self.bias),
            causal=self.causal, Lq=self.Lq, Lk=self.Lk,
        )

    @property
    def any(self) -> bool:
        """True when some pair may be invalid."""
        return self.key is not None or self.query is not None or self.pair is not None or self.causal

    def valid(self, i0: int, i1: int, j0: int, j1: int) -> Optional[Tensor]:
        """Validity of the block ``[i0, i1) x [j0, j1)``, broadcastable to ``(B, H, i1 - i0, j1 - j0)``."""
        out: Optional[Tensor] = None

        def _and(m: Tensor) -> None:
            nonlocal out
            out = m if out is None else out & m

        if self.key is not None:
            _and(self.key[..., j0:j1])
        if self.query is not None:
            _and(self.query[..., i0:i1, :])
        if self.pair is not None:
            _and(_block(self.pair, i0, i1, j0, j1))
        if self.causal:
            device = (self.key if self.key is not None else self.query if self.query is not None else self.pair)
            device = device.device if device is not None else None
            rows = torch.arange(i0, i1, device=device)[:, None]  # (rows, 1)
            cols = torch.arange(j0, j1, device=device)[None, :]  # (1, cols)
            _and((cols <= rows)[None, None])  # (1, 1, rows, cols)
        return out

    def bias_block(self, i0: int, i1: int, j0: int, j1: int) -> Optional[Tensor]:
        return None if self.bias is None else _block(self.bias, i0, i1, j0, j1)


def _block(t: Tensor, i0: int, i1: int, j0: int, j1: int) -> Tensor:
    """Rows ``[i0, i1)`` and columns ``[j0, j1)`` of a tensor broadcastable to ``(B, H, Lq, Lk)``."""
    if t.shape[-2] != 1:
        t = t[..., i0:i1, :]
    if t.shape[-1] != 1:
        t = t[..., j0:j1]
    return t


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
