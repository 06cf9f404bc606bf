"""attnkit.metrics: labels are integer class ids; other label types are refused with the dtype named."""

from __future__ import annotations

import pytest
import torch

from attnkit.metrics import ece, reliability

PROBS = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4]], dtype=torch.float64)  # (N, C)


@pytest.mark.parametrize("labels", [
    torch.tensor([True, False, True]),  # a correctness mask, not class ids
    torch.tensor([0.0, 1.0, 0.0]),
    torch.tensor([0, 1, 0], dtype=torch.complex64),
], ids=["bool", "float", "complex"])
@pytest.mark.parametrize("metric", [ece, reliability])
def test_labels_that_are_not_integer_class_ids_are_refused(metric, labels):
    """A boolean tensor (e.g. "was the prediction right") passed as labels was read as class ids 0 and 1,
    and gave a number for a question nobody asked (here ECE 0.77 instead of an error)."""
    with pytest.raises(ValueError, match=f"labels have dtype {labels.dtype}; expected integer class ids"):
        metric(PROBS, labels)


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int32, torch.int64])
def test_integer_labels_of_any_width_give_the_same_ece(dtype):
    """Every integer dtype holds class ids: the same ECE as int64 labels."""
    labels = torch.tensor([0, 1, 1])
    assert ece(PROBS, labels.to(dtype)) == pytest.approx(ece(PROBS, labels))
