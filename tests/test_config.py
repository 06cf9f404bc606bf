"""Mechanism config dataclasses and ``resolve_mechanism``."""

from __future__ import annotations

import dataclasses

import pytest

import attnkit as ak
from attnkit.config import ACTIVATIONS, GATES
from attnkit.registry import resolve_mechanism


def test_mechanism_names():
    assert ak.MECHANISMS == ("softmax", "dnas", "hnas", "sinkhorn", "coda")


@pytest.mark.parametrize(
    "name,cls",
    [
        ("softmax", ak.Softmax),
        ("dnas", ak.DNAS),
        ("hnas", ak.Hybrid),
        ("sinkhorn", ak.Sinkhorn),
        ("coda", ak.CoDA),
        ("LNAS", ak.Softmax),
        ("hybrid", ak.Hybrid),
        ("doubly", ak.DNAS),
        ("DNAS", ak.DNAS),
    ],
)
def test_names_and_aliases_resolve_to_configs(name, cls):
    config = resolve_mechanism(name)
    assert isinstance(config, cls)
    assert config.name in ak.MECHANISMS


def test_config_objects_pass_through_unchanged():
    config = ak.Sinkhorn(iters=7)
    assert resolve_mechanism(config) is config


def test_options_are_applied_by_name():
    assert resolve_mechanism("sinkhorn", iters=5) == ak.Sinkhorn(iters=5)
    assert resolve_mechanism(ak.CoDA(), gate="centered").gate == "centered"


def test_query_normalized_marks_the_mechanisms_that_leak_under_causal():
    flags = {name: resolve_mechanism(name).query_normalized for name in ak.MECHANISMS}
    assert flags == {"softmax": False, "dnas": True, "hnas": True, "sinkhorn": True, "coda": False}


def test_defaults():
    assert ak.Hybrid().u0 == 0.5
    assert ak.Sinkhorn().iters == 3
    c = ak.CoDA()
    assert (c.gate, c.center_e, c.alpha, c.beta, c.e_activation, c.n_activation) == (
        "scaled", False, 1.0, 1.0, "tanh", "sigmoid")
    assert GATES == ("sigmoid", "scaled", "centered")
    assert ACTIVATIONS == ("tanh", "sigmoid", "arctan", "algebraic")


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ak.Sinkhorn().iters = 4


@pytest.mark.parametrize(
    "build,match",
    [
        (lambda: ak.Hybrid(u0=1.5), r"Hybrid\(u0=1.5\).*\[0, 1\]"),
        (lambda: ak.Hybrid(u0=-0.1), r"Hybrid\(u0=-0.1\)"),
        (lambda: ak.Hybrid(u0=float("nan")), r"Hybrid\(u0=nan\)"),
        (lambda: ak.Hybrid(u0="0.5"), r"Hybrid\(u0='0.5'\)"),
        (lambda: ak.Hybrid(u0=True), r"Hybrid\(u0=True\)"),
        (lambda: ak.Sinkhorn(iters=-1), r"Sinkhorn\(iters=-1\).*integer in \[0, 1000\]"),
        # 10**12 rounds: convert saved such a model, and every later command hung or failed to allocate
        (lambda: ak.Sinkhorn(iters=10**12), r"Sinkhorn\(iters=1000000000000\).*integer in \[0, 1000\]"),
        (lambda: ak.Sinkhorn(iters=1.5), r"Sinkhorn\(iters=1.5\)"),
        (lambda: ak.Sinkhorn(iters=True), r"Sinkhorn\(iters=True\)"),
        (lambda: ak.Sinkhorn(iters="3"), r"Sinkhorn\(iters='3'\)"),
        (lambda: ak.CoDA(gate="softmax"), r"CoDA\(gate='softmax'\).*'sigmoid', 'scaled', 'centered'"),
        (lambda: ak.CoDA(e_activation="relu"), r"CoDA\(e_activation='relu'\).*'tanh'"),
        (lambda: ak.CoDA(n_activation="gelu"), r"CoDA\(n_activation='gelu'\)"),
        (lambda: ak.CoDA(alpha=0), r"CoDA\(alpha=0\).*finite number > 0"),
        (lambda: ak.CoDA(alpha=-1.0), r"CoDA\(alpha=-1.0\)"),
        (lambda: ak.CoDA(beta=float("inf")), r"CoDA\(beta=inf\)"),
        (lambda: ak.CoDA(beta=float("nan")), r"CoDA\(beta=nan\)"),
        (lambda: ak.CoDA(alpha=True), r"CoDA\(alpha=True\)"),
        (lambda: ak.CoDA(center_e="yes"), r"CoDA\(center_e='yes'\).*True or False"),
        (
            lambda: resolve_mechanism("flash"),
            r"unknown attention mechanism 'flash'; expected one of \('softmax'",
        ),
        (lambda: resolve_mechanism(None), r"mechanism must be a name.*got NoneType"),
        (
            lambda: resolve_mechanism("dnas", iters=3),
            r"DNAS has no option\(s\) \['iters'\]; valid options: none",
        ),
        (
            lambda: resolve_mechanism("sinkhorn", gate="x"),
            r"Sinkhorn has no option\(s\) \['gate'\]; valid options: \['iters'\]",
        ),
        (lambda: resolve_mechanism("sinkhorn", iters=-2), r"Sinkhorn\(iters=-2\)"),
        (lambda: resolve_mechanism("coda", gate="x"), r"CoDA\(gate='x'\)"),
    ],
    ids=lambda x: None,
)
def test_bad_config_raises_value_error_naming_the_value(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_numpy_scalars_are_accepted_and_stored_as_python_numbers():
    np = pytest.importorskip("numpy")
    sinkhorn = ak.Sinkhorn(iters=np.int64(4))
    assert sinkhorn == ak.Sinkhorn(iters=4) and type(sinkhorn.iters) is int
    assert type(ak.Hybrid(u0=np.float32(0.25)).u0) is float
    coda = ak.CoDA(alpha=np.float64(2.0), beta=np.int32(3))
    assert (coda.alpha, coda.beta) == (2.0, 3.0) and type(coda.beta) is float
    with pytest.raises(ValueError, match=r"integer in \[0, 1000\]"):
        ak.Sinkhorn(iters=np.float64(3.0))
    with pytest.raises(ValueError, match=r"integer in \[0, 1000\]"):
        ak.Sinkhorn(iters=np.bool_(True))
