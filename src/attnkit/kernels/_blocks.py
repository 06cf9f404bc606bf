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

__all__ = ["BlockMasks", "chunk_size", "reduce_to"]

# Elements of one (B, H, rows, cols) score block: about 16 MiB in float32, a few such blocks live at once.
BLOCK_ELEMENTS = 1 << 22


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
    """Block width so that a ``(B*H, length, width)`` block has about ``budget`` elements."""
    width = budget // max(1, BH * length)
    width = max(32, (width // 32) * 32)
    return min(total, width)


def reduce_to(grad: Tensor, shape: torch.Size) -> Tensor:
    """Sum a gradient over the dimensions that were broadcast from ``shape``."""
    dims = tuple(d for d in range(grad.dim()) if shape[d] == 1 and grad.shape[d] != 1)
    return grad.sum(dim=dims, keepdim=True) if dims else grad
