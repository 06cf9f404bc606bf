r"""Bidirectional CoDA cross-attention between two sequences ("Compositional De-Attention Networks",
Tay et al., NeurIPS 2019, eqs. 1-2 and 7-9).

.. math::
    E_{ij} = \alpha\, F_E(a_i)^\top F_E(b_j) / \sqrt{D}, \qquad
    N_{ij} = -\beta\, \lVert F_N(a_i) - F_N(b_j) \rVert_1 / \sqrt{D}, \qquad
    M = \tanh(E) \odot \operatorname{gate}(N)

    A' = M B, \qquad B' = M^\top A \qquad (7), \qquad
    F = [\,F(A', A);\ F(B', B)\,] \qquad (9)

``F_E`` and ``F_N`` are linear maps (the paper's "parameterized functions"). Eqs. 1-2 have no
``1 / sqrt(D)``; it is the scaling of eq. 10 (CoDA in the Transformer), applied here too:
``CoDA(alpha=sqrt(D), beta=sqrt(D))`` gives eqs. 1-2 exactly. ``M`` comes from
``attnkit.normalize(E, CoDA(...), gate_scores=N)``, so every CoDA option (gate, centering, Table 9
activations) applies. Each element of ``A`` adds (+1), subtracts (-1) or deletes (x0) the elements of
``B`` and vice versa. :class:`CoDACrossAttention` returns ``A'`` and ``B'``; :class:`AlignCompose` is the
composition ``F(X', X)`` (an MLP on ``[X'; X]`` per position, masked sum-pooled), as in the
decomposable-attention models the paper builds on.

For comparison, ``mechanism="softmax"`` gives decomposable attention (Parikh et al., 2016):
``A' = softmax_j(E) B`` and ``B' = softmax_i(E)^T A``; ``"none"`` gives uniform weights (mean pooling).
"""

from __future__ import annotations

import numbers

import math
from typing import Optional

import torch
from torch import Tensor, nn

from ..config import CoDA
from ..functional import normalize
from ..scores import neg_l1_distance
from ..validators import NotScriptable
from .module_utils import check_like_parameters, check_same_device_dtype, reset_submodules

__all__ = ["CoDACrossAttention", "AlignCompose", "CROSS_MECHANISMS"]

CROSS_MECHANISMS: tuple[str, ...] = ("coda", "softmax", "none")


def _check_pair(a: Tensor, b: Tensor, a_mask: Optional[Tensor], b_mask: Optional[Tensor], d: int):
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[-1] != d or b.shape[-1] != d:
        raise ValueError(f"a {tuple(a.shape)} and b {tuple(b.shape)} must be (B, La, {d}) and (B, Lb, {d})")
    B, La, Lb = a.shape[0], a.shape[1], b.shape[1]
    a_mask = torch.ones(B, La, dtype=torch.bool, device=a.device) if a_mask is None else a_mask
    b_mask = torch.ones(B, Lb, dtype=torch.bool, device=b.device) if b_mask is None else b_mask
    if (
        a_mask.shape != (B, La)
        or b_mask.shape != (B, Lb)
        or a_mask.dtype != torch.bool
        or b_mask.dtype != torch.bool
    ):
        raise ValueError(
            f"a_mask and b_mask must be bool (B, La) = {(B, La)} and (B, Lb) = {(B, Lb)}; True = real"
        )
    for name, mask, x in (("a_mask", a_mask, a), ("b_mask", b_mask, b)):
        if mask.device != x.device:
            raise ValueError(f"{name} is on {mask.device} but {name[0]} is on {x.device}; move it with "
                             f".to({str(x.device)!r})")
    return a_mask, b_mask


class CoDACrossAttention(NotScriptable, nn.Module):
    """``A', B' = CoDA(A, B)`` (eqs. 7-8). Shapes: ``a (B, La, d)``, ``b (B, Lb, d)``, masks bool True = real.

    Returns ``(a_prime (B, La, d), b_prime (B, Lb, d), m (B, La, Lb))``; rows and columns of padding are 0.
    """

    def __init__(
        self,
        d_model: int,
        proj_dim: Optional[int] = None,
        mechanism: str = "coda",
        config: Optional[CoDA] = None,
    ) -> None:
        super().__init__()
        if isinstance(d_model, bool) or not isinstance(d_model, int) or d_model < 1:
            raise ValueError(f"d_model={d_model!r}; expected an integer >= 1")
        if mechanism not in CROSS_MECHANISMS:
            raise ValueError(f"mechanism={mechanism!r}; expected one of {CROSS_MECHANISMS}")
        if config is not None and not isinstance(config, CoDA):
            raise ValueError(f"config must be an ak.CoDA(...) config, got {type(config).__name__}")
        if config is not None and mechanism != "coda":
            raise ValueError(
                f"config={config!r} only applies to mechanism='coda', but mechanism={mechanism!r} wins and "
                "would ignore it; drop config, or pass mechanism='coda'"
            )
        proj_dim = d_model if proj_dim is None else proj_dim
        if isinstance(proj_dim, bool) or not isinstance(proj_dim, numbers.Integral) or proj_dim < 1:
            raise ValueError(f"proj_dim={proj_dim!r}; expected an integer >= 1 (or None for d_model)")
        proj_dim = int(proj_dim)
        self.d_model, self.mechanism = d_model, mechanism
        self.config = CoDA() if config is None else config
        self.f_e = nn.Linear(d_model, proj_dim)
        self.f_n = nn.Linear(d_model, proj_dim) if mechanism == "coda" else None

    def reset_parameters(self) -> None:
        """The projections' own (``nn.Linear``) initialization, as at construction."""
        reset_submodules(self)

    def weights(self, a: Tensor, b: Tensor, a_mask: Tensor, b_mask: Tensor) -> tuple[Tensor, Tensor]:
        """Weights for ``A' = W_a B`` and ``B' = W_b^T A``: both ``(B, La, Lb)`` (the same ``M`` for CoDA)."""
        valid = a_mask[:, :, None] & b_mask[:, None, :]  # (B, La, Lb)
        if self.mechanism == "none":
            w = valid.to(a.dtype)
            return (w / w.sum(-1, keepdim=True).clamp_min(1), w / w.sum(-2, keepdim=True).clamp_min(1))
        ea, eb = self.f_e(a), self.f_e(b)  # (B, La, D), (B, Lb, D)
        e = (ea @ eb.transpose(-1, -2) / math.sqrt(ea.shape[-1]))[:, None]  # (B, 1, La, Lb)
        if self.mechanism == "softmax":  # decomposable attention: rows for A', columns for B'
            rows = normalize(e, "softmax", key_mask=b_mask, query_mask=a_mask)[:, 0]  # (B, La, Lb)
            cols = normalize(e.transpose(-1, -2), "softmax", key_mask=a_mask, query_mask=b_mask)[
                :, 0
            ]  # (B, Lb, La)
            return rows, cols.transpose(-1, -2)
        n = neg_l1_distance(self.f_n(a)[:, None], self.f_n(b)[:, None])  # (B, 1, La, Lb)
        m = normalize(e, self.config, key_mask=b_mask, query_mask=a_mask, gate_scores=n)[:, 0]  # (B, La, Lb)
        m = m * valid  # a fully padded row of A stays 0 on every path
        return m, m

    def forward(self, a: Tensor, b: Tensor, a_mask: Optional[Tensor] = None, b_mask: Optional[Tensor] = None):
        a_mask, b_mask = _check_pair(a, b, a_mask, b_mask, self.d_model)
        check_same_device_dtype(a, "a", b, "b")
        if self.mechanism != "none":
            check_like_parameters(a, self.f_e.weight, "a and b", type(self).__name__, plural=True)
        # padded positions are zeros from here on: whatever they hold (even NaN or inf) never matters
        a = torch.where(a_mask[..., None], a, torch.zeros_like(a))
        b = torch.where(b_mask[..., None], b, torch.zeros_like(b))
        w_a, w_b = self.weights(a, b, a_mask, b_mask)
        a_prime = w_a @ b  # (B, La, d)   eq. (7): A' = M B
        b_prime = w_b.transpose(-1, -2) @ a  # (B, Lb, d)   eq. (7): B' = M^T A
        return a_prime * a_mask[..., None], b_prime * b_mask[..., None], w_a


class AlignCompose(nn.Module):
    """``F(X', X)`` of eq. 9: ``sum_{real i} MLP([x'_i; x_i])`` -> ``(B, hidden)``; ``x_prime``, ``x``
    ``(B, L, d_model)``, ``mask`` bool ``(B, L)``, True = real."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        for name, value in (("d_model", d_model), ("hidden", hidden)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"AlignCompose({name}={value!r}); expected an integer >= 1")
        self.d_model = int(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(2 * d_model, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU()
        )

    def reset_parameters(self) -> None:
        """The MLP's own (``nn.Linear``) initialization, as at construction."""
        reset_submodules(self)

    def forward(self, x_prime: Tensor, x: Tensor, mask: Tensor) -> Tensor:
        if x.dim() != 3 or x.shape[-1] != self.d_model or x_prime.shape != x.shape:
            raise ValueError(
                f"x_prime {tuple(x_prime.shape)} and x {tuple(x.shape)} must both be (B, L, {self.d_model})"
            )
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.shape != x.shape[:2]:
            got = f"{mask.dtype} {tuple(mask.shape)}" if isinstance(mask, Tensor) else type(mask).__name__
            raise ValueError(f"mask is {got}; expected bool (B, L) = {tuple(x.shape[:2])}, True = real")
        keep = mask[..., None]  # (B, L, 1): padded positions enter the MLP as zeros (a NaN there made the
        # weight gradients NaN through 0 * NaN, though its output was dropped)
        pair = torch.cat([x_prime, x], dim=-1)
        h = self.mlp(torch.where(keep, pair, torch.zeros_like(pair)))  # (B, L, hidden)
        return torch.where(keep, h, torch.zeros_like(h)).sum(1)  # (B, hidden)
