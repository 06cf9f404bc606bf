"""One suite over the mechanism registry (``attnkit.registry.SPECS``): every mechanism and its variants
against
the float64 references of ``tests/_reference.py``, gradchecks, and the properties each spec declares."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import attnkit as ak
from attnkit.kernels import ROUTES
from attnkit.registry import SPECS, causal_problem, initial_theta, resolve_options
from tests._reference import CASES, Case, random_qkv

# The registry's cases plus variants: hnas at fixed weights (0 = softmax, 1 = DNAS) and CoDA's Table 9
# activations.
EXTRA = [Case(f"hnas-{u}", "hnas", {"hybrid_weight": u}, {"u": u}, "hnas") for u in (0.0, 0.25, 1.0)] + [
    Case(
        f"coda-e_{e}-n_{n}",
        lambda ak, e=e, n=n: ak.CoDA(e_activation=e, n_activation=n),
        {},
        {"coda": {"e_activation": e, "n_activation": n}},
        "coda",
    )
    for e, n in (
        ("tanh", "tanh"),
        ("tanh", "arctan"),
        ("sigmoid", "sigmoid"),
        ("arctan", "sigmoid"),
        ("algebraic", "sigmoid"),
    )
]
ALL = CASES + EXTRA
TWO_SEEDS = {"softmax", "sinkhorn-0", "dnas", "sinkhorn-1"}  # the closed forms checked on a second draw

# Gradchecks: a full check where a mechanism's branches are first reached; the variants that only swap
# elementwise functions or the number of rounds take the fast projected check (see conftest).
FULL_GRADCHECK = {"softmax", "dnas", "hnas-0.3", "hnas-per-head", "sinkhorn-5", "coda-center_e-centered"}
FAST_GRADCHECK = {
    "sinkhorn-0",
    "sinkhorn-1",
    "sinkhorn-2",
    "coda-default",
    "coda-sigmoid",
    "coda-alpha-beta",
    "coda-e_sigmoid-n_tanh",
    "coda-e_arctan-n_arctan",
    "coda-e_algebraic-n_algebraic",
}


def _params(cases, seeds=False):
    out = []
    for c in cases:
        for seed in (0, 1) if seeds and c.id in TWO_SEEDS else (0,):
            out.append(
                pytest.param(c, seed, id=f"{c.ref_mechanism}/{c.id}" + (f"-seed{seed}" if seed else ""))
            )
    return out


@pytest.mark.parametrize(("case", "seed"), _params(ALL, seeds=True))
def test_matches_reference(case, seed, backend, compare_with_reference):
    compare_with_reference(case, backend, seed=seed)


@pytest.mark.parametrize(
    ("case", "seed"), _params([c for c in ALL if c.id in FULL_GRADCHECK | FAST_GRADCHECK])
)
def test_gradcheck_float64(case, seed, backend, gradcheck_attention):
    gradcheck_attention(case, backend, fast_mode=case.id in FAST_GRADCHECK)


def test_the_cases_cover_every_registered_mechanism():
    assert {c.ref_mechanism for c in ALL} == set(SPECS) == set(ak.MECHANISMS)
    assert {c.ref_mechanism for c in ALL if c.id in FULL_GRADCHECK} == set(SPECS)


@pytest.mark.parametrize("name", list(SPECS))
def test_name_and_aliases_resolve_to_the_spec_config(name):
    spec = SPECS[name]
    for alias in (name, name.upper(), *spec.aliases):
        config = ak.resolve_mechanism(alias)
        assert type(config) is spec.config and config.name == name
    assert spec.options == tuple(f.name for f in dataclasses.fields(spec.config))


@pytest.mark.parametrize("name", list(SPECS))
def test_unknown_option_lists_the_valid_ones(name):
    with pytest.raises(ValueError, match="valid options") as err:
        ak.resolve_mechanism(name, bogus=1)
    for option in SPECS[name].options:
        assert option in str(err.value)


@pytest.mark.parametrize("name", list(SPECS))
def test_causal_is_refused_exactly_for_query_normalized_mechanisms(name):
    q, k, v = random_qkv(1, 2, 4, 4, seed=0)
    config = ak.resolve_mechanism(name)
    assert (causal_problem(config) is not None) == SPECS[name].query_normalized
    if SPECS[name].query_normalized:
        with pytest.raises(ValueError, match="future-token leak"):
            ak.attention(q, k, v, name, causal=True)
    else:
        assert torch.isfinite(ak.attention(q, k, v, name, causal=True)).all()


@pytest.mark.parametrize("name", list(SPECS))
def test_routes_exist_and_the_last_one_takes_every_call(name):
    spec = SPECS[name]
    assert spec.routes and all(route in ROUTES for route in spec.routes)
    q, k, v = random_qkv(2, 2, 5, 6, seed=0)
    pair = torch.rand(2, 1, 5, 6, generator=torch.Generator().manual_seed(0)) < 0.8
    plan = ak.explain_dispatch(q, k, v, name, attn_mask=pair, backend="efficient")
    assert plan.route in spec.routes and plan.reason
    if spec.query_normalized:  # a general pair mask: only the block sweeps
        assert plan.route == spec.routes[-1]
    assert ak.explain_dispatch(q, k, v, name, return_weights=True).route == "reference"


def test_labels_and_colours_are_distinct():
    assert len({s.label for s in SPECS.values()}) == len(SPECS)
    assert len({s.color for s in SPECS.values()}) == len(SPECS)


@pytest.mark.parametrize("u0", [0.0, 1.0])
def test_learnable_hybrid_weight_needs_u0_strictly_inside_0_1(u0):
    with pytest.raises(ValueError, match="strictly inside"):
        resolve_options("hnas", u0=u0, learnable_u=True)
    with pytest.raises(ValueError, match="strictly inside"):
        ak.nn.MultiheadAttention(8, 2, mechanism=ak.Hybrid(u0=u0))
    assert resolve_options("hnas", u0=u0).u0 == u0  # a fixed (not learnable) weight may be 0 or 1
    assert initial_theta(ak.Hybrid(u0=0.5)) == 0.0
