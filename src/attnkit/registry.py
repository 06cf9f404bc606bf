"""The registry of attention mechanisms: one ``MechanismSpec`` per mechanism, the only place that knows them
all.

A spec holds what the rest of the package needs to know about a mechanism (docs/design.md section 5):
its config class and aliases, whether it normalizes over queries (and so refuses causal masks), the number
of potential-loop iterations it runs (softmax, DNAS and Sinkhorn-k are ``iters = 0, 1, k`` of one loop,
docs/design.md section 2), its efficient routes in order of preference, a label and a plot colour.
Functional dispatch, the kernels' route table, the ``nn`` modules, Hugging Face conversion, the run
configuration, the benchmark, the plots and the demo all read it. Adding a mechanism means adding one spec
here plus its weights function and kernels.

Names are resolved and validated once at a boundary (``ak.attention``, a module constructor, a CLI/run
config) with ``resolve_mechanism`` / ``resolve_options``; the resolved config object is passed inward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Optional, Union

from torch import Tensor

from .config import DNAS, CoDA, Hybrid, MechanismConfig, MechanismLike, Sinkhorn, Softmax
from .mechanisms import coda_weights, dnas_weights, hnas_weights, sinkhorn_weights, softmax_weights
from .validators import is_number

__all__ = [
    "MechanismSpec",
    "SPECS",
    "MECHANISMS",
    "spec_of",
    "canonical_name",
    "resolve_mechanism",
    "resolve_options",
    "normalizes_over_queries",
    "causal_problem",
    "check_causal",
    "initial_theta",
    "config_label",
    "mechanism_color",
]


@dataclass(frozen=True)
class MechanismSpec:
    """Everything the package needs to know about one mechanism besides its math.

    ``weights(scores, valid, config, u, gate_scores)``: the reference weights ``(B, H, Lq, Lk)``
    (``attnkit.mechanisms``). ``potential_iters(config)``: the ``k`` of the potential loop (0 softmax, 1
    DNAS/HNAS, ``iters`` Sinkhorn),
    ``None`` for mechanisms outside the loop (CoDA). ``routes``: the efficient routes that can run it, in
    order
    of preference (names of ``attnkit.kernels.ROUTES``). ``label``/``color``: tables and plots.
    """

    name: str
    config: type
    aliases: tuple[str, ...]
    label: str
    color: str
    query_normalized: bool
    weights: Callable[..., Tensor]
    potential_iters: Optional[Callable[[Any], int]]
    routes: tuple[str, ...]
    summary: str

    @property
    def options(self) -> tuple[str, ...]:
        """The config's option names (``("iters",)`` for Sinkhorn)."""
        return tuple(f.name for f in fields(self.config))

    @property
    def has_hybrid_weight(self) -> bool:
        return self.config is Hybrid


SPECS: dict[str, MechanismSpec] = {
    spec.name: spec
    for spec in (
        MechanismSpec(
            "softmax",
            Softmax,
            ("lnas",),
            "LNAS (softmax)",
            "#1f5fbf",  # blue, as LNAS in the papers' figures
            query_normalized=False,
            weights=lambda s, valid, c, u, n: softmax_weights(s, valid),
            potential_iters=lambda c: 0,
            routes=("cpp_softmax", "sdpa", "blockwise"),
            summary="rows sum to 1",
        ),
        MechanismSpec(
            "dnas",
            DNAS,
            ("doubly",),
            "DNAS",
            "#d62728",  # red, as DNAS in the papers' figures
            query_normalized=True,
            weights=lambda s, valid, c, u, n: dnas_weights(s, valid),
            potential_iters=lambda c: 1,
            routes=("triton", "cpp", "aten", "blockwise"),
            summary="every key receives at least 1/n_k (Lemma 1)",
        ),
        MechanismSpec(
            "hnas",
            Hybrid,
            ("hybrid",),
            "HNAS",
            "#8c4fbf",
            query_normalized=True,
            weights=lambda s, valid, c, u, n: hnas_weights(s, valid, u.to(s.dtype)),
            potential_iters=lambda c: 1,
            routes=("triton", "cpp", "aten", "blockwise"),
            summary="u * DNAS + (1 - u) * softmax",
        ),
        MechanismSpec(
            "sinkhorn",
            Sinkhorn,
            (),
            "Sinkhorn",
            "#2a9d3c",
            query_normalized=True,
            weights=lambda s, valid, c, u, n: sinkhorn_weights(s, valid, c.iters),
            potential_iters=lambda c: c.iters,
            routes=("cpp_softmax", "sdpa", "triton", "cpp", "blockwise"),
            summary="k column+row normalizations",
        ),
        MechanismSpec(
            "coda",
            CoDA,
            (),
            "CoDA",
            "#e07b00",
            query_normalized=False,
            weights=lambda s, valid, c, u, n: coda_weights(s, n, valid, c),
            potential_iters=None,
            routes=("coda_triton", "coda_cpp", "coda_blockwise"),
            summary="M = tanh(E) * gate(N) in [-1, 1], no normalization",
        ),
    )
}

MECHANISMS: tuple[str, ...] = tuple(SPECS)
_BY_ALIAS: dict[str, str] = {
    alias: spec.name for spec in SPECS.values() for alias in (spec.name, *spec.aliases)
}
_CONFIG_TYPES = tuple(spec.config for spec in SPECS.values())


def spec_of(mechanism: Union[MechanismLike, MechanismSpec]) -> MechanismSpec:
    """The spec of a name, an alias or a config object."""
    if isinstance(mechanism, MechanismSpec):
        return mechanism
    if isinstance(mechanism, str):
        return SPECS[canonical_name(mechanism)]
    return SPECS[resolve_mechanism(mechanism).name]


def canonical_name(name: str) -> str:
    """The registered name of a mechanism named by any case or alias (``"DNAS"``, ``"lnas"``); a
    ``ValueError`` listing the mechanisms for an unknown one."""
    key = _BY_ALIAS.get(str(name).lower())
    if key is None:
        raise ValueError(f"unknown attention mechanism {name!r}; expected one of {MECHANISMS}")
    return key


def resolve_mechanism(mechanism: MechanismLike, **options: Any) -> MechanismConfig:
    """Return the config object for ``mechanism`` (a name, an alias or a config object).

    ``options`` are config fields given by name (e.g. ``iters=5`` for Sinkhorn); an option that the
    mechanism does not have raises a ``ValueError`` listing the ones it has.
    """
    if isinstance(mechanism, _CONFIG_TYPES):
        config = mechanism
    elif isinstance(mechanism, str):
        config = SPECS[canonical_name(mechanism)].config()
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


def resolve_options(
    mechanism: MechanismLike,
    *,
    u0: Optional[float] = None,
    sinkhorn_iters: Optional[int] = None,
    hybrid_weight: Optional[Union[float, Tensor]] = None,
    learnable_u: bool = False,
) -> MechanismConfig:
    """``resolve_mechanism`` plus the per-call / per-module options, each accepted only by its mechanism.

    ``u0`` (hnas: initial hybrid weight) and ``sinkhorn_iters`` (sinkhorn) replace the config's value when
    ``mechanism`` is a name and must agree with it when it is a config object. ``hybrid_weight`` (hnas, a
    per-call ``u``) is only checked to belong to hnas; ``check_hybrid_weight`` validates its values.
    ``learnable_u``: the config seeds a learnable ``u = sigmoid(theta)``, so ``u0`` must lie strictly in
    (0, 1) (``initial_theta``).
    """
    config = resolve_mechanism(mechanism)
    by_name = isinstance(mechanism, str)
    if hybrid_weight is not None and not isinstance(config, Hybrid):
        raise ValueError(
            f"hybrid_weight is only used by mechanism 'hnas', got mechanism {config.name!r}; drop "
            "hybrid_weight"
        )
    if u0 is not None:
        if not isinstance(config, Hybrid):
            raise ValueError(
                f"u0={u0!r} is only used by mechanism 'hnas', got mechanism {config.name!r}; drop u0 "
                "or use mechanism='hnas'"
            )
        if not is_number(u0):
            raise ValueError(f"u0={u0!r}; expected a number in (0, 1), e.g. 0.5")
        if not by_name:  # equal within float32 precision agrees (np.float32(0.3) with Hybrid(u0=0.3))
            if not math.isclose(float(u0), config.u0, rel_tol=1e-6):
                raise ValueError(f"u0={u0!r} contradicts the config {config!r}; pass u0 in one place only")
        else:
            config = Hybrid(u0=float(u0))  # validates [0, 1]
    if sinkhorn_iters is not None:
        if not isinstance(config, Sinkhorn):
            raise ValueError(
                f"sinkhorn_iters is only used by mechanism 'sinkhorn', got mechanism {config.name!r}; "
                "drop sinkhorn_iters"
            )
        if not by_name and sinkhorn_iters != config.iters:
            raise ValueError(
                f"sinkhorn_iters={sinkhorn_iters} contradicts the config Sinkhorn(iters={config.iters}); "
                "pass one of them"
            )
        config = Sinkhorn(iters=sinkhorn_iters)
    if learnable_u and isinstance(config, Hybrid):
        initial_theta(config)  # validates u0 in (0, 1)
    return config


def initial_theta(config: Hybrid) -> float:
    """``theta = logit(u0)``, the start of a learnable hybrid weight ``u = sigmoid(theta)``.

    The one policy for every module (``ak.nn``, converted Hugging Face models, the toy models): ``u0`` must
    lie strictly inside (0, 1), because ``logit(0)`` and ``logit(1)`` are infinite.
    """
    u0 = float(config.u0)
    if not 0.0 < u0 < 1.0:
        raise ValueError(
            f"u0={config.u0!r}: a learnable hybrid weight u = sigmoid(theta) needs u0 strictly inside (0, 1) "
            "(theta = logit(u0) must be finite); use e.g. u0=0.01 / 0.99, or mechanism='softmax' / 'dnas'"
        )
    return math.log(u0) - math.log1p(-u0)


def normalizes_over_queries(config: MechanismConfig) -> bool:
    """Whether ``config`` runs a column (over queries) normalization: dnas, hnas, sinkhorn with ``iters >= 1``
    (``Sinkhorn(iters=0)`` is softmax)."""
    spec = spec_of(config)
    return spec.query_normalized and (spec.potential_iters is None or spec.potential_iters(config) > 0)


def causal_problem(config: MechanismConfig) -> Optional[str]:
    """Why ``config`` cannot run under a causal mask (a future-token leak), or ``None`` when it can."""
    if normalizes_over_queries(config):
        return (
            f"mechanism {config.name!r} normalizes over queries, so under a causal mask the weight of query "
            "i "
            "depends on later queries (a future-token leak). Use mechanism='softmax' or 'coda' for causal "
            "(decoder) attention, and keep dnas/hnas/sinkhorn for bidirectional (encoder) attention."
        )
    if isinstance(config, CoDA) and config.uses_global_means:
        return (
            f"CoDA(gate={config.gate!r}, center_e={config.center_e!r}) subtracts the mean over all valid "
            "pairs "
            "(eqs. 4 and 6), so under a causal mask the output at position i depends on later positions "
            "(a future-token leak). Use CoDA(gate='scaled') or gate='sigmoid' with center_e=False for causal "
            "attention."
        )
    return None


def check_causal(config: MechanismConfig, causal: bool) -> None:
    """Raise the ``causal_problem`` of ``config`` as a ``ValueError`` when ``causal``, and a ``ValueError``
    when ``causal`` is not a flag (``"False"`` is truthy, a tensor of several values has no truth value)."""
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be True or False, got {causal!r}")
    if causal:
        problem = causal_problem(config)
        if problem is not None:
            raise ValueError(problem)


def config_label(config: MechanismConfig) -> str:
    """``"hnas"`` for a default config, the full repr (``Sinkhorn(iters=5)``) otherwise."""
    return config.name if config == resolve_mechanism(config.name) else repr(config)


def mechanism_color(name: str) -> str:
    """The fixed plot colour of mechanism ``name`` (aliases such as ``"lnas"`` accepted)."""
    key = _BY_ALIAS.get(name.lower())
    if key is None:
        raise ValueError(f"no colour for mechanism {name!r}; expected one of {MECHANISMS}")
    return SPECS[key].color
