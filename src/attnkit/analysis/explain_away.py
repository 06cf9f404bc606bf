"""Explaining-away statistics of attention weights.

"Attention that does not Explain Away" (arXiv:2009.14308), section 4 (eps-explained-away keys, histogram of
weight sums);
"Doubly-Normalized Attention", Lemma 1 (Appendix B). For weights ``pi (B, H, Lq, Lk)``, key ``j``
receives the total weight ``sum_i pi_ij`` over valid queries. A key is eps-explained-away when that sum
is below ``eps``. DNAS guarantees ``sum_i pi_ij >= 1 / n_k`` for every key with a valid query.

``log_sum_histogram`` bins the log weight sums (Fig. 1 of "Attention that does not Explain Away", natural
log).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np
import torch
from torch import Tensor

from ..validators import check_int, check_number

__all__ = ["ExplainAway", "explain_away", "log_sum_histogram"]


@dataclass
class ExplainAway:
    """Per-key weight sums and their summary.

    ``key_sums (B, H, Lk)``: ``sum_i pi_ij`` over valid queries (0 for invalid keys);
    ``log_sums (B, H, Lk)``: their natural log (``-inf`` for invalid keys and sums <= 0, e.g. CoDA's signed
    M);
    ``valid_keys (B, H, Lk)``: which keys count; ``min``: smallest sum over valid keys;
    ``min_normalized``: smallest ``n_k * sum_i pi_ij`` (Lemma 1 says >= 1 for DNAS);
    ``fraction_below_eps``: share of valid keys with a sum below ``eps``. With no valid key (an empty batch,
    all padding) ``min`` and ``min_normalized`` are NaN and ``fraction_below_eps`` is 0.
    """

    key_sums: Tensor
    log_sums: Tensor
    valid_keys: Tensor
    min: float
    min_normalized: float
    fraction_below_eps: float
    eps: float


def explain_away(
    weights: Tensor,
    key_mask: Optional[Tensor] = None,
    query_mask: Optional[Tensor] = None,
    eps: float = 1e-3,
    *,
    valid: Optional[Tensor] = None,
) -> ExplainAway:
    """Explaining-away statistics of ``weights (B, H, Lq, Lk)`` (key/query masks: True = real token).

    ``valid`` (optional, bool, broadcastable to ``(B, H, Lq, Lk)``): the pairs that may attend, e.g.
    ``MaskInfo.valid``. With it, a key counts only when some valid query may attend to it (so keys
    hidden by an ``attn_mask`` padding mask are left out) and ``n_k`` counts those keys. Weights outside the
    masks are ignored whatever they hold (NaN rows of fully masked queries included); a non-finite weight
    that counts is a ``ValueError``.
    """
    if not isinstance(weights, Tensor) or weights.dim() != 4:
        got = tuple(weights.shape) if isinstance(weights, Tensor) else type(weights).__name__
        raise ValueError(f"weights must be a tensor of shape (B, H, Lq, Lk), got {got}")
    if not weights.dtype.is_floating_point:
        raise ValueError(f"weights have dtype {weights.dtype}; expected floating weights (weights.float())")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not (0 < eps < math.inf):
        raise ValueError(f"eps={eps!r}; expected a finite number > 0")
    B, H, Lq, Lk = weights.shape
    for name, m, L in (("key_mask", key_mask, Lk), ("query_mask", query_mask, Lq)):
        if m is not None and (not isinstance(m, Tensor) or m.dtype != torch.bool or tuple(m.shape) != (B, L)):
            got = (tuple(m.shape), m.dtype) if isinstance(m, Tensor) else type(m).__name__
            raise ValueError(
                f"{name} must be a bool tensor of shape ({B}, {L}) with True = real token, got "
                f"{got}"
            )
    if valid is not None:
        if not isinstance(valid, Tensor) or valid.dtype != torch.bool or valid.dim() > 4 or any(
            v not in (1, e) for v, e in zip(reversed(valid.shape), (Lk, Lq, H, B))  # aligned from the right
        ):
            got = (tuple(valid.shape), valid.dtype) if isinstance(valid, Tensor) else type(valid).__name__
            raise ValueError(
                f"valid must be a bool tensor broadcastable to (B, H, Lq, Lk) = {(B, H, Lq, Lk)}, got {got}"
            )
        valid = valid.reshape((1,) * (4 - valid.dim()) + tuple(valid.shape))  # (B|1, H|1, Lq|1, Lk|1)
    w = weights.detach().double()
    counted = torch.ones(1, 1, Lq, 1, dtype=torch.bool, device=w.device)  # (B, H, Lq, Lk) after masks
    if valid is not None:
        counted = counted & valid
    if query_mask is not None:
        counted = counted & query_mask[:, None, :, None]
    # where(), not a product: a NaN row of a fully masked query (torch's softmax) must not reach the sums
    w = torch.where(counted, w, torch.zeros_like(w))  # (B, H, Lq, Lk)
    key_sums = w.sum(dim=-2)  # (B, H, Lk)
    valid_keys = torch.full((B, H, Lk), Lq > 0, dtype=torch.bool, device=w.device)  # some query exists
    if key_mask is not None:
        valid_keys = valid_keys & key_mask[:, None, :]
    if query_mask is not None:
        valid_keys = (
            valid_keys & query_mask.any(dim=-1)[:, None, None]
        )  # keys of an all-padding row do not count
    if valid is not None:  # (B, H, Lk): some valid query (valid and query_mask both) may attend
        valid_keys = valid_keys & counted.any(dim=-2).expand(B, H, Lk)
    bad = int((~torch.isfinite(w) & valid_keys[:, :, None, :]).sum())
    if bad:
        raise ValueError(
            f"weights hold {bad} non-finite values (NaN/inf) at valid (query, key) pairs; mask padded "
            "queries and keys with query_mask/key_mask/valid, or fix the weights"
        )
    key_sums = key_sums.masked_fill(~valid_keys, 0.0)
    log_sums = torch.log(key_sums.clamp_min(0.0)).masked_fill(
        ~valid_keys, float("-inf")
    )  # CoDA sums can be < 0
    n_k = valid_keys.sum(dim=-1, keepdim=True).clamp_min(1)  # (B, H, 1)
    if valid_keys.any():
        sums = key_sums[valid_keys]
        min_sum = sums.min().item()
        min_normalized = (key_sums * n_k)[valid_keys].min().item()
        fraction = (sums < eps).double().mean().item()
    else:
        min_sum, min_normalized, fraction = float("nan"), float("nan"), 0.0
    return ExplainAway(
        key_sums=key_sums.to(weights.dtype),
        log_sums=log_sums.to(weights.dtype),
        valid_keys=valid_keys,
        min=min_sum,
        min_normalized=min_normalized,
        fraction_below_eps=fraction,
        eps=float(eps),
    )


def log_sum_histogram(
    stats: Union[ExplainAway, Sequence[ExplainAway]],
    bins: int = 40,
    range: Optional[tuple[float, float]] = None,
    floor: float = -50.0,
) -> tuple[np.ndarray, np.ndarray]:
    """Histogram of ``log sum_i pi_ij`` over the valid keys of one or several :class:`ExplainAway`.

    Sums of 0 (log = -inf, as :func:`explain_away` gives for sums <= 0) are put at ``floor`` so that they stay
    visible; every finite log is binned where it is, below ``floor`` too. By default the bins span all the
    values; with an explicit ``range`` the values outside it are not counted, as in ``numpy.histogram``.
    Returns ``(counts (bins,), edges (bins + 1,))`` as ``numpy.histogram`` does.
    """
    items = [stats] if isinstance(stats, ExplainAway) else list(stats)
    if not items or not all(isinstance(item, ExplainAway) for item in items):
        raise ValueError("stats must be an ExplainAway or a non-empty sequence of them (from explain_away)")
    bins = check_int(bins, f"bins={bins!r}", "expected an integer >= 1", low=1)
    floor = check_number(floor, f"floor={floor!r}", "expected a finite number (the log put for sums of 0)")
    values = np.concatenate([item.log_sums[item.valid_keys].double().cpu().numpy() for item in items])
    values = np.where(np.isneginf(values), floor, values)  # only the sums of 0 (log -inf)
    if range is None:
        range = (float(values.min()), float(values.max())) if values.size else (floor, 0.0)
        if range[0] == range[1]:
            range = (range[0] - 0.5, range[1] + 0.5)
    return np.histogram(values, bins=bins, range=range)
