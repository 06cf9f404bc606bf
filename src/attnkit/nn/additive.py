r"""Additive (MLP) content attention of Bahdanau et al., "Neural Machine Translation by Jointly Learning to
Align
and Translate" (arXiv:1409.0473), eq. (6) and Appendix A.1.2; lecture "Soft attention - math 2":

.. math::
    e_{ij} = v_a^\top \tanh(W_a s_{i-1} + U_a h_j), \qquad \alpha = \mathrm{normalize}(e), \qquad
    c_i = \sum_j \alpha_{ij} h_j

The score is ``attnkit.scores.AdditiveScore``; shapes and masks as in :mod:`attnkit.nn.content`.
"""

from __future__ import annotations

from torch import Tensor

from ..scores import AdditiveScore
from .content import ContentAttention, check_size

__all__ = ["AdditiveAttention"]


class AdditiveAttention(ContentAttention):
    """``AdditiveAttention(query_dim, key_dim, hidden_dim=None, mechanism="softmax")``; ``hidden_dim``
    defaults to
    ``key_dim``. ``forward(query, keys, values=None, key_mask=None, query_mask=None) -> (context, weights)``.

    Sizes must be positive integers; ``forward`` raises a ``ValueError`` for inputs whose feature sizes,
    dtype or device differ from the module's."""

    def __init__(
        self, query_dim: int, key_dim: int, hidden_dim: int | None = None, mechanism="softmax"
    ) -> None:
        super().__init__(mechanism)
        self.query_dim = check_size(query_dim, f"AdditiveAttention(query_dim={query_dim!r})")
        self.key_dim = check_size(key_dim, f"AdditiveAttention(key_dim={key_dim!r})")
        hidden_dim = check_size(hidden_dim, f"AdditiveAttention(hidden_dim={hidden_dim!r})", optional=True)
        hidden_dim = self.key_dim if hidden_dim is None else hidden_dim
        self.scorer = AdditiveScore(self.query_dim, self.key_dim, hidden_dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        self.scorer.reset_parameters()

    def score(self, q: Tensor, k: Tensor) -> Tensor:
        return self.scorer(q, k)  # (B, 1, Lq, Lk)
