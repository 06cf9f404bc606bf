"""normalize(..., "coda", gate_scores=N): N is checked like the scores, and -inf in N means gate 0."""

import pytest
import torch

import attnkit as ak


def _pair():
    torch.manual_seed(0)
    return torch.randn(1, 2, 3, 4, dtype=torch.float64), -torch.rand(1, 2, 3, 4, dtype=torch.float64)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_posinf_gate_scores_are_refused(bad):
    e, n = _pair()
    n[0, 1, 2, 0] = bad
    with pytest.raises(ValueError, match="gate_scores contain NaN or \\+inf"):
        ak.normalize(e, "coda", gate_scores=n)


@pytest.mark.parametrize("gate", ["sigmoid", "scaled", "centered"])
def test_neg_inf_gate_score_gives_exactly_zero_for_every_gate(gate):
    e, n = _pair()
    n[0, 0, 1, 2] = float("-inf")
    m = ak.normalize(e, ak.CoDA(gate=gate), gate_scores=n)
    assert torch.isfinite(m).all()
    assert m[0, 0, 1, 2] == 0


def test_centered_gate_mean_leaves_neg_inf_out():
    e, n = _pair()
    n[0, 0, 1, 2] = float("-inf")
    m = ak.normalize(e, ak.CoDA(gate="centered"), gate_scores=n)
    finite = torch.isfinite(n[0, 0])
    centered = n[0, 0] - n[0, 0][finite].mean()
    expected = torch.tanh(e[0, 0]) * torch.sigmoid(centered)
    torch.testing.assert_close(m[0, 0], expected)
