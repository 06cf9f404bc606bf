"""Doubly-normalized attention (DNAS).

"Doubly-Normalized Attention", eqs. (6)-(8); docs/design.md section 2. First normalize over the
queries of each key, then over the keys of each query:

    xi_ji = exp(s_ij - c_j),   c_j = LSE_i s_ij            (over valid queries i)
    pi_ij = xi_ji / sum_j' xi_j'i  =  softmax_j(s_ij - c_j)

so DNAS is softmax attention with the per-key bias ``-c_j``.

Invariant (Lemma 1, "Doubly-Normalized Attention" Appendix B): every key with at least one valid query
receives
``sum_i pi_ij >= 1 / n_k``, ``n_k`` the number of valid keys — no key is fully explained away.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from .masked import masked_logsumexp
from .softmax import softmax_weights

__all__ = ["dnas_weights", "key_log_normalizer"]


def key_log_normalizer(scores: Tensor, valid: Optional[Tensor] = None) -> Tensor:
    """``c_j = LSE_i s_ij`` over valid queries, shape ``(B, H, 1, Lk)`` (0 for keys without a valid query)."""
    return masked_logsumexp(scores, valid, dim=-2)


def dnas_weights(scores: Tensor, valid: Optional[Tensor] = None) -> Tensor:
    """Doubly-normalized weights ``(B, H, Lq, Lk)`` from scores ``(B, H, Lq, Lk)``."""
    c = key_log_normalizer(scores, valid)  # (B, H, 1, Lk)
    return softmax_weights(scores - c, valid)
