"""Compositional de-attention (CoDA) quasi-attention.

"Compositional De-Attention Networks", eqs. (1)-(6) and (10); docs/design.md section 3:

    E_ij = alpha * q_i . k_j / sqrt(D)                  (affinity)
    N_ij = -beta * ||q_i - k_j||_1 / sqrt(D)            (negative L1 distance)
    M    = f_E(E) * g(N)                                 (no softmax, no normalization)

with ``f_E = tanh`` and the gate ``g`` one of: plain ``f_N(N)`` (``"sigmoid"``), ``2 f_N(N)``
(``"scaled"``, eq. 5, default) or ``f_N(N - mean N)`` (``"centered"``, eq. 4); ``center_e``
uses ``E - mean E`` (eq. 6). Means run over the valid entries of each (batch, head) matrix.

Masks are multiplicative: ``M_ij = 0`` on invalid pairs (an additive ``-inf`` would give
``tanh(-inf) = -1``). Invariant with the default activations: ``M in [-1, 1]``.

The centered variants take means over every valid pair of the matrix, so under a causal mask they
would let later positions shift earlier outputs; ``ak.attention`` refuses that combination.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from ..config import CoDA
from .masked import masked_mean

__all__ = ["coda_weights", "coda_affinity", "coda_gate", "ACTIVATION_FNS"]


def _algebraic(x: Tensor) -> Tensor:
    return x * torch.rsqrt(1 + x * x)


ACTIVATION_FNS: dict[str, Callable[[Tensor], Tensor]] = {
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "arctan": torch.atan,
    "algebraic": _algebraic,
}


def coda_affinity(e: Tensor, config: CoDA) -> Tensor:
    """``f_E(E)`` of ``E`` already scaled by alpha (and centered for ``center_e``, eq. 6)."""
    return ACTIVATION_FNS[config.e_activation](e)


def coda_gate(n: Tensor, config: CoDA) -> Tensor:
    """The gate of ``N`` already scaled by beta (and centered for ``gate="centered"``, eq. 4):
    ``f_N(N)``, or ``2 f_N(N)`` for ``gate="scaled"`` (eq. 5)."""
    gate = ACTIVATION_FNS[config.n_activation](n)
    return 2 * gate if config.gate == "scaled" else gate


def coda_weights(affinity: Tensor, neg_distance: Tensor, valid: Optional[Tensor], config: CoDA) -> Tensor:
    """CoDA matrix ``M (B, H, Lq, Lk)`` from ``E = affinity`` and ``N = neg_distance`` (before alpha/beta)."""
    e = config.alpha * affinity
    n = config.beta * neg_distance
    if config.center_e:
        e = e - masked_mean(e, valid)  # eq. (6)
    if config.gate == "centered":
        n = n - masked_mean(n, valid)  # eq. (4)
    m = coda_affinity(e, config) * coda_gate(n, config)
    if valid is not None:
        m = m.masked_fill(~valid, 0.0)
    return m
