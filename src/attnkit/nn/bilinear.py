r"""Bilinear ("general") content attention of Luong et al., "Effective Approaches to Attention-based Neural
Machine Translation" (arXiv:1508.04025), section 3.1; lecture "Various Attention Score Functions":

.. math::
    e_{ij} = s_i^\top W h_j, \qquad \alpha = \mathrm{normalize}(e), \qquad c_i = \sum_j \alpha_{ij} h_j

The score is ``attnkit.scores.BilinearScore``; shapes and masks as in :mod:`attnkit.nn.content`.
"""

from __future__ import annotations

from torch import Tensor

from ..scores import BilinearScore
from .content import ContentAttention, check_size

__all__ = ["BilinearAttention"]


class BilinearAttention(ContentAttention):
    """``BilinearAttention(query_dim, key_dim, mechanism="softmax")``;
    ``forward(query, keys, values=None, key_mask=None, query_mask=None) -> (context, weights)``.

    Sizes must be positive integers; ``forward`` raises a ``ValueError`` for inputs whose feature sizes,
    dtype or device differ from the module's."""

    def __init__(self, query_dim: int, key_dim: int, mechanism="softmax") -> None:
        super().__init__(mechanism)
        self.query_dim = check_size(query_dim, f"BilinearAttention(query_dim={query_dim!r})")
        self.key_dim = check_size(key_dim, f"BilinearAttention(key_dim={key_dim!r})")
        self.scorer = BilinearScore(self.query_dim, self.key_dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        self.scorer.reset_parameters()

    def score(self, q: Tensor, k: Tensor) -> Tensor:
        return self.scorer(q, k)  # (B, 1, Lq, Lk)
