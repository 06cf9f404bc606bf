"""DNAS, HNAS and Sinkhorn-k written with PyTorch's FlexAttention: the GPU peer of ``attnkit bench``.

"FlexAttention: A Programming Model for Generating Optimized Attention Kernels" (arXiv:2412.05496). A
column log-sum-exp is the row log-sum-exp of the transposed scores, so with ``a^0 = 0`` each round

    b^t_j = -LSE_i (s_ij + a^{t-1}_i) = -lse(flex_attention(k, q, ., score_mod=+a^{t-1}_i))
    a^t_i = -LSE_j (s_ij + b^t_j)     = -lse(flex_attention(q, k, ., score_mod=+b^t_j))

and ``out = flex_attention(q, k, v, score_mod=+b^k_j)``: DNAS is two calls, Sinkhorn-k ``2k``, HNAS adds
the softmax call. Gradients flow through the returned log-sum-exps and the captured potentials (autograd
of FlexAttention), so this is the straightforward way to write these mechanisms with FlexAttention, not a
fused kernel. No masks: the benchmark's inputs are unpadded.
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional, Union

import torch
from torch import Tensor

__all__ = ["flex_potentials", "flex_call", "CALL_SITES"]

# The calls of one forward: the first column pass, the later ones (score_mod + a^{t-1}), the row passes
# (score_mod + b^t), the output (score_mod + b^k) and HNAS's softmax half.
CALL_SITES = ("columns", "columns_after", "rows", "output", "softmax")


def flex_potentials(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    iters: int,
    scale: Optional[float] = None,
    u: Optional[float] = None,
    flex: Optional[Union[Callable, Mapping[str, Callable]]] = None,
) -> Tensor:
    """Output ``(B, H, Lq, Dv)`` of DNAS (``iters=1``), Sinkhorn (``iters=k``) or, with ``u``, HNAS.

    ``flex``: the ``flex_attention`` to call (``torch.compile(flex_attention)`` for speed; the eager
    function by default), or one per call site, keyed by :data:`CALL_SITES` (what :func:`flex_call` passes).
    """
    if iters < 1:
        raise ValueError(f"iters={iters}; expected >= 1 (softmax is flex_attention itself)")
    if flex is None:
        from torch.nn.attention.flex_attention import flex_attention as flex
    from torch.nn.attention.flex_attention import AuxRequest

    # return_aux, not the deprecated return_lse, whose warning-once check made every compiled call site
    # compile twice (the first call's graph is guarded on the warning not having been shown yet)
    lse_only = AuxRequest(lse=True)
    sites = flex if isinstance(flex, Mapping) else dict.fromkeys(CALL_SITES, flex)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    a = None  # (B, H, Lq): a^{t-1}, None for a^0 = 0
    b = None
    for t in range(1, iters + 1):
        if a is None:
            _, aux = sites["columns"](k, q, q, scale=scale, return_aux=lse_only)
            lse = aux.lse  # (B, H, Lk): LSE_i s_ij
        else:
            a_prev = a

            def add_row(score, bi, h, j, i, a_prev=a_prev):  # transposed call: its "query" index is j
                return score + a_prev[bi, h, i]

            _, aux = sites["columns_after"](k, q, q, score_mod=add_row, scale=scale, return_aux=lse_only)
            lse = aux.lse
        b = -lse.float()  # (B, H, Lk)
        if t < iters:
            b_t = b

            def add_col(score, bi, h, i, j, b_t=b_t):
                return score + b_t[bi, h, j]

            _, aux = sites["rows"](q, k, k, score_mod=add_col, scale=scale, return_aux=lse_only)
            a = -aux.lse.float()  # (B, H, Lq)

    def add_b(score, bi, h, i, j):
        return score + b[bi, h, j]

    out = sites["output"](q, k, v, score_mod=add_b, scale=scale)  # (B, H, Lq, Dv)
    if u is None:
        return out
    return u * out + (1 - u) * sites["softmax"](q, k, v, scale=scale)


def _site_function(site: str) -> Callable:
    """``flex_attention`` behind a function of its own: torch.compile keeps one cache per code object, so
    wrappers that shared one (``torch.compile(flex_attention)`` per site) would still share their graphs."""
    from torch.nn.attention.flex_attention import flex_attention

    namespace = {"flex_attention": flex_attention}
    exec(f"def flex_{site}(*args, **kwargs):\n    return flex_attention(*args, **kwargs)\n", namespace)
    return namespace[f"flex_{site}"]


def flex_call(mechanism: str, sinkhorn_iters: int, compiled: bool = True) -> Callable:
    """``f(q, k, v) -> out`` for ``attnkit bench``: softmax, dnas, hnas or sinkhorn with FlexAttention."""
    from torch.nn.attention.flex_attention import flex_attention

    def build(site: str = "softmax"):
        return torch.compile(_site_function(site), dynamic=False) if compiled else flex_attention

    if mechanism == "softmax":
        flex = build()
        return lambda q, k, v: flex(q, k, v)
    if mechanism not in ("dnas", "hnas", "sinkhorn"):
        raise ValueError(
            f"mechanism {mechanism!r} has no FlexAttention form here; expected softmax/dnas/hnas/sinkhorn"
        )
    iters = sinkhorn_iters if mechanism == "sinkhorn" else 1
    u = 0.5 if mechanism == "hnas" else None
    # one compiled function (code object) per call site: each site always gets the same kind of score_mod
    # (none, or a closure over one potential), so no call recompiles another's graph (one compiled function
    # for all sites recompiled on every switch, and torch 2.11 and 2.13 crash while logging why:
    # AttributeError "'NoneType' object has no attribute '__closure__'", seen on an H100)
    sites = {site: build(site) for site in CALL_SITES}
    return lambda q, k, v: flex_potentials(q, k, v, iters=iters, u=u, flex=sites)
