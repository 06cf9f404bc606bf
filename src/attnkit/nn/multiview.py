r"""Multi-view attention fusion for VQA.

"Attention that does not Explain Away" (arXiv:2009.14308), section 6.1 and Appendix B (multi-view attention
model),
after Yu et al. (2019); "Doubly-Normalized Attention" section 7.1 describes the earlier version, in which the
secondary views also gave the values through a transformation. This module implements the later
version (Appendix B), whose equations read, for a primary view ``p`` with features
``x^p_i`` (``i = 1..Lp``) and secondary views ``s`` with features ``x^s_j`` (``j = 1..Ls``):

.. math::
    q_i = W_Q x^p_i + b_Q, \qquad k^s_j = W_K x^s_j + b_K
    \quad\text{(queries from the primary view, keys from each secondary view)}

    \pi^s = \text{normalize}\big(q\, (k^s)^T / \sqrt{d'}\big)
    \quad\text{(LNAS: softmax over } j\text{; DNAS: over } i \text{ then } j\text{; HNAS: } u\pi^D +
    (1-u)\pi^L)

    y^p_i = x^p_i, \qquad y^s_i = \sum_j \pi^s_{ij}\, x^s_j
    \quad\text{(the values are the raw features: "it is better to directly use the features as the values")}

    z_i = \text{LayerNorm}\Big(y^p_i + \sum_s y^s_i\Big)
    \quad\text{(element-wise sum of the views, then layer normalization)}

so ``3 x 100`` box features become ``100`` fused features. With ``num_heads = H``, ``q`` and ``k^s``
are split into ``H`` heads of ``d'/H`` and the raw features into ``H`` chunks of ``d/H`` (head ``h``
mixes chunk ``h``); the paper found ``H = 1`` best. Dropout acts on the attention weights; HNAS
uses one learnable ``u = sigmoid(theta)`` per head, shared by the views of this single layer,
initialised to 0.5 as in the paper.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch import Tensor, nn

from ..config import MechanismLike
from ..functional import BACKENDS, attention
from ..validators import NotScriptable
from .module_utils import HybridWeightMixin, canonical_mask, mechanism_label, resolve_module_mechanism

__all__ = ["MultiViewAttention"]


class MultiViewAttention(HybridWeightMixin, NotScriptable, nn.Module):
    r"""Fuse a primary view with ``num_views`` secondary views by attention (Appendix B, "Attention that does
    not Explain Away").

    Args:
        embed_dim: feature size ``d`` of every view.
        num_views: number of secondary views (2 in the paper: three detectors, one primary).
        num_heads: heads ``H`` (``embed_dim`` and ``attn_dim`` must be divisible by ``H``).
        attn_dim: query/key size ``d'`` (default ``embed_dim``).
        mechanism: any of ``ak.MECHANISMS`` or a config object; ``u0`` for hnas as in ``MultiheadAttention``.
        dropout: dropout on the attention weights (training mode only).
        share_key_proj: one key transformation ``W_K`` for all secondary views (the paper's), or one per view.

    Shapes: ``primary (B, Lp, d)``, ``secondary[s] (B, Ls, d)`` -> ``(B, Lp, d)``; with
    ``return_weights`` also a list of ``(B, H, Lp, Ls)`` weights, one per secondary view.
    ``query_padding_mask (B, Lp)`` and ``key_padding_masks[s] (B, Ls)`` are True for padded boxes
    (padded primary boxes stay out of the dnas/hnas/sinkhorn column sums; their output is
    ``LayerNorm(x^p_i)``).
    """

    def __init__(
        self,
        embed_dim: int,
        num_views: int = 2,
        num_heads: int = 1,
        attn_dim: Optional[int] = None,
        mechanism: MechanismLike = "softmax",
        dropout: float = 0.0,
        bias: bool = True,
        share_key_proj: bool = True,
        layer_norm_eps: float = 1e-5,
        u0: Optional[float] = None,
        backend: str = "auto",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        attn_dim = embed_dim if attn_dim is None else attn_dim
        for name, value in (("embed_dim", embed_dim), ("num_views", num_views), ("num_heads", num_heads),
                            ("attn_dim", attn_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}={value!r}; expected a positive integer")
        for name, value in (("embed_dim", embed_dim), ("attn_dim", attn_dim)):
            if value % num_heads != 0:
                raise ValueError(f"{name}={value} is not divisible by num_heads={num_heads}")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout={dropout!r}; expected a probability in [0, 1)")
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}; expected one of {BACKENDS}")
        self.config = resolve_module_mechanism(mechanism, u0)
        self.embed_dim = embed_dim
        self.num_views = num_views
        self.num_heads = num_heads
        self.attn_dim = attn_dim
        self.dropout = float(dropout)
        self.backend = backend
        self.q_proj = nn.Linear(embed_dim, attn_dim, bias=bias, **factory)
        n_key = 1 if share_key_proj else num_views
        self.k_projs = nn.ModuleList(
            nn.Linear(embed_dim, attn_dim, bias=bias, **factory) for _ in range(n_key)
        )
        self.norm = nn.LayerNorm(embed_dim, eps=layer_norm_eps, **factory)
        self._init_hybrid_weight(num_heads, **factory)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for linear in [self.q_proj, *self.k_projs]:
            nn.init.xavier_uniform_(linear.weight)
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        self.norm.reset_parameters()
        self._reset_hybrid_weight()

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_views={self.num_views}, num_heads={self.num_heads}, "
            f"attn_dim={self.attn_dim}, mechanism={mechanism_label(self.config)}"
        )

    def forward(
        self,
        primary: Tensor,
        secondary: Sequence[Tensor],
        query_padding_mask: Optional[Tensor] = None,
        key_padding_masks: Optional[Sequence[Optional[Tensor]]] = None,
        return_weights: bool = False,
    ) -> Union[Tensor, tuple[Tensor, list[Tensor]]]:
        B, Lp, E = self._check_inputs(primary, secondary)
        masks = self._check_masks(query_padding_mask, key_padding_masks, secondary, B, Lp, primary.dtype)
        query_mask = None if query_padding_mask is None else ~masks[0]
        H, Dq, Dv = self.num_heads, self.attn_dim // self.num_heads, E // self.num_heads
        q = self.q_proj(primary).view(B, Lp, H, Dq).transpose(1, 2)  # (B, H, Lp, d'/H)
        u = self._hybrid_weight()
        total = primary  # y^p = x^p
        weights = []
        for s, x in enumerate(secondary):
            Ls = x.shape[1]
            k_proj = self.k_projs[s if len(self.k_projs) > 1 else 0]
            k = k_proj(x).view(B, Ls, H, Dq).transpose(1, 2)  # (B, H, Ls, d'/H)
            v = x.view(B, Ls, H, Dv).transpose(1, 2)  # (B, H, Ls, d/H): the raw features
            key_padding = masks[1 + s]
            result = attention(
                q, k, v, self.config,
                key_mask=None if key_padding is None else ~key_padding,
                query_mask=query_mask,
                dropout_p=self.dropout if self.training else 0.0,
                hybrid_weight=u,
                return_weights=return_weights,
                backend=self.backend,
            )
            y, w = result if return_weights else (result, None)
            total = total + y.transpose(1, 2).reshape(B, Lp, E)  # (B, H, Lp, d/H) -> (B, Lp, d)
            if w is not None:
                weights.append(w)
        out = self.norm(total)
        return (out, weights) if return_weights else out

    def _check_inputs(self, primary: Tensor, secondary: Sequence[Tensor]) -> tuple[int, int, int]:
        if not isinstance(primary, Tensor) or primary.dim() != 3 or primary.shape[-1] != self.embed_dim:
            got = tuple(primary.shape) if isinstance(primary, Tensor) else type(primary).__name__
            raise ValueError(f"primary has shape {got}, expected (B, Lp, embed_dim={self.embed_dim})")
        if isinstance(secondary, Tensor) or len(secondary) != self.num_views:
            n = "a tensor" if isinstance(secondary, Tensor) else f"{len(secondary)} views"
            raise ValueError(
                f"secondary is {n}; expected a list of num_views={self.num_views} tensors (B, "
                "Ls, d)"
            )
        B, Lp, E = primary.shape
        for s, x in enumerate(secondary):
            if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[0] != B or x.shape[-1] != E:
                got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
                raise ValueError(f"secondary[{s}] has shape {got}, expected (B, Ls, d) = ({B}, Ls, {E})")
        return B, Lp, E

    def _check_masks(self, query_padding_mask, key_padding_masks, secondary, B, Lp, dtype) -> list:
        if key_padding_masks is None:
            key_padding_masks = [None] * self.num_views
        if isinstance(key_padding_masks, Tensor) or len(key_padding_masks) != self.num_views:
            raise ValueError(
                f"key_padding_masks must be a list of num_views={self.num_views} masks (B, Ls) or None "
                "entries"
            )
        checked = []
        named = [("query_padding_mask", query_padding_mask, Lp)] + [
            (f"key_padding_masks[{s}]", m, x.shape[1])
            for s, (m, x) in enumerate(zip(key_padding_masks, secondary))
        ]
        for name, mask, L in named:
            if isinstance(mask, Tensor) and mask.device != secondary[0].device:
                raise ValueError(f"{name} is on {mask.device} but the inputs are on {secondary[0].device}; "
                                 f"move it with .to({str(secondary[0].device)!r})")
            mask = canonical_mask(mask, name, dtype)
            if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (B, L)):
                raise ValueError(
                    f"{name} has shape {tuple(mask.shape)} and dtype {mask.dtype}; expected a boolean (B, "
                    "L) = "
                    f"({B}, {L}) mask with True = padded box"
                )
            checked.append(mask)
        return checked
