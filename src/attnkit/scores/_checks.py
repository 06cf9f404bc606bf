"""Input checks shared by the score functions: each raises a one-line ``ValueError`` that names the shapes or
dtypes it received and what to pass instead.

Queries and keys are ``q (..., Lq, Dq)`` and ``k (..., Lk, Dk)`` (usually ``(B, H, L, D)``): floating tensors
of one dtype on one device, with leading (batch) dims that broadcast and feature dims ``D >= 1``. Under
``torch.autocast`` mixed floating dtypes are allowed, as autocast casts them.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..validators import check_float_tensor, check_number

__all__ = ["check_scale", "check_query_key", "check_weight"]


def check_scale(scale: Any, D: int) -> float:
    """``1/sqrt(D)`` for ``None``, else ``scale`` if it is a finite number > 0."""
    if scale is None:
        return 1.0 / math.sqrt(D)
    expected = f"expected a finite number > 0 (default 1/sqrt(D) = {1 / math.sqrt(D):.4g})"
    return check_number(scale, f"scale={scale!r}", expected, low=0.0, low_open=True, sep="; ")


def _same_dtype(t: Tensor, ref: Tensor) -> bool:
    return t.dtype == ref.dtype or torch.is_autocast_enabled(ref.device.type)


def check_query_key(fn: str, q: Any, k: Any, *, same_dim: bool) -> torch.Size:
    """Check ``q (..., Lq, Dq)`` and ``k (..., Lk, Dk)`` for score function ``fn``; ``same_dim`` requires
    ``Dq == Dk``. Returns the broadcast batch shape ``(...)``."""
    check_float_tensor(q, f"{fn}: q")
    check_float_tensor(k, f"{fn}: k")
    for name, t, L in (("q", q, "Lq"), ("k", k, "Lk")):
        if t.dim() < 2:
            raise ValueError(
                f"{fn}: {name} has shape {tuple(t.shape)}; expected at least 2-D (..., {L}, D), usually "
                f"(B, H, {L}, D)"
            )
    if k.device != q.device:
        raise ValueError(f"{fn}: q is on {q.device} but k is on {k.device}; move one with .to(device)")
    if not _same_dtype(k, q):
        raise ValueError(f"{fn}: q has dtype {q.dtype} but k has dtype {k.dtype}; cast one with .to(dtype)")
    Dq, Dk = q.shape[-1], k.shape[-1]
    if same_dim and Dq != Dk:
        raise ValueError(
            f"{fn}: q has shape {tuple(q.shape)} and k has shape {tuple(k.shape)}; their feature dims D "
            f"({Dq} and {Dk}) must be equal (project one, or use bilinear or additive scores)"
        )
    if Dq == 0 or Dk == 0:
        raise ValueError(
            f"{fn}: q has shape {tuple(q.shape)} and k has shape {tuple(k.shape)}; scores need feature dims "
            "D >= 1"
        )
    try:
        return torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    except RuntimeError:
        raise ValueError(
            f"{fn}: q has shape {tuple(q.shape)} and k has shape {tuple(k.shape)}; their batch dims "
            f"{tuple(q.shape[:-2])} and {tuple(k.shape[:-2])} do not broadcast (use equal (B, H), or 1 "
            "where one side is shared)"
        ) from None


def check_weight(fn: str, name: str, w: Tensor, q: Tensor) -> None:
    """Check that weight ``w`` (a floating tensor) is on ``q``'s device and has ``q``'s dtype."""
    if w.device != q.device:
        raise ValueError(f"{fn}: {name} is on {w.device} but q is on {q.device}; move one with .to(device)")
    if not _same_dtype(w, q):
        raise ValueError(
            f"{fn}: {name} has dtype {w.dtype} but q has dtype {q.dtype}; cast one with .to(dtype)"
        )
