"""CoDA gate of the Table 9 ablation: every activation maps onto [0, 1], decreasing with the distance."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit as ak
from attnkit.functional import normalize
from attnkit.mechanisms import ACTIVATION_FNS, GATE_FNS
from attnkit.scores import neg_l1_distance


@pytest.mark.parametrize("name", sorted(ACTIVATION_FNS))
def test_gate_is_in_unit_interval_and_monotone(name):
    n = torch.linspace(-40.0, 40.0, 2001, dtype=torch.float64)
    g = GATE_FNS[name](n)
    assert float(g.min()) >= 0.0 and float(g.max()) <= 1.0
    assert bool((g[1:] >= g[:-1]).all())  # more distance (more negative N) never opens the gate more
    assert math.isclose(float(GATE_FNS[name](torch.zeros((), dtype=torch.float64))), 0.5, abs_tol=1e-12)


@pytest.mark.parametrize("name", ["tanh", "arctan", "algebraic"])
def test_gate_never_flips_the_sign_of_tanh_e(name):
    torch.manual_seed(0)
    q, k = (torch.randn(2, 2, 5, 8, dtype=torch.float64) for _ in range(2))
    e = torch.tanh(q @ k.transpose(-1, -2) / math.sqrt(8))  # (B, H, Lq, Lk)
    m = normalize(
        q @ k.transpose(-1, -2) / math.sqrt(8),
        ak.CoDA(gate="sigmoid", n_activation=name),
        gate_scores=neg_l1_distance(q, k),
    )  # (B, H, Lq, Lk)
    nonzero = m.abs() > 1e-12
    assert bool((torch.sign(m[nonzero]) == torch.sign(e[nonzero])).all())


def test_tanh_gate_is_sigmoid_of_twice_the_argument():
    x = torch.linspace(-6, 6, 101, dtype=torch.float64)
    torch.testing.assert_close(GATE_FNS["tanh"](x), torch.sigmoid(2 * x))
    torch.testing.assert_close(GATE_FNS["sigmoid"](x), torch.sigmoid(x))
