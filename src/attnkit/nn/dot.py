r"""Dot-product content attention: Luong et al., "Effective Approaches to Attention-based Neural Machine
Translation" (arXiv:1508.04025), section 3.1 ("dot"), and the scaled dot product of Vaswani et al., "Attention
Is
All You Need" (arXiv:1706.03762), eq. (1); lecture "Various Attention Score Functions":

.. math::
    e_{ij} = s_i^\top h_j \quad\text{or}\quad e_{ij} = \frac{s_i^\top h_j}{\sqrt{d}}, \qquad
    \alpha = \mathrm{normalize}(e), \qquad c_i = \sum_j \alpha_{ij} h_j

No parameters but the hybrid weight ``theta`` of ``mechanism="hnas"`` (which takes the inputs' dtype); queries
and keys must have the same size ``d``. With ``mechanism="coda"`` ``e`` is CoDA's ``E`` and the gate scores
are CoDA's ``N = -||s_i - h_j||_1 / sqrt(d)`` (``attnkit.scores.neg_l1_distance`` at its default scale, eq. 10
of "Compositional De-Attention Networks") whether or not ``scaled`` divides ``e``, as for every content score.
Shapes and masks as in :mod:`attnkit.nn.content`.
"""

from __future__ import annotations

import math
from typing import Optional

from torch import Tensor

from ..scores import dot, neg_l1_distance
from .content import ContentAttention

__all__ = ["DotAttention"]


class DotAttention(ContentAttention):
    """``DotAttention(dim=None, scaled=False, mechanism="softmax")``: ``scaled`` divides by ``sqrt(d)``.

    ``dim`` (optional) is checked against the inputs.
    ``forward(query, keys, values=None, key_mask=None, query_mask=None)``.
    """

    _supports_coda = True

    def __init__(self, dim: Optional[int] = None, scaled: bool = False, mechanism="softmax") -> None:
        super().__init__(mechanism)
        if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int) or dim < 1):
            raise ValueError(f"dim={dim!r}: expected a positive integer or None")
        if not isinstance(scaled, bool):
            raise ValueError(f"scaled={scaled!r}: expected True or False")
        self.dim, self.scaled = dim, scaled

    def score(self, q: Tensor, k: Tensor) -> Tensor:
        if q.shape[-1] != k.shape[-1] or (self.dim is not None and q.shape[-1] != self.dim):
            want = self.dim if self.dim is not None else k.shape[-1]
            raise ValueError(
                f"DotAttention needs queries and keys of one size; got query dim {q.shape[-1]} and key dim "
                f"{k.shape[-1]} (expected {want}); project one of them or use BilinearAttention"
            )
        scores = dot(q, k)  # (B, 1, Lq, Lk)
        return scores / math.sqrt(q.shape[-1]) if self.scaled else scores

    def gate_scores(self, q: Tensor, k: Tensor) -> Optional[Tensor]:
        return neg_l1_distance(q, k) if self.mechanism.name == "coda" else None

    def extra_repr(self) -> str:
        return f"dim={self.dim}, scaled={self.scaled}, mechanism={self.mechanism.name}"
