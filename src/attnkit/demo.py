"""A side-by-side look at every mechanism on one padded batch.

The same queries and keys go through softmax, DNAS, HNAS, Sinkhorn and CoDA; for each, the weights of one
head and the explaining-away numbers of the papers: per-key weight sums ``sum_i pi_ij`` over real queries,
their minimum, ``min n_k*sum`` = ``min_j n_k sum_i pi_ij`` over every sequence's keys, each sum times its
sequence's key count (Lemma 1 says >= 1 for DNAS; not ``n_k`` times the minimum), and the share of keys
with a sum below ``eps``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .analysis.explain_away import explain_away
from .config import CoDA, Hybrid, Sinkhorn
from .registry import MECHANISMS, resolve_mechanism
from .functional import attention
from .validators import check_seed

__all__ = ["MechanismSummary", "padded_batch", "side_by_side"]


@dataclass
class MechanismSummary:
    mechanism: str
    weights: Tensor  # (Lq, Lk) of the shown sequence and head, real tokens only
    row_sums_min: float
    row_sums_max: float
    min_key_sum: float
    min_normalized: float
    fraction_below_eps: float
    output_norm: float


def padded_batch(
    seed: int = 0, lengths: tuple[int, ...] = (8, 5), heads: int = 2, dim: int = 16, sharpness: float = 2.0
):
    """Attention inputs ``q, k, v (B, H, L, D)`` for sequences of ``lengths``, right-padded, with their mask
    ``(B, L)``.

    Every query leans towards one shared direction that key 0 carries strongly, so softmax piles the weight
    of all queries on key 0 and leaves the other keys nearly unattended (the explaining-away regime).
    """
    if not lengths or min(lengths) < 1:
        raise ValueError(f"lengths={lengths!r}; expected one or more sequence lengths >= 1")
    g = torch.Generator().manual_seed(check_seed(seed, high=2**64 - 1))  # torch's limit: only torch is seeded
    B, L = len(lengths), max(lengths)
    direction = torch.randn(dim, generator=g)
    direction = direction / direction.norm() * dim**0.5  # (D,)
    q = torch.randn(B, heads, L, dim, generator=g) + sharpness * direction
    k = torch.randn(B, heads, L, dim, generator=g)
    k[:, :, 0] += sharpness * direction  # key 0 of each sequence explains every query
    v = torch.randn(B, heads, L, dim, generator=g)
    mask = torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]  # (B, L) True = real
    return q, k, v, mask


def side_by_side(
    seed: int = 0,
    lengths: tuple[int, ...] = (8, 5),
    mechanisms: tuple = MECHANISMS,
    eps: float = 1e-3,
    show: tuple[int, int] = (1, 0),
) -> list[MechanismSummary]:
    """Run every mechanism on one padded batch (queries and keys share lengths); summarize weights and
    explaining away.

    ``show = (b, h)`` picks the sequence and head whose weights are returned (real tokens only).
    """
    q, k, v, mask = padded_batch(seed, lengths)
    b, h = show
    n = int(mask[b].sum())
    summaries = []
    for mech in mechanisms:
        config = resolve_mechanism(mech)
        out, w = attention(
            q, k, v, config, key_mask=mask, query_mask=mask, return_weights=True, backend="reference"
        )
        stats = explain_away(w, key_mask=mask, query_mask=mask, eps=eps)
        real_rows = w.sum(-1)[mask[:, None, :].expand(-1, w.shape[1], -1)]  # row sums of real queries
        summaries.append(
            MechanismSummary(
                mechanism=_label(config),
                weights=w[b, h, :n, :n].detach(),
                row_sums_min=real_rows.min().item(),
                row_sums_max=real_rows.max().item(),
                min_key_sum=stats.min,
                min_normalized=stats.min_normalized,
                fraction_below_eps=stats.fraction_below_eps,
                output_norm=out[mask[:, None, :].expand(-1, out.shape[1], -1)].norm().item(),
            )
        )
    return summaries


def _label(config) -> str:
    if isinstance(config, Sinkhorn):
        return f"sinkhorn(k={config.iters})"
    if isinstance(config, Hybrid):
        return f"hnas(u={config.u0:g})"
    if isinstance(config, CoDA):
        return f"coda({config.gate})"
    return config.name
