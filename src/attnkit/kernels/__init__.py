"""The ``"efficient"`` backend: every mechanism in ``O(L)`` extra memory with exact gradients.

``efficient_attention`` is what ``ak.attention(..., backend="efficient")`` calls;
``prefers_efficient`` decides for ``backend="auto"``. Per mechanism:

- softmax: ``F.scaled_dot_product_attention`` (fused) when the masks allow it, else the block kernel;
- dnas / hnas / sinkhorn on the CPU, with or without padding masks: ``fused_cpu.fused_cpu_attention``, the C++
  kernels of ``csrc/potentials_cpu.cpp`` (built on first use; see ``cpu_ext``);
- where those cannot be built: dnas / hnas with padding masks through PyTorch's fused CPU attention op
  (``fused_dnas.fused_dnas_attention``);
- dnas / hnas / sinkhorn on CUDA (float32/bfloat16/float16) with or without padding masks, where Triton is
  installed: ``triton_potentials.triton_attention`` (FlashAttention-2-style Triton kernels);
- dnas / hnas / sinkhorn otherwise (``attn_mask``, causal, CUDA without Triton): ``potentials.potential_attention`` (block sweeps with
  recomputation; plain tensor operations, so the same code runs on CPU and CUDA);
- coda: ``coda.coda_attention`` (query blocks, L1 distances by ``l1.l1_distance``, recomputation).

The (Lq, Lk) weights are never materialized; use ``backend="reference"`` to get them.
"""

from __future__ import annotations

from typing import Optional

import torch.nn.functional as F
from torch import Tensor

from ..config import CoDA, Hybrid, MechanismConfig, Sinkhorn
from ..masks import MaskInfo
from ._blocks import BlockMasks
from .coda import coda_attention
from .fused_cpu import fused_cpu_attention, fused_cpu_available
from .fused_dnas import fused_available, fused_dnas_attention
from .potentials import potential_attention

__all__ = ["efficient_attention", "prefers_efficient", "MIN_PAIRS", "CODA_MIN_TOTAL_PAIRS"]

# backend="auto" takes the efficient path from this many (query, key) pairs on: below it the
# materialized path is as fast and the memory it saves is small.
MIN_PAIRS = 128 * 128
# CoDA's cost is the L1 distance (``torch.cdist(p=1)``, no BLAS path), which the efficient path
# computes twice (forward, and again in the backward pass); the materialized path is faster until its
# memory traffic dominates. Measured (2 threads, fp32, B=1, H=8, D=64, forward+backward, efficient /
# reference): L=256 1.45, 1024 1.15, 1536 1.10, 2048 0.91, 4096 0.76. So CoDA goes efficient from this
# many pairs over the whole batch (B * H * Lq * Lk), where the reference holds about 0.6 GiB. With the C++
# L1 kernel (both paths ~3.4x faster) the crossover moved down but is noisy: 4.2M pairs 0.73, 8.4M
# 0.82 (B=1) / 1.28 (B=2), 16.8M 0.72; the threshold stays where the efficient path wins.
CODA_MIN_TOTAL_PAIRS = 1 << 24


def _iters(config: MechanismConfig) -> int:
    if isinstance(config, Sinkhorn):
        return config.iters
    return 0 if config.name == "softmax" else 1


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
    padding masks only, for DNAS/HNAS/Sinkhorn (the C++ kernels replay a hashed mask in the backward
    pass); elsewhere the mechanisms recompute their weights in the backward pass and raise a
    ``ValueError`` for ``dropout_p > 0``.
    """
    Lq, Lk = q.shape[2], k.shape[2]
    if dropout_p > 0 and config.name != "softmax" and not _cpu_dropout_ok(q, config, mask):
        raise ValueError(
            f"dropout_p={dropout_p} is not supported by backend='efficient' for mechanism {config.name!r} "
            "(its backward pass recomputes the weights and cannot replay the dropout mask); "
            "use backend='reference' (or 'auto') for attention dropout"
        )
    masks = BlockMasks.from_info(mask, Lq, Lk)
    if isinstance(config, CoDA):
        return coda_attention(q, k, v, masks, config, scale=scale)
    iters = _iters(config)
    if iters == 0 and _sdpa_ok(masks, dropout_p):
        return _sdpa_softmax(q, k, v, masks, scale=scale, dropout_p=dropout_p)
    if dropout_p > 0 and not _cpu_dropout_ok(q, config, mask):
        raise ValueError(
            f"dropout_p={dropout_p} with causal=True and another mask is not supported by backend='efficient'; "
            "use backend='reference'"
        )
    hybrid_u = u if isinstance(config, Hybrid) else None
    padding_only = mask.attn_mask is None and not mask.causal
    triton_route = _triton_route(q) if padding_only else None
    if triton_route is not None:
        return triton_route.triton_attention(
            q, k, v, key_mask=mask.key_mask, query_mask=mask.query_mask, scale=scale, iters=iters, u=hybrid_u
        )
    if padding_only and fused_cpu_available(q):
        return fused_cpu_attention(
            q, k, v, key_mask=mask.key_mask, query_mask=mask.query_mask, scale=scale, iters=iters, u=hybrid_u,
            dropout_p=dropout_p,
        )
    if iters == 1 and padding_only and fused_available(q, v):
        return fused_dnas_attention(
            q, k, v, key_mask=mask.key_mask, query_mask=mask.query_mask, scale=scale, u=hybrid_u
        )
    return potential_attention(q, k, v, masks, scale=scale, iters=iters, u=hybrid_u)


def _sdpa_ok(masks: BlockMasks, dropout_p: float) -> bool:
    """The fused kernel takes one mask: fine unless causal comes with another pair mask or a learnable bias."""
    if masks.bias is not None and masks.bias.requires_grad:
        return False
    return not (masks.causal and (masks.key is not None or masks.pair is not None or masks.bias is not None))


def _sdpa_softmax(q: Tensor, k: Tensor, v: Tensor, masks: BlockMasks, *, scale: float, dropout_p: float) -> Tensor:
    attn: Optional[Tensor] = None
    if masks.key is not None or masks.pair is not None:
        attn = masks.key if masks.pair is None else (masks.pair if masks.key is None else masks.key & masks.pair)
    if masks.bias is not None:
        bias = masks.bias.to(q.dtype)
        attn = bias if attn is None else bias.masked_fill(~attn, float("-inf"))  # (B|1, H|1, Lq|1, Lk)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn, dropout_p=dropout_p, is_causal=masks.causal, scale=scale
    )  # (B, H, Lq, Dv); rows without a valid key are zeros
    if masks.query is not None:
        out = out.masked_fill(~masks.query, 0.0)
    return out


def prefers_efficient(
    q: Tensor, k: Tensor, v: Tensor, config: MechanismConfig, mask: MaskInfo, *, dropout_p: float = 0.0
) -> bool:
    """``backend="auto"``: the efficient path when it pays and supports the call.

    DNAS/HNAS/Sinkhorn with padding masks only, on the CPU with the C++ kernels built: always (measured,
    fwd+bwd, B=4, H=8, D=32: 0.45-0.6x the reference's time at L=8..32, 0.3-0.5x at L=128). Otherwise it pays
    from ``Lq * Lk >= MIN_PAIRS``; for CoDA from ``B * H * Lq * Lk >= CODA_MIN_TOTAL_PAIRS``.
    """
    Lq, Lk = q.shape[2], k.shape[2]
    if dropout_p > 0:
        if config.name != "softmax":
            return _cpu_dropout_ok(q, config, mask)
        if mask.causal and (mask.key_mask is not None or mask.attn_mask is not None):
            return False
    if isinstance(config, CoDA):
        B, H = max(q.shape[0], k.shape[0]), max(q.shape[1], k.shape[1])
        return B * H * Lq * Lk >= CODA_MIN_TOTAL_PAIRS
    if _iters(config) >= 1 and mask.attn_mask is None and not mask.causal and _triton_route(q) is not None:
        return True  # CUDA with Triton: the fused kernels never materialize the weights
    if _iters(config) >= 1 and mask.attn_mask is None and not mask.causal and fused_cpu_available(q):
        return True  # the C++ kernels beat the materialized path at every size (0.3-0.6x its time at L <= 128)
    return Lq * Lk >= MIN_PAIRS


def _cpu_dropout_ok(q: Tensor, config: MechanismConfig, mask: MaskInfo) -> bool:
    """DNAS/HNAS/Sinkhorn with padding masks only on the CPU: the C++ kernels support attention dropout."""
    return (
        not isinstance(config, CoDA) and _iters(config) >= 1 and mask.attn_mask is None and not mask.causal
        and fused_cpu_available(q)
    )


# --- CUDA route (Triton): kept apart from the CPU routes above -----------------------------------------


def _triton_route(q: Tensor):
    """``triton_potentials`` for CUDA tensors it supports, else None; Triton is imported on first use only."""
    if not q.is_cuda:
        return None
    from . import triton_potentials

    return triton_potentials if triton_potentials.triton_available(q) else None
