"""Hybrid attention (HNAS): a learned mix of doubly-normalized and softmax attention.

"Doubly-Normalized Attention", section 6; "Attention that does not Explain Away" (arXiv:2009.14308), section 5
(one weight per layer and head); docs/design.md section 2:

    pi^H = u * pi^D + (1 - u) * pi^L,    u in [0, 1]

``u = 0`` is softmax, ``u = 1`` is DNAS. Because the output is linear in ``pi``,
``out^H = u * out^D + (1 - u) * out^L``.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from .dnas import dnas_weights
from .softmax import softmax_weights
from ..validators import is_number, unbatched_values, values_hidden

__all__ = ["hnas_weights", "check_hybrid_weight", "sigmoid_weight", "whole_theta"]

_UNIT_INTERVAL = "_attnkit_in_unit_interval"


def sigmoid_weight(theta: Tensor) -> Tensor:
    """``u = sigmoid(theta)``, marked as lying in [0, 1] by construction, so that ``check_hybrid_weight``
    skips its value check (a host synchronization) for the modules' own learnable weights."""
    u = torch.sigmoid(theta)
    setattr(u, _UNIT_INTERVAL, True)
    return u


def whole_theta(theta: Tensor) -> Tensor:
    """All of ``theta``, detached: a parameter sharded by FSDP2 (``fully_shard``) is a ``DTensor`` holding
    this process's heads only, which ``.tolist()``, ``numpy()`` and ``torch.equal`` refuse; its
    ``full_tensor()`` gathers the other processes' heads (a collective: every process must read it)."""
    full = getattr(theta, "full_tensor", None)
    return (full() if callable(full) else theta).detach()


def check_hybrid_weight(
    u: Union[float, Tensor], H: int, like: Tensor, *, dtype: Optional[torch.dtype] = None
) -> Tensor:
    """Validate ``u`` (a number, or a tensor of shape ``()``, ``(H,)`` or broadcastable to ``(B, H, 1, 1)``)
    and return it as a tensor broadcastable to ``(B, H, Lq, Lk)`` on ``like``'s device, in ``dtype``
    (``like``'s dtype by default). The values of a user's tensor are checked to lie in [0, 1] (a host
    synchronization); those of ``sigmoid_weight`` cannot leave it and are not."""
    dtype = like.dtype if dtype is None else dtype
    if not (is_number(u) or isinstance(u, Tensor)):
        raise ValueError(f"hybrid_weight must be a number or a tensor in [0, 1], got {type(u).__name__}")
    if not isinstance(u, Tensor):
        if not 0.0 <= float(u) <= 1.0:
            raise ValueError(f"hybrid_weight={u!r} is outside [0, 1]; u mixes DNAS (u=1) and softmax (u=0)")
        return torch.tensor(float(u), dtype=dtype, device=like.device)
    if not u.dtype.is_floating_point:
        raise ValueError(f"hybrid_weight has dtype {u.dtype}; expected a floating tensor in [0, 1]")
    if u.device != like.device:
        raise ValueError(f"hybrid_weight is on {u.device} but the inputs are on {like.device}")
    if not getattr(u, _UNIT_INTERVAL, False):
        plain = unbatched_values(u) if values_hidden(u) else u  # under vmap: every example's values
        with torch.no_grad():
            if torch.isnan(plain).any() or (plain < 0).any() or (plain > 1).any():
                raise ValueError(
                    f"hybrid_weight has values outside [0, 1] (min {plain.min().item():.4g}, "
                    f"max {plain.max().item():.4g}); pass sigmoid(theta) for a learnable weight"
                )
    if u.dim() == 1:
        if u.shape[0] not in (1, H):
            raise ValueError(f"hybrid_weight has shape {tuple(u.shape)}; expected () or (H,) = ({H},)")
        u = u.view(1, -1, 1, 1)  # (1, H, 1, 1)
    elif u.dim() == 4:
        B = like.shape[0]
        if u.shape[0] not in (1, B) or u.shape[1] not in (1, H) or u.shape[2] != 1 or u.shape[3] != 1:
            raise ValueError(
                f"hybrid_weight has shape {tuple(u.shape)}; a 4-D weight must be (B, H, 1, 1) with B = "
                f"{B} (or 1) and H = {H} (or 1) "
                "(one u per batch element and head)"
            )
    elif u.dim() != 0:
        raise ValueError(f"hybrid_weight has shape {tuple(u.shape)}; expected (), (H,) or (B, H, 1, 1)")
    return u.to(dtype)


def hnas_weights(scores: Tensor, valid: Optional[Tensor], u: Tensor) -> Tensor:
    """Hybrid weights ``(B, H, Lq, Lk)``; ``u`` already validated by ``check_hybrid_weight``."""
    return u * dnas_weights(scores, valid) + (1 - u) * softmax_weights(scores, valid)
