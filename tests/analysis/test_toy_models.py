"""The small models of the reproductions: CoDA matrices are consistent, the fusion model's masks hold."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnkit as ak
from attnkit.analysis import collect_explain_away
from attnkit.analysis.toy_models import (
    CoDAClassifier,
    MultiViewFusion,
    make_multiview_task,
    make_signed_sum_task,
)


@pytest.mark.parametrize("gate", ["sigmoid", "scaled", "centered"])
def test_coda_matrices_compose_to_m(gate):
    torch.manual_seed(0)
    model = CoDAClassifier(vocab=15, d_model=16, num_heads=2, num_classes=2, config=ak.CoDA(gate=gate))
    tokens, mask, _ = make_signed_sum_task(6, length=10, min_length=3, seed=1)
    mats = model.matrices(tokens, mask)
    gate_values, tanh_e, m = list(mats.values())
    assert np.allclose(gate_values * tanh_e, m, atol=1e-6)
    assert tanh_e.size == 2 * int((mask.sum(1) ** 2).sum())  # only valid pairs, per head
    upper = 0.5 if gate == "sigmoid" else 1.0
    assert gate_values.min() >= 0 and gate_values.max() <= upper + 1e-6


def test_multiview_padding_keys_are_not_counted():
    primary, secondary, key_mask, labels = make_multiview_task(8, num_boxes=12, min_boxes=6, seed=0)
    assert key_mask.sum(1).min() >= 6 and (secondary[~key_mask] == 0).all()
    model = MultiViewFusion(16, head_dim=8, num_classes=4, mechanism="dnas")
    with collect_explain_away(model) as log:
        logits = model(primary, secondary, key_mask)
    assert logits.shape == (8, 4)
    stats = log.records[0].stats
    assert torch.equal(stats.valid_keys[:, 0], key_mask)
    assert stats.min_normalized >= 1 - 1e-6


def test_multiview_hybrid_weight_starts_at_u0():
    model = MultiViewFusion(16, head_dim=8, num_classes=4, mechanism=ak.Hybrid(u0=0.1))
    assert model.hybrid_weight().item() == pytest.approx(0.1, rel=1e-5)
    assert MultiViewFusion(16, head_dim=8, num_classes=4, mechanism="softmax").hybrid_weight() is None
