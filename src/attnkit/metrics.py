r"""Calibration metrics: expected calibration error and the data of a reliability diagram.

ECE with equal-width confidence bins (Guo et al., "On Calibration of Modern Neural Networks",
arXiv:1706.04599; as reported in "Alignment Attention by Matching Key and Query Distributions",
arXiv:2110.12567, sec. 4.1.2):

.. math::
    \mathrm{ECE} = \sum_{m=1}^{M} \frac{|B_m|}{n} \, \big|\mathrm{acc}(B_m) - \mathrm{conf}(B_m)\big|

where ``B_m`` holds the samples whose confidence (largest class probability) falls in
``((m - 1)/M, m/M]`` (the first bin also holds confidence 0).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["ece", "reliability", "Reliability"]


@dataclass(frozen=True)
class Reliability:
    """Per-bin counts, accuracies and mean confidences (``(n_bins,)`` tensors; empty bins hold 0) and the
    ECE."""

    edges: Tensor
    counts: Tensor
    accuracy: Tensor
    confidence: Tensor
    ece: float


def _check(probs, labels, n_bins: int) -> tuple[Tensor, Tensor]:
    given = torch.as_tensor(probs)
    # rows of softmax in half precision sum to 1 within that precision (3e-4 in float16, 2e-3 in bfloat16)
    eps = torch.finfo(given.dtype).eps if given.dtype.is_floating_point else 0.0
    tolerance = max(1e-4, 4 * eps)
    probs = given.to(torch.float64)
    labels = torch.as_tensor(labels)
    if isinstance(n_bins, bool) or not isinstance(n_bins, numbers.Integral) or n_bins < 1:
        raise ValueError(f"n_bins={n_bins!r}; expected an integer >= 1 (15 by default)")
    n_bins = int(n_bins)
    if probs.dim() != 2 or probs.shape[0] == 0:
        raise ValueError(
            f"probs has shape {tuple(probs.shape)}, expected (N, C) class probabilities with N >= 1"
        )
    if labels.shape != (probs.shape[0],):
        raise ValueError(f"labels has shape {tuple(labels.shape)}, expected (N,) = ({probs.shape[0]},)")
    if not bool(torch.isfinite(probs).all()) or bool((probs < 0).any()):
        raise ValueError("probs must be finite and >= 0; pass softmax(logits), not logits")
    if not torch.allclose(probs.sum(-1), torch.ones(probs.shape[0], dtype=probs.dtype), atol=tolerance):
        worst = float((probs.sum(-1) - 1).abs().max())
        raise ValueError(
            f"probs rows must sum to 1 (one is off by {worst:.2g}); pass softmax(logits, dim=-1), not logits"
        )
    if labels.dtype.is_floating_point or labels.dtype == torch.bool or labels.is_complex():
        raise ValueError(f"labels have dtype {labels.dtype}; expected integer class ids (N,)")
    labels = labels.long()
    if bool((labels < 0).any()) or bool((labels >= probs.shape[1]).any()):
        raise ValueError(f"labels must lie in [0, {probs.shape[1] - 1}]")
    return probs, labels


def reliability(probs, labels, n_bins: int = 15) -> Reliability:
    """Reliability-diagram data of class probabilities ``probs (N, C)`` against ``labels (N,)``."""
    probs, labels = _check(probs, labels, n_bins)
    n_bins = int(n_bins)
    confidence, prediction = probs.max(-1)  # (N,)
    correct = (prediction == labels).double()
    edges = torch.arange(n_bins + 1, dtype=torch.float64) / n_bins  # m / M, as Python's m / M rounds it
    # bin ((m-1)/M, m/M] by comparison with the edges: ceil(confidence * M) rounded 0.55 * 20 up to
    # 11.000...02 and put a confidence of exactly m / M in the bin above (22 of 1275 such values, M <= 50)
    index = torch.bucketize(confidence, edges[1:-1], right=False)  # (N,) in [0, M - 1]; 0 in bin 0
    counts = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, index, torch.ones_like(confidence))
    acc_sum = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, index, correct)
    conf_sum = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, index, confidence)
    safe = counts.clamp_min(1)
    accuracy, mean_conf = acc_sum / safe, conf_sum / safe
    value = float((counts / counts.sum() * (accuracy - mean_conf).abs()).sum())
    return Reliability(edges, counts, accuracy, mean_conf, value)


def ece(probs, labels, n_bins: int = 15) -> float:
    """Expected calibration error of ``probs (N, C)`` (rows sum to 1) against ``labels (N,)``, in [0, 1]."""
    return reliability(probs, labels, n_bins).ece
