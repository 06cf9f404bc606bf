"""Naive versions of DNAS, HNAS and Sinkhorn-k: the peers ``attnkit bench`` times beside the kernels.

Each materializes the ``(B, H, Lq, Lk)`` matrix and leaves the backward pass to autograd, which is how a
user writes these mechanisms without attnkit:

- DNAS ("Attention that does not Explain Away", arXiv:2009.14308, section 3.1), in three lines: a softmax
  over the queries of each key (column), then each row divided by its sum;
- Sinkhorn-k written as Sinkformers' loop is ("Sinkformers: Transformers with Doubly Stochastic
  Attention", arXiv:2110.11773): alternating normalizations of the log-domain matrix (``log W -
  logsumexp``), here ``k`` rounds of column then row, attnkit's order (Sinkformers start with a row);
- HNAS (arXiv:2009.14308, section 5): ``u * out_DNAS + (1 - u) * out_softmax``, both outputs computed.

They compute the same values as attnkit's reference backend (``ak.attention(..., backend="reference")``)
for unmasked inputs, which is all the benchmark passes; they take no masks.
"""

from __future__ import annotations

from typing import Callable, Optional

from torch import Tensor

__all__ = ["naive_dnas", "naive_sinkhorn", "naive_hnas", "naive_call", "NAIVE_MECHANISMS"]

NAIVE_MECHANISMS = ("dnas", "hnas", "sinkhorn")


def _scores(q: Tensor, k: Tensor, scale: Optional[float]) -> Tensor:
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return (q @ k.transpose(-1, -2)) * scale  # (B, H, Lq, Lk)


def naive_dnas(q: Tensor, k: Tensor, v: Tensor, *, scale: Optional[float] = None) -> Tensor:
    """DNAS output ``(B, H, Lq, Dv)``: column softmax, then row normalization, of the materialized scores."""
    w = _scores(q, k, scale).softmax(dim=-2)  # (B, H, Lq, Lk), columns sum to 1
    w = w / w.sum(dim=-1, keepdim=True)  # rows sum to 1
    return w @ v  # (B, H, Lq, Dv)


def naive_sinkhorn(q: Tensor, k: Tensor, v: Tensor, *, iters: int, scale: Optional[float] = None) -> Tensor:
    """Sinkhorn-k output ``(B, H, Lq, Dv)``: ``iters`` rounds of column then row normalization."""
    if iters < 1:
        raise ValueError(f"iters={iters}; expected >= 1 (0 rounds is softmax)")
    log_w = _scores(q, k, scale)  # (B, H, Lq, Lk)
    for _ in range(iters):
        log_w = log_w - log_w.logsumexp(dim=-2, keepdim=True)  # columns
        log_w = log_w - log_w.logsumexp(dim=-1, keepdim=True)  # rows
    return log_w.exp() @ v  # (B, H, Lq, Dv)


def naive_hnas(q: Tensor, k: Tensor, v: Tensor, *, u: float = 0.5, scale: Optional[float] = None) -> Tensor:
    """HNAS output ``(B, H, Lq, Dv)``: ``u * DNAS + (1 - u) * softmax`` of the same scores."""
    s = _scores(q, k, scale)  # (B, H, Lq, Lk)
    w = s.softmax(dim=-2)
    dnas = (w / w.sum(dim=-1, keepdim=True)) @ v  # (B, H, Lq, Dv)
    return u * dnas + (1 - u) * (s.softmax(dim=-1) @ v)


def naive_call(mechanism: str, sinkhorn_iters: int, u: float = 0.5) -> Callable:
    """``f(q, k, v) -> out`` for ``attnkit bench``: the naive peer of dnas, hnas or sinkhorn."""
    if mechanism == "dnas":
        return naive_dnas
    if mechanism == "hnas":
        return lambda q, k, v: naive_hnas(q, k, v, u=u)
    if mechanism == "sinkhorn":
        return lambda q, k, v: naive_sinkhorn(q, k, v, iters=sinkhorn_iters)
    raise ValueError(f"mechanism {mechanism!r} has no naive peer; expected one of {NAIVE_MECHANISMS}")
