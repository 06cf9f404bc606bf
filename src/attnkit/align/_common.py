r"""Pieces shared by the alignment losses: gradient reversal, the highway layer, masks and reductions.

Gradient reversal (Ganin & Lempitsky, "Unsupervised Domain Adaptation by Backpropagation", arXiv:1409.7495):
the identity forward, ``-gamma *`` the gradient backward, so one optimizer step trains a discriminator to
minimize a loss and the layers before it to maximize it.

Highway layer (Srivastava et al., "Training Very Deep Networks", arXiv:1507.06228, its reference [31]), in
the form the alignment-attention discriminator and critic use ("Alignment Attention by Matching Key and Query
Distributions", arXiv:2110.12567, sec. 2.3.1):

.. math::
    g = W x + b, \qquad h = \sigma(g) \odot \mathrm{relu}(g) + (1 - \sigma(g)) \odot x
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

__all__ = ["grad_reverse", "Highway", "valid_mask", "reduce_heads", "check_pair", "check_module"]


class _GradReverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, gamma: float) -> Tensor:
        ctx.gamma = gamma
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return -ctx.gamma * grad, None


def grad_reverse(x: Tensor, gamma: float = 1.0) -> Tensor:
    """Identity in the forward pass; multiplies the incoming gradient by ``-gamma`` in the backward pass."""
    return _GradReverse.apply(x, float(gamma))


class Highway(nn.Module):
    r"""One highway layer (Srivastava et al., "Training Very Deep Networks", arXiv:1507.06228), as the
    alignment-attention paper's discriminator and critic use it (sec. 2.3.1): a transform gate
    :math:`t = \sigma(W_T x + b_T)` and "another linear layer followed by ReLU",
    :math:`h = t \odot \mathrm{relu}(W_H x + b_H) + (1 - t) \odot x`.

    Shapes: ``x (..., d) -> (..., d)``.
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.gate = nn.Linear(dim, dim)
        self.transform = nn.Linear(dim, dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.gate.reset_parameters()
        self.transform.reset_parameters()

    def forward(self, x: Tensor) -> Tensor:
        t = torch.sigmoid(self.gate(x))
        return t * torch.relu(self.transform(x)) + (1 - t) * x

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


def valid_mask(mask: Optional[Tensor], B: int, L: int, device, name: str = "mask") -> Tensor:
    """A boolean ``(B, L)`` mask, True = real token (all True when ``mask`` is None).

    ``mask`` is bool, or integer with values 0/1 (a Hugging Face ``attention_mask``). Floating masks are
    refused: an additive mask (0 = keep, -inf = padding) would read as its opposite.
    """
    if mask is None:
        return torch.ones(B, L, dtype=torch.bool, device=device)
    if not isinstance(mask, Tensor):
        raise ValueError(f"{name} must be a bool tensor (B, L) = ({B}, {L}), got {type(mask).__name__}")
    if mask.shape != (B, L):
        raise ValueError(f"{name} has shape {tuple(mask.shape)}, expected (B, L) = ({B}, {L})")
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise ValueError(
            f"{name} has dtype {mask.dtype}; pass a bool mask, True = real token "
            "(from a 0/1 mask m: m.bool(); from an additive 0/-inf mask m: m == 0)"
        )
    if mask.dtype != torch.bool and bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError(f"{name} has values other than 0 and 1; pass a bool mask, True = real token")
    return mask.to(device=device, dtype=torch.bool)


def check_pair(q: Tensor, k: Tensor) -> None:
    """``q (B, H, Lq, d)`` and ``k (B, H, Lk, d)`` with equal ``B, H, d``, floating, of one dtype and
    device."""
    if not isinstance(q, Tensor) or not isinstance(k, Tensor):
        raise ValueError(f"q and k must be tensors, got {type(q).__name__} and {type(k).__name__}")
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be (B, H, L, d), got shapes {tuple(q.shape)} and {tuple(k.shape)}")
    if q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch, heads and head dim (B, H, ., d)"
        )
    if not q.dtype.is_floating_point or q.dtype != k.dtype or q.device != k.device:
        raise ValueError(
            f"q ({q.dtype}, {q.device}) and k ({k.dtype}, {k.device}) must be floating tensors of one dtype "
            "on one device; convert both, e.g. k.to(q)"
        )


def check_module(module: nn.Module, x: Tensor, name: str) -> None:
    """``module``'s parameters have the dtype and device of ``x`` (else matmul fails deep inside)."""
    p = next(module.parameters(), None)
    if p is not None and (p.dtype != x.dtype or p.device != x.device):
        raise ValueError(
            f"the {name}'s parameters are {p.dtype} on {p.device}, q and k {x.dtype} on {x.device}; move one "
            f"to the other ({name}.to(q) or q.to(...); an AlignmentRegularizer moves with reg.to(...))"
        )


def reduce_heads(values: Tensor, q_mask: Tensor, k_mask: Tensor) -> Tensor:
    """Mean of per-sample, per-head values ``(B, H)`` over the samples that have real queries and keys."""
    has = q_mask.any(-1) & k_mask.any(-1)  # (B,)
    if not bool(has.any()):
        return values.sum() * 0.0
    return values[has].mean()
