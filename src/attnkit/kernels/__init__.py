"""The ``"efficient"`` backend: every mechanism in ``O(L)`` extra memory with exact gradients.

``efficient_attention`` is what ``ak.attention(..., backend="efficient")`` calls; ``prefers_efficient``
decides for ``backend="auto"``. Both follow ``dispatch.plan``, the one chooser over the route table
``dispatch.ROUTES`` (SDPA, the C++ softmax and potential kernels, the Triton potential kernels on CUDA, the
ATen fallback, the block sweeps, the fused C++ and Triton CoDA kernels, CoDA's query blocks);
``ak.explain_dispatch`` prints its choice for a call.

The (Lq, Lk) weights are never materialized; use ``backend="reference"`` to get them.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from ..config import MechanismConfig
from ..masks import MaskInfo
from .dispatch import CODA_MIN_TOTAL_PAIRS, MIN_PAIRS, ROUTES, Plan, plan, run_route

__all__ = [
    "efficient_attention",
    "prefers_efficient",
    "plan",
    "Plan",
    "ROUTES",
    "MIN_PAIRS",
    "CODA_MIN_TOTAL_PAIRS",
]


def efficient_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    config: MechanismConfig,
    mask: MaskInfo,
    *,
    scale: float,
    dropout_p: float = 0.0,
    u: Optional[Tensor] = None,
) -> Tensor:
    """Attention output ``(B, H, Lq, Dv)`` of ``config`` without materializing the ``(Lq, Lk)`` weights.

    Same contract as the reference backend of ``attnkit.functional`` (inputs already validated):
    invalid pairs weigh 0, queries without a valid key return zeros, padded queries never enter a
    column normalization. Dropout is supported for softmax (by the fused kernel) and, on the CPU with
    padding masks only, for DNAS/HNAS/Sinkhorn, and on the CPU for CoDA with any mask (the C++ kernels
    replay a hashed mask in the backward pass); elsewhere the mechanisms recompute their weights in the
    backward pass and raise a ``ValueError`` for ``dropout_p > 0``.
    """
    route = plan(q, k, v, config, mask, dropout_p=dropout_p, backend="efficient").route
    return run_route(route, q, k, v, config, mask, scale=scale, dropout_p=dropout_p, u=u)


def prefers_efficient(
    q: Tensor, k: Tensor, v: Tensor, config: MechanismConfig, mask: MaskInfo, *, dropout_p: float = 0.0
) -> bool:
    """``backend="auto"``: True when ``plan`` picks an efficient route (see ``dispatch.plan``)."""
    return plan(q, k, v, config, mask, dropout_p=dropout_p, backend="auto").route != "reference"
