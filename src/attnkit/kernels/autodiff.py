"""Where the kernels' autograd functions cannot go: torch.func transforms and forward-mode AD.

The efficient routes and the C++ L1 distance are ``torch.autograd.Function``s with a backward only (no
``setup_context`` for torch.func, no ``jvp`` for forward-mode AD, whose tangent they would silently drop).
Inside either, calls take plain PyTorch operations instead (the materialized path; the L1 distance summed one
feature at a time, as ``torch.cdist`` has no forward-mode AD).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor

__all__ = ["unsupported_autodiff"]


def _has_tangent(tensors: tuple[Optional[Tensor], ...]) -> bool:
    if fwAD._current_level < 0:  # no dual level open, so no tensor carries a tangent (cheap, the usual case)
        return False
    return any(t is not None and fwAD.unpack_dual(t).tangent is not None for t in tensors)


def unsupported_autodiff(*tensors: Optional[Tensor]) -> Optional[str]:
    """Why the kernels' autograd functions cannot run on ``tensors`` here, or None when they can."""
    if torch._C._are_functorch_transforms_active():
        return (
            "inside a torch.func transform (grad, vmap, jacrev, ...), which the efficient kernels' autograd "
            "functions do not support"
        )
    if _has_tangent(tensors):
        return (
            "forward-mode AD (dual tensors): the efficient kernels' autograd functions have no jvp and would "
            "drop the tangent"
        )
    return None
