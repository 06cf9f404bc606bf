"""``repro_mlu``: a few steps of MLU training return a sequence accuracy for softmax and CoDA variants."""

from __future__ import annotations

import pytest

import attnkit as ak
from attnkit.analysis.repro_mlu import MLU_VARIANTS, train_mlu


@pytest.mark.parametrize(
    "mechanism",
    [
        "softmax",
        ak.CoDA(gate="scaled", n_activation="tanh"),
        ak.CoDA(gate="centered"),
        ak.CoDA(center_e=True),
    ],
)
def test_a_few_steps_give_an_accuracy(mechanism):
    acc = train_mlu(
        mechanism, steps=2, seed=0, value_range=10, num_train=100, num_test=20, batch_size=8, d_model=16
    )
    assert 0.0 <= acc <= 1.0


def test_variants_cover_the_gate_centering_and_activation_ablations():
    configs = [c for c in MLU_VARIANTS.values() if isinstance(c, ak.CoDA)]
    assert {c.gate for c in configs} == {"scaled", "sigmoid", "centered"}
    assert any(c.center_e for c in configs) and {c.n_activation for c in configs} >= {"sigmoid", "tanh"}
    assert any(c.e_activation == "sigmoid" for c in configs)
