"""Compositional de-attention (CoDA) quasi-attention.

"Compositional De-Attention Networks", eqs. (1)-(6) and (10); docs/design.md section 3:

    E_ij = alpha * q_i . k_j / sqrt(D)                  (affinity)
    N_ij = -beta * ||q_i - k_j||_1 / sqrt(D)            (negative L1 distance)
    M    = f_E(E) * g(N)                                 (no softmax, no normalization)

with ``f_E = tanh`` and the gate ``g`` one of: plain ``f_N(N)`` (``"sigmoid"``), ``2 f_N(N)``
(``"scaled"``, eq. 5, default) or ``f_N(N - mean N)`` (``"centered"``, eq. 4); ``center_e``
uses ``E - mean E`` (eq. 6). Means run over the valid entries of each (batch, head) matrix. An ``N`` of
``-inf`` gives gate 0 (the entry is exactly 0) for every gate; the centered gate's mean leaves it out.

The gate ``f_N`` is the activation mapped onto [0, 1] (``GATE_FNS``): ``(f(x) - inf f) / (sup f - inf f)``.
Section 2.3 calls ``sigmoid(N)`` a gate that "erases" dissimilar pairs, and Table 9 swaps tanh, arctan
and the algebraic sigmoid in for it; taken literally on ``N <= 0`` those give values in ``(-1, 0]`` (or
``(-pi/2, 0]``) that flip the sign of ``tanh(E)`` (a negation, not a gate). Mapped onto [0, 1] they keep
the gate's meaning: sigmoid is unchanged, tanh becomes ``(1 + tanh x) / 2 = sigmoid(2x)``, arctan
``1/2 + arctan(x) / pi``, algebraic ``(1 + x / sqrt(1 + x^2)) / 2``. ``f_E`` is used as is (the add /
subtract / delete factor may be negative).

Masks are multiplicative: ``M_ij = 0`` on invalid pairs (an additive ``-inf`` would give
``tanh(-inf) = -1``). Invariant with the default activations: ``M in [-1, 1]``.

The centered variants take means over every valid pair of the matrix, so under a causal mask they
would let later positions shift earlier outputs; ``ak.attention`` refuses that combination.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch import Tensor

from ..config import CoDA
from .masked import masked_mean

__all__ = ["coda_weights", "coda_affinity", "coda_gate", "ACTIVATION_FNS", "ACTIVATION_RANGES", "GATE_FNS"]


def _algebraic(x: Tensor) -> Tensor:
    return x * torch.rsqrt(1 + x * x)


ACTIVATION_FNS: dict[str, Callable[[Tensor], Tensor]] = {
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "arctan": torch.atan,
    "algebraic": _algebraic,
}


ACTIVATION_RANGES: dict[str, tuple[float, float]] = {
    "tanh": (-1.0, 1.0),
    "sigmoid": (0.0, 1.0),
    "arctan": (-math.pi / 2, math.pi / 2),
    "algebraic": (-1.0, 1.0),
}


def _unit_gate(name: str) -> Callable[[Tensor], Tensor]:
    fn = ACTIVATION_FNS[name]
    lo, hi = ACTIVATION_RANGES[name]
    if (lo, hi) == (0.0, 1.0):
        return fn
    return lambda x: (fn(x) - lo) * (1.0 / (hi - lo))


# The gate activations, each mapped onto [0, 1] (see the module docstring).
GATE_FNS: dict[str, Callable[[Tensor], Tensor]] = {name: _unit_gate(name) for name in ACTIVATION_FNS}


def coda_affinity(e: Tensor, config: CoDA) -> Tensor:
    """``f_E(E)`` of ``E`` already scaled by alpha (and centered for ``center_e``, eq. 6)."""
    return ACTIVATION_FNS[config.e_activation](e)


def coda_gate(n: Tensor, config: CoDA) -> Tensor:
    """The gate of ``N`` already scaled by beta (and centered for ``gate="centered"``, eq. 4):
    ``f_N(N)``, or ``2 f_N(N)`` for ``gate="scaled"`` (eq. 5)."""
    gate = GATE_FNS[config.n_activation](n)  # mapped onto [0, 1]
    return 2 * gate if config.gate == "scaled" else gate


def coda_weights(affinity: Tensor, neg_distance: Tensor, valid: Optional[Tensor], config: CoDA) -> Tensor:
    """CoDA matrix ``M (B, H, Lq, Lk)`` from ``E = affinity`` and ``N = neg_distance`` (before alpha/beta)."""
    e = config.alpha * affinity
    n = config.beta * neg_distance
    if config.center_e:
        e = e - masked_mean(e, valid)  # eq. (6)
    if config.gate == "centered":
        # eq. (4); an N of -inf (a pair infinitely far apart) keeps gate 0 as with the other gates, and the
        # mean runs over the finite N, so that it stays finite
        finite = ~torch.isneginf(n)  # (B, H, Lq, Lk)
        inside = finite if valid is None else valid & finite
        n = n - masked_mean(n.masked_fill(~finite, 0.0), inside)
    m = coda_affinity(e, config) * coda_gate(n, config)
    if valid is not None:
        m = m.masked_fill(~valid, 0.0)
    return m
