"""Configuration objects for the attention mechanisms.

Each mechanism of DESIGN.md section 2/3 has a small frozen dataclass, validated in ``__post_init__``.
``resolve_mechanism`` turns a name (``"dnas"``) or a config object into a config object, so every
public entry point accepts both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, Union

__all__ = [
    "MECHANISMS",
    "ACTIVATIONS",
    "GATES",
    "Softmax",
    "DNAS",
    "Hybrid",
    "Sinkhorn",
    "CoDA",
    "MechanismConfig",
    "MechanismLike",
    "resolve_mechanism",
]

MECHANISMS: tuple[str, ...] = ("softmax", "dnas", "hnas", "sinkhorn", "coda")
ACTIVATIONS: tuple[str, ...] = ("tanh", "sigmoid", "arctan", "algebraic")
GATES: tuple[str, ...] = ("sigmoid", "scaled", "centered")

_ALIASES = {"lnas": "softmax", "hybrid": "hnas", "doubly": "dnas"}


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
        if isinstance(self.u0, bool) or not isinstance(self.u0, (int, float)) or not 0.0 <= float(self.u0) <= 1.0:
            raise ValueError(f"Hybrid(u0={self.u0!r}): the hybrid weight must be a number in [0, 1]")


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
        if isinstance(self.iters, bool) or not isinstance(self.iters, int) or self.iters < 0:
            raise ValueError(
                f"Sinkhorn(iters={self.iters!r}): the number of iterations must be an integer >= 0 "
                "(0 = softmax, 1 = DNAS)"
            )


@dataclass(frozen=True)
class CoDA:
    """Compositional de-attention: ``M = f_E(alpha * E) * gate(-beta * N)``, no normalization.

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
        if self.gate not in GATES:
            raise ValueError(f"CoDA(gate={self.gate!r}): expected one of {GATES}")
        for field_name in ("e_activation", "n_activation"):
            value = getattr(self, field_name)
            if value not in ACTIVATIONS:
                raise ValueError(f"CoDA({field_name}={value!r}): expected one of {ACTIVATIONS}")
        for field_name in ("alpha", "beta"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"CoDA({field_name}={value!r}): expected a finite number > 0")
        if not isinstance(self.center_e, bool):
            raise ValueError(f"CoDA(center_e={self.center_e!r}): expected True or False")


MechanismConfig = Union[Softmax, DNAS, Hybrid, Sinkhorn, CoDA]
MechanismLike = Union[str, MechanismConfig]

_BY_NAME: dict[str, type] = {"softmax": Softmax, "dnas": DNAS, "hnas": Hybrid, "sinkhorn": Sinkhorn, "coda": CoDA}


def resolve_mechanism(mechanism: MechanismLike, **options: Any) -> MechanismConfig:
    """Return the config object for ``mechanism`` (a name or a config object).

    ``options`` are config fields given by name (e.g. ``iters=5`` for Sinkhorn); an option that the
    mechanism does not have raises a ``ValueError`` listing the ones it has.
    """
    if isinstance(mechanism, tuple(_BY_NAME.values())):
        config = mechanism
    elif isinstance(mechanism, str):
        key = _ALIASES.get(mechanism.lower(), mechanism.lower())
        if key not in _BY_NAME:
            raise ValueError(f"unknown attention mechanism {mechanism!r}; expected one of {MECHANISMS}")
        config = _BY_NAME[key]()
    else:
        raise ValueError(
            f"mechanism must be a name in {MECHANISMS} or a config object (ak.Softmax(), ak.DNAS(), "
            f"ak.Hybrid(u0=...), ak.Sinkhorn(iters=...), ak.CoDA(...)), got {type(mechanism).__name__}"
        )
    if options:
        valid = [f.name for f in fields(config)]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise ValueError(
                f"{type(config).__name__} has no option(s) {unknown}; valid options: {valid or 'none'}"
            )
        config = replace(config, **options)
    return config
