"""attnkit.metrics: ECE against a hand-computed value, perfect calibration, bad input."""

from __future__ import annotations

import pytest
import torch

from attnkit.metrics import ece, reliability


def test_ece_known_answer():
    # confidences 0.9, 0.9, 0.6, 0.6 (two bins with n_bins=2: (0, .5], (.5, 1]... all in bin 2)
    probs = torch.tensor([[0.9, 0.1], [0.9, 0.1], [0.4, 0.6], [0.6, 0.4]], dtype=torch.float64)
    labels = torch.tensor([0, 1, 1, 1])
    # one bin: accuracy 2/4, mean confidence 0.75 -> |0.5 - 0.75| = 0.25
    assert ece(probs, labels, n_bins=1) == pytest.approx(0.25)
    # ten bins: bin (0.8, 0.9]: acc 1/2, conf 0.9 -> 0.4 * 2/4; bin (0.5, 0.6]: acc 1/2, conf 0.6 -> 0.1 * 2/4
    assert ece(probs, labels, n_bins=10) == pytest.approx(0.25)
    r = reliability(probs, labels, n_bins=10)
    assert r.counts.sum() == 4 and r.counts[8] == 2 and r.counts[5] == 2


def test_ece_weighs_each_bins_absolute_gap_by_its_share_of_samples():
    """Gaps of both signs do not cancel, and a bin of one sample is that sample (the known answer above
    has one sign and two samples per bin: mutating either passed it)."""
    probs = torch.tensor([[0.95, 0.05], [0.65, 0.35], [0.55, 0.45], [0.58, 0.42]], dtype=torch.float64)
    labels = torch.tensor([0, 1, 0, 0])
    r = reliability(probs, labels, n_bins=10)
    assert r.counts.tolist() == [0, 0, 0, 0, 0, 2, 1, 0, 0, 1]
    assert r.accuracy[[5, 6, 9]].tolist() == [1.0, 0.0, 1.0]
    assert r.confidence[[5, 6, 9]].tolist() == pytest.approx([0.565, 0.65, 0.95])
    # (2 |1 - 0.565| + |0 - 0.65| + |1 - 0.95|) / 4 = (0.87 + 0.65 + 0.05) / 4
    assert r.ece == pytest.approx(1.57 / 4)
    with pytest.raises(ValueError, match="sum to 1"):  # off by 1e-3 in float64: not softmax output
        ece(torch.tensor([[0.5, 0.501]], dtype=torch.float64), torch.tensor([0]))


@pytest.mark.parametrize("n_bins", [7, 10, 15, 20, 50])
def test_a_confidence_on_a_bin_edge_falls_in_the_bin_it_closes(n_bins):
    """Bins are ((m-1)/M, m/M]: a confidence of exactly m/M (0.55 with 20 bins, 0.7 with 10) went to the
    bin above, where ceil(confidence * M) rounded up past m."""
    m = torch.arange(n_bins // 2 + 1, n_bins + 1)
    confidence = m.double() / n_bins  # m / M > 1/2: the largest class probability of [c, 1 - c]
    probs = torch.stack([confidence, 1 - confidence], dim=1)
    r = reliability(probs, torch.zeros(len(m), dtype=torch.long), n_bins=n_bins)
    expected = torch.zeros(n_bins, dtype=torch.float64).index_fill_(0, m - 1, 1.0)
    assert torch.equal(r.counts, expected)
    assert torch.equal(r.edges[m], confidence)  # each confidence is the upper edge of its bin


def test_ece_is_zero_when_calibrated():
    probs = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    assert ece(probs, torch.tensor([0, 1, 0])) == 0.0
    assert ece(probs, torch.tensor([1, 0, 1])) == pytest.approx(1.0)


@pytest.mark.parametrize(
    "probs, labels, n_bins, match",
    [
        (torch.tensor([[2.0, -1.0]]), torch.tensor([0]), 15, "finite and >= 0"),
        (torch.tensor([[0.3, 0.3]]), torch.tensor([0]), 15, "sum to 1"),
        (torch.tensor([[0.5, 0.5]]), torch.tensor([2]), 15, r"labels must lie"),
        (torch.tensor([[0.5, 0.5]]), torch.tensor([0, 1]), 15, "labels has shape"),
        (torch.tensor([[0.5, 0.5]]), torch.tensor([0]), 0, "n_bins=0"),
        (torch.zeros(0, 2), torch.zeros(0), 15, "N >= 1"),
    ],
)
def test_bad_input_raises(probs, labels, n_bins, match):
    with pytest.raises(ValueError, match=match):
        ece(probs, labels, n_bins=n_bins)


def test_ece_takes_half_precision_softmax_and_numpy_bins_and_refuses_float_labels():
    import numpy as np

    torch.manual_seed(0)
    logits, labels = torch.randn(200, 5), torch.randint(0, 5, (200,))
    expected = ece(torch.softmax(logits.double(), -1), labels)
    for dtype in (torch.float16, torch.bfloat16):  # rows off by 3e-4 / 2e-3 were refused as "not softmax"
        assert abs(ece(torch.softmax(logits.to(dtype), -1), labels) - expected) < 0.02
    probs = torch.softmax(logits, -1)
    assert ece(probs, labels, n_bins=np.int64(10)) == ece(probs, labels, 10)
    with pytest.raises(ValueError, match="expected integer class ids"):  # 0.9 was read as class 0
        ece(torch.tensor([[0.2, 0.8]]), torch.tensor([0.9]))
    with pytest.raises(ValueError, match="rows must sum to 1"):
        ece(torch.tensor([[0.2, 0.5]]), torch.tensor([1]))
