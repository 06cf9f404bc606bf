"""Mode collapse under repeated self-attention.

"Doubly-Normalized Attention", section 5.2 and Appendix C, eqs. (11)/(13) and (12)/(14);
"Attention that does not Explain Away" (arXiv:2009.14308), Appendix E (the 2-D example). Two clusters of
``N0`` points at
``+a`` and ``N1`` points at ``-a`` (``r = N0 / N1``) attend to each other with Gaussian-kernel scores
``s_ij = -||x_i - x_j||^2 / 2``; intra-cluster weights are ``t = 1`` and inter-cluster ones
``s = exp(-2 a^2)``. After one step the distance between the two centers is

    LNAS:  2 r (1 - s^2) a / ((1 + r s) (r + s))                          (11)/(13)
    DNAS:  2 q r (1 - s^2) a / ((q + r s) (r + s q)),  q = (r + s) / (r s + 1)   (12)/(14)

DNAS upper-bounds LNAS for ``r != 1``; both agree at ``r = 1``. The simulator applies ``T`` steps of
self-attention (values = keys = queries = the points) under any attnkit mechanism, in any dimension.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np
import torch
from torch import Tensor

from ..config import MechanismLike
from ..registry import resolve_mechanism
from ..functional import normalize
from ..validators import check_number, check_seed

__all__ = [
    "center_distance_lnas",
    "center_distance_dnas",
    "SCORE_KINDS",
    "self_attention_scores",
    "simulate_self_attention",
    "two_clusters",
    "count_clusters",
    "ClusterCounts",
]

SCORE_KINDS: tuple[str, ...] = ("gaussian", "dot")

ArrayLike = Union[float, Sequence[float], np.ndarray]


def _check_r_a(r: ArrayLike, a: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    for name, value in (("r", r), ("a", a)):
        if np.asarray(value).dtype == np.bool_:
            raise ValueError(f"{name}={value!r}: expected numbers, not booleans")
    r_arr = np.asarray(r, dtype=np.float64)
    a_arr = np.asarray(a, dtype=np.float64)
    if not np.all(np.isfinite(r_arr)) or np.any(r_arr <= 0):
        raise ValueError(f"r={r!r}: the cluster mass ratio N0/N1 must be finite and > 0")
    if not np.all(np.isfinite(a_arr)) or np.any(a_arr < 0):
        raise ValueError(f"a={a!r}: the half distance between the centers must be finite and >= 0")
    return r_arr, a_arr


def _as_output(value: np.ndarray, r: ArrayLike, a: ArrayLike) -> Union[float, np.ndarray]:
    return float(value) if np.ndim(r) == 0 and np.ndim(a) == 0 else value


def center_distance_lnas(r: ArrayLike, a: ArrayLike) -> Union[float, np.ndarray]:
    """Center distance after one LNAS (softmax) step, eq. (11)/(13); broadcasts over ``r`` and ``a``.

    Clusters of ``N0 = r N1`` points at ``+a`` and ``N1`` points at ``-a`` start ``2a`` apart.
    """
    r_arr, a_arr = _check_r_a(r, a)
    s = np.exp(-2.0 * a_arr**2)
    one_minus_s2 = -np.expm1(-4.0 * a_arr**2)  # 1 - s^2 without cancellation at small a
    # 2 r (1 - s^2) a / ((1 + r s) (r + s)), with r / (r + s) in [0, 1]: no overflow at large r
    return _as_output(2 * one_minus_s2 * a_arr * (r_arr / (r_arr + s)) / (1 + r_arr * s), r, a)


def center_distance_dnas(r: ArrayLike, a: ArrayLike) -> Union[float, np.ndarray]:
    """Center distance after one DNAS step, eq. (12)/(14), ``q = (r + s) / (r s + 1)``.

    Never below :func:`center_distance_lnas`; equal to it at ``r = 1``.
    """
    r_arr, a_arr = _check_r_a(r, a)
    s = np.exp(-2.0 * a_arr**2)
    one_minus_s2 = -np.expm1(-4.0 * a_arr**2)  # 1 - s^2 without cancellation at small a
    q = (r_arr + s) / (r_arr * s + 1)
    # 2 q r (1 - s^2) a / ((q + r s) (r + s q)) as a product of two ratios in [0, 1]: q r overflows at large r
    return _as_output(2 * one_minus_s2 * a_arr * (q / (q + r_arr * s)) * (r_arr / (r_arr + s * q)), r, a)


def _check_points(points: Tensor) -> Tensor:
    if not isinstance(points, Tensor) or points.dim() not in (1, 2) or points.shape[0] < 1:
        got = tuple(points.shape) if isinstance(points, Tensor) else type(points).__name__
        raise ValueError(f"points must be a tensor of shape (N,) or (N, d), got {got}")
    if not points.dtype.is_floating_point or not torch.isfinite(points).all():
        raise ValueError(f"points must be finite floating values, got dtype {points.dtype}")
    return points[:, None] if points.dim() == 1 else points  # (N, d)


def self_attention_scores(x: Tensor, scores: str = "gaussian") -> Tensor:
    """Scores ``(N, N)`` of points ``x (N, d)``: ``-||x_i - x_j||^2 / 2`` or the dot product ``x_i . x_j``."""
    if scores == "gaussian":
        return -0.5 * torch.cdist(x, x).pow(2)  # (N, N)
    if scores == "dot":
        return x @ x.T  # (N, N)
    raise ValueError(f"unknown scores {scores!r}; expected one of {SCORE_KINDS}")


def simulate_self_attention(
    points: Tensor,
    mechanism: MechanismLike = "softmax",
    steps: int = 1,
    *,
    scores: str = "gaussian",
    hybrid_weight: Optional[float] = None,
    scale: float = 1.0,
) -> Tensor:
    """Apply ``steps`` rounds of ``x <- pi(x) x`` with values = keys = queries = the points.

    Shapes:
        points ``(N,)`` or ``(N, d)`` -> trajectory ``(steps + 1, N, d)`` in float64 (step 0 = the input).

    ``scores``: ``"gaussian"`` (``-||x_i - x_j||^2 / 2``, Appendix C) or ``"dot"`` (``x_i . x_j``). No
    scaling and no residual connection, as in the papers' analysis. ``scale`` multiplies the scores (the
    key/query scale of a learned projection; ``1`` is the papers' setting). CoDA is not a normalization and
    is rejected.
    """
    config = resolve_mechanism(mechanism)
    if config.name == "coda":
        raise ValueError(
            "mechanism 'coda' does not normalize the weights; use softmax, dnas, hnas or "
            "sinkhorn"
        )
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps={steps!r}; expected an integer >= 0")
    if scores not in SCORE_KINDS:
        raise ValueError(f"unknown scores {scores!r}; expected one of {SCORE_KINDS}")
    if (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale)
            or scale <= 0):
        raise ValueError(f"scale={scale!r}; expected a finite number > 0 (1 is the papers' setting)")
    x = _check_points(points).to(torch.float64)  # (N, d)
    trajectory = [x]
    for _ in range(steps):
        s = scale * self_attention_scores(x, scores)[None, None]  # (1, 1, N, N)
        w = normalize(s, config, hybrid_weight=hybrid_weight)[0, 0]  # (N, N)
        x = w @ x  # (N, d)
        trajectory.append(x)
    return torch.stack(trajectory)  # (steps + 1, N, d)


def two_clusters(
    n0: int,
    n1: int,
    center0: Sequence[float],
    center1: Sequence[float],
    std: float = 0.0,
    seed: int = 0,
) -> Tensor:
    """``n0`` points around ``center0`` then ``n1`` around ``center1`` (isotropic Gaussian, ``std``); ``(N,
    d)``.

    ``std = 0`` gives exactly separated clusters (every point on its center), the setting of eqs. (11)-(14).
    ``seed``: an integer in ``[0, 2**32 - 1]``.
    """
    for name, n in (("n0", n0), ("n1", n1)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name}={n!r}; expected an integer >= 1")
    c0 = torch.as_tensor(center0, dtype=torch.float64).reshape(-1)
    c1 = torch.as_tensor(center1, dtype=torch.float64).reshape(-1)
    if c0.shape != c1.shape:
        raise ValueError(
            f"center0 has {c0.numel()} coordinates and center1 {c1.numel()}; give both the "
            "same dimension"
        )
    for name, c, given in (("center0", c0, center0), ("center1", c1, center1)):
        if c.numel() < 1 or not torch.isfinite(c).all():
            raise ValueError(f"{name}={given!r}; expected at least one coordinate, all finite")
    check_number(std, f"std={std!r}", "expected a finite number >= 0", low=0, sep="; ")
    seed = check_seed(seed)  # a Python int (manual_seed refuses NumPy integers)
    g = torch.Generator().manual_seed(seed)
    d = c0.numel()
    x0 = c0 + std * torch.randn(n0, d, generator=g, dtype=torch.float64)  # (n0, d)
    x1 = c1 + std * torch.randn(n1, d, generator=g, dtype=torch.float64)  # (n1, d)
    return torch.cat([x0, x1])  # (N, d)


@dataclass(frozen=True)
class ClusterCounts:
    """Result of :func:`count_clusters`: ``count`` clusters holding at least ``min_size`` points each,
    ``sizes`` of every connected component (largest first), the ``gap`` and ``min_size`` used."""

    count: int
    sizes: tuple[int, ...]
    gap: float
    min_size: int


def count_clusters(points: Tensor, gap: float = 0.5, min_fraction: float = 0.02) -> ClusterCounts:
    """Count clusters by a gap rule (single linkage).

    Rule: two points belong to the same cluster when a chain of points joins them in which every step
    is shorter than ``gap``; a connected component counts as a cluster when it holds at least
    ``min_fraction`` of the points (at least one point), so isolated stragglers are not clusters.
    """
    x = _check_points(points).to(torch.float64)  # (N, d)
    check_number(gap, f"gap={gap!r}", "expected a finite distance > 0", low=0, low_open=True, sep="; ")
    check_number(min_fraction, f"min_fraction={min_fraction!r}", "expected a number in [0, 1]", low=0, high=1,
                 sep="; ")
    N = x.shape[0]
    linked = torch.cdist(x, x) < gap  # (N, N)
    labels = torch.arange(N)
    while True:  # propagate the smallest label through the links until nothing changes
        neighbours = torch.where(linked, labels[None, :], N).min(dim=1).values  # (N,)
        new = torch.minimum(labels, neighbours)
        new = new[new]  # pointer jumping: converges in O(log N) rounds on chains
        if torch.equal(new, labels):
            break
        labels = new
    sizes = torch.unique(labels, return_counts=True)[1].sort(descending=True).values
    # the tolerance keeps 7 of 100 points at min_fraction 0.07 a cluster (0.07 * 100 = 7.000000000000001)
    min_size = max(1, int(np.ceil(min_fraction * N - 1e-9)))
    return ClusterCounts(
        count=int((sizes >= min_size).sum()),
        sizes=tuple(int(s) for s in sizes),
        gap=float(gap),
        min_size=min_size,
    )
