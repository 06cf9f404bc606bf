"""Additive (MLP) scores of Bahdanau et al. (2015).

"Neural Machine Translation by Jointly Learning to Align and Translate" (arXiv:1409.0473);
docs/design.md section 1:

    s_ij = w^T tanh(W_q q_i + W_k k_j + b)

The sum is broadcast over (Lq, Lk), so this score costs ``O(Lq * Lk * A)`` memory for hidden size ``A``,
as in the original model.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn

from ..validators import check_float_tensor, check_int
from ._checks import check_query_key, check_weight

__all__ = ["additive", "AdditiveScore"]


def additive(
    q: Tensor, k: Tensor, w_q: Tensor, w_k: Tensor, w: Tensor, bias: Optional[Tensor] = None
) -> Tensor:
    """``q (B, H, Lq, Dq)``, ``k (B, H, Lk, Dk)``, ``w_q (A, Dq)``, ``w_k (A, Dk)``, ``w (A,)``, ``bias (A,)``
    -> ``(B, H, Lq, Lk)``.

    Any leading dims that broadcast work in place of ``(B, H)``. A ``ValueError`` names weights of the wrong
    shape, ``D = 0`` or ``A = 0``, mixed dtypes or devices, and non-floating inputs.
    """
    check_query_key("additive", q, k, same_dim=False)
    got = {"w_q": w_q, "w_k": w_k, "w": w, **({"bias": bias} if bias is not None else {})}
    for name, t in got.items():
        check_float_tensor(t, f"additive: {name}")
    A = w.shape[-1] if w.dim() >= 1 else w_q.shape[0]
    want = {"w_q": (A, q.shape[-1]), "w_k": (A, k.shape[-1]), "w": (A,), "bias": (A,)}
    if any(tuple(t.shape) != want[name] for name, t in got.items()):
        raise ValueError(
            "additive weights have shapes "
            + ", ".join(f"{name}={tuple(t.shape)}" for name, t in got.items())
            + "; expected "
            + ", ".join(f"{want[name]}" for name in got)
        )
    if A == 0:
        raise ValueError(
            f"additive weights have hidden size A=0 (w has shape {tuple(w.shape)}); expected A >= 1"
        )
    for name, t in got.items():
        check_weight("additive", name, t, q)
    hq = q @ w_q.T  # (B, H, Lq, A)
    hk = k @ w_k.T  # (B, H, Lk, A)
    if bias is not None:
        hq = hq + bias
    return torch.tanh(hq.unsqueeze(-2) + hk.unsqueeze(-3)) @ w  # (B, H, Lq, Lk, A) @ (A,) -> (B, H, Lq, Lk)


class AdditiveScore(nn.Module):
    """Learnable Bahdanau score ``w^T tanh(W_q q + W_k k + b)`` with hidden size ``hidden_dim``."""

    def __init__(self, query_dim: int, key_dim: int, hidden_dim: int) -> None:
        super().__init__()
        for name, value in (("query_dim", query_dim), ("key_dim", key_dim), ("hidden_dim", hidden_dim)):
            check_int(value, f"AdditiveScore({name}={value!r})", "expected a positive integer", low=1)
        self.w_q = nn.Parameter(torch.empty(hidden_dim, query_dim))
        self.w_k = nn.Parameter(torch.empty(hidden_dim, key_dim))
        self.bias = nn.Parameter(torch.empty(hidden_dim))
        self.w = nn.Parameter(torch.empty(hidden_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.xavier_uniform_(self.w_q)
        nn.init.xavier_uniform_(self.w_k)
        nn.init.zeros_(self.bias)
        nn.init.uniform_(self.w, -1 / math.sqrt(self.w.numel()), 1 / math.sqrt(self.w.numel()))

    def forward(self, q: Tensor, k: Tensor) -> Tensor:
        return additive(q, k, self.w_q, self.w_k, self.w, self.bias)

    def extra_repr(self) -> str:
        return f"query_dim={self.w_q.shape[1]}, key_dim={self.w_k.shape[1]}, hidden_dim={self.w.shape[0]}"
