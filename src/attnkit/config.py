"""Configuration objects for the attention mechanisms.

Each mechanism of docs/design.md sections 2-3 has a small frozen dataclass, validated in ``__post_init__``.
The registry (``attnkit.registry``) maps names and aliases to these classes; ``resolve_mechanism`` there
turns a name (``"dnas"``) or a config object into a config object, so every public entry point accepts both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from .validators import check_bool, check_choice, check_int, check_number

__all__ = [
    "ACTIVATIONS",
    "GATES",
    "Softmax",
    "DNAS",
    "Hybrid",
    "Sinkhorn",
    "CoDA",
    "MechanismConfig",
    "MechanismLike",
]

ACTIVATIONS: tuple[str, ...] = ("tanh", "sigmoid", "arctan", "algebraic")
GATES: tuple[str, ...] = ("sigmoid", "scaled", "centered")


@dataclass(frozen=True)
class Softmax:
    """Softmax attention (LNAS, upper-normalized): every query's weights sum to 1."""

    name = "softmax"
    query_normalized = False


@dataclass(frozen=True)
class DNAS:
    """Doubly-normalized attention: normalize over queries for each key, then over keys.

    Every key with a valid query receives a total weight of at least ``1 / n_k`` (Lemma 1).
    """

    name = "dnas"
    query_normalized = True


@dataclass(frozen=True)
class Hybrid:
    """Hybrid attention (HNAS): ``u * DNAS + (1 - u) * softmax`` with ``u in [0, 1]``.

    ``u0`` is the mixing weight used by the functional API when no ``hybrid_weight`` is passed,
    and the initial value of the learnable per-head ``u`` in modules.
    """

    u0: float = 0.5
    name = "hnas"
    query_normalized = True

    def __post_init__(self) -> None:
        u0 = check_number(
            self.u0,
            f"Hybrid(u0={self.u0!r})",
            "the hybrid weight must be a number in [0, 1]",
            low=0.0,
            high=1.0,
        )
        object.__setattr__(self, "u0", u0)  # a NumPy scalar becomes a float


@dataclass(frozen=True)
class Sinkhorn:
    """Sinkhorn attention with ``iters`` column+row normalization rounds in the log domain.

    ``iters=0`` is softmax, ``iters=1`` is DNAS; many iterations give rows summing to 1 and
    columns summing to ``n_q / n_k``.
    """

    iters: int = 3
    name = "sinkhorn"
    query_normalized = True

    def __post_init__(self) -> None:
        expected = (f"the number of iterations must be an integer in [0, {MAX_SINKHORN_ITERS}] (0 = softmax, "
                    "1 = DNAS; each is a sweep over every score, and the backward keeps 2 vectors per round)")
        iters = check_int(self.iters, f"Sinkhorn(iters={self.iters!r})", expected, low=0)
        if iters > MAX_SINKHORN_ITERS:
            raise ValueError(f"Sinkhorn(iters={self.iters!r}): {expected}")
        object.__setattr__(self, "iters", iters)  # a NumPy integer becomes an int


MAX_SINKHORN_ITERS = 1000  # far past convergence (the columns' error is 2e-15 after 100 rounds)


@dataclass(frozen=True)
class CoDA:
    """Compositional de-attention: ``M = f_E(alpha * E) * gate(beta * N)``, no normalization, with ``E``
    the affinity and ``N`` the negative L1 distance (eq. 10).

    ``gate``: ``"sigmoid"`` (plain ``f_N(N)``), ``"scaled"`` (``2 * f_N(N)``, eq. 5, default) or
    ``"centered"`` (``f_N(N - mean N)``, eq. 4). ``center_e`` subtracts the mean of ``E`` (eq. 6).
    ``e_activation`` / ``n_activation`` pick ``f_E`` / ``f_N`` from the Table 9 ablation; the gate
    ``f_N`` is mapped onto [0, 1] (``(f - inf f) / (sup f - inf f)``: tanh gives ``sigmoid(2x)``) so that
    every variant gates instead of flipping signs.
    """

    gate: str = "scaled"
    center_e: bool = False
    alpha: float = 1.0
    beta: float = 1.0
    e_activation: str = "tanh"
    n_activation: str = "sigmoid"
    name = "coda"
    query_normalized = False

    def __post_init__(self) -> None:
        check_choice(self.gate, f"CoDA(gate={self.gate!r})", GATES)
        for field_name in ("e_activation", "n_activation"):
            value = getattr(self, field_name)
            check_choice(value, f"CoDA({field_name}={value!r})", ACTIVATIONS)
        for field_name in ("alpha", "beta"):
            value = getattr(self, field_name)
            value = check_number(
                value, f"CoDA({field_name}={value!r})", "expected a finite number > 0", low=0.0, low_open=True
            )
            object.__setattr__(self, field_name, value)  # a NumPy scalar becomes a float
        check_bool(self.center_e, f"CoDA(center_e={self.center_e!r})")

    @property
    def uses_global_means(self) -> bool:
        """Eqs. (4) and (6) subtract means over every valid pair, which a causal mask cannot allow."""
        return self.center_e or self.gate == "centered"


MechanismConfig = Union[Softmax, DNAS, Hybrid, Sinkhorn, CoDA]
MechanismLike = Union[str, MechanismConfig]
