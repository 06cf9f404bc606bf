"""Collect the learned hybrid weights of a model for plots.

"Attention that does not Explain Away" (arXiv:2009.14308), section 5 and Figs. 3-5: one ``u = sigmoid(theta)``
per
layer and head, plotted per layer (averaged over heads) to show where DNAS or softmax is preferred.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .content import ContentAttention
from .multihead import MultiheadAttention
from .multiview import MultiViewAttention

__all__ = ["hybrid_weights"]


def hybrid_weights(module: nn.Module) -> Tensor:
    """The ``u`` of every HNAS attention module inside ``module``, in module order: ``(layers, heads)``.

    ``layers`` counts the HNAS attention modules (``MultiheadAttention`` / ``MultiViewAttention`` and the
    one-head content modules ``AdditiveAttention`` / ``BilinearAttention`` / ``DotAttention`` with
    ``mechanism="hnas"``); the result is detached. Raises a ``ValueError`` when there is none, or when
    their head counts differ (they cannot share one matrix).
    """
    if not isinstance(module, nn.Module):
        raise ValueError(f"hybrid_weights expects an nn.Module, got {type(module).__name__}")
    found = [
        (name, m.u)
        for name, m in module.named_modules()
        if isinstance(m, (MultiheadAttention, MultiViewAttention, ContentAttention)) and m.theta is not None
    ]
    if not found:
        raise ValueError(
            f"{type(module).__name__} has no hnas attention module; build its attention with mechanism='hnas'"
        )
    heads = {u.shape[0] for _, u in found}
    if len(heads) > 1:
        detail = ", ".join(f"{name or '<root>'}: {u.shape[0]}" for name, u in found)
        raise ValueError(
            f"the hnas modules have different head counts ({detail}); collect their .u one by "
            "one"
        )
    return torch.stack([u for _, u in found])  # (layers, heads)
