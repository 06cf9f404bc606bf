r"""Mixed content + location attention ("location-aware attention") of Chorowski et al., "Attention-Based
Models
for Speech Recognition" (arXiv:1506.07503), section 2.2, eqs. (8)-(9); lecture "Various Soft-Attentions: mix
content-based and location-based attentions":

.. math::
    f_i = F * \alpha_{i-1}, \qquad
    e_{ij} = w^\top \tanh(W s_{i-1} + V h_j + U f_{ij} + b), \qquad
    \alpha_i = \mathrm{normalize}(e_i), \qquad c_i = \sum_j \alpha_{ij} h_j

``F`` is a 1-D convolution with ``num_filters`` filters of width ``kernel_size`` (odd, zero padding, "same"
length) over the previous alignment ``alpha_{i-1}``. The score is ``attnkit.scores.additive`` with the keys
extended by the location features (``[h_j; f_ij]`` and ``[V, U]``), so the content part is exactly Bahdanau's.

Shapes: ``query (B, Dq)`` (one step), ``keys (B, Lk, Dk)``, ``values (B, Lk, Dv)`` (default keys),
``prev_weights (B, Lk)`` (``initial_weights(key_mask)`` for the first step: all mass on the first real key),
``key_mask (B, Lk)``. Returns ``context (B, Dv)`` and ``weights (B, Lk)``; padded keys get weight 0 and do not
change the features of real keys, so padding = truncation (whatever the padded keys and values hold, NaN
and inf included). No key (``Lk = 0``, or every key masked) gives a zero context.

A decoder step has one query, so the mechanism must be row-normalized (``softmax``); the query-normalized ones
(``dnas``, ``hnas``, ``sinkhorn``) would give uniform weights and are refused, as in
``attnkit.models.RNNSeq2Seq``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn

from ..registry import normalizes_over_queries, resolve_mechanism
from ..functional import normalize
from ..scores import additive
from ..validators import NotScriptable
from .content import check_key_mask, zero_padding
from .module_utils import all_finite

__all__ = ["MixedAttention"]


class MixedAttention(NotScriptable, nn.Module):
    """``MixedAttention(query_dim, key_dim, hidden_dim=None, num_filters=8, kernel_size=15,
    mechanism="softmax")``.

    ``forward(query, keys, prev_weights, values=None, key_mask=None) -> (context, weights)``.
    """

    def __init__(
        self,
        query_dim: int,
        key_dim: int,
        hidden_dim: Optional[int] = None,
        num_filters: int = 8,
        kernel_size: int = 15,
        mechanism="softmax",
    ) -> None:
        super().__init__()
        hidden_dim = key_dim if hidden_dim is None else hidden_dim
        for name, value in (
            ("query_dim", query_dim),
            ("key_dim", key_dim),
            ("hidden_dim", hidden_dim),
            ("num_filters", num_filters),
            ("kernel_size", kernel_size),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: expected a positive integer")
        if kernel_size % 2 == 0:
            raise ValueError(
                f"kernel_size={kernel_size}: expected an odd width (the features keep the length)"
            )
        self.mechanism = resolve_mechanism(mechanism)
        if self.mechanism.name == "coda":
            raise ValueError(
                "MixedAttention cannot use mechanism 'coda'; pick softmax or another normalization"
            )
        if normalizes_over_queries(self.mechanism):
            raise ValueError(
                f"mechanism={self.mechanism.name!r} normalizes over queries, but MixedAttention sees one "
                "query per step (its weights would be uniform); use a row-normalized mechanism such as "
                "'softmax'"
            )
        self.conv = nn.Conv1d(1, num_filters, kernel_size, padding=kernel_size // 2, bias=False)
        self.w_q = nn.Parameter(torch.empty(hidden_dim, query_dim))
        self.w_k = nn.Parameter(torch.empty(hidden_dim, key_dim))
        self.w_f = nn.Parameter(torch.empty(hidden_dim, num_filters))
        self.bias = nn.Parameter(torch.empty(hidden_dim))
        self.w = nn.Parameter(torch.empty(hidden_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.conv.reset_parameters()
        for p in (self.w_q, self.w_k, self.w_f):
            nn.init.xavier_uniform_(p)
        nn.init.zeros_(self.bias)
        bound = 1 / math.sqrt(self.w.numel())
        nn.init.uniform_(self.w, -bound, bound)

    @staticmethod
    def initial_weights(key_mask: Tensor) -> Tensor:
        """All mass on the first real key of each row: ``(B, Lk)`` from ``key_mask (B, Lk)``."""
        first = key_mask.long().argmax(dim=1)  # (B,) index of the first True
        weights = torch.zeros(key_mask.shape, dtype=torch.get_default_dtype(), device=key_mask.device)
        has_key = key_mask.any(dim=1)
        weights[torch.arange(len(first), device=first.device)[has_key], first[has_key]] = 1.0
        return weights  # (B, Lk)

    def forward(
        self,
        query: Tensor,
        keys: Tensor,
        prev_weights: Tensor,
        values: Optional[Tensor] = None,
        key_mask: Optional[Tensor] = None,
    ) -> tuple[Tensor, Tensor]:
        values = keys if values is None else values
        Dq, Dk = self.w_q.shape[1], self.w_k.shape[1]
        if not isinstance(query, Tensor) or query.dim() != 2 or query.shape[1] != Dq:
            got = tuple(query.shape) if isinstance(query, Tensor) else type(query).__name__
            raise ValueError(
                f"query has shape {got}; expected (B, query_dim) = (B, {Dq}) (one step), or build the module "
                "with the query's size as query_dim"
            )
        B = query.shape[0]
        if not isinstance(keys, Tensor) or keys.dim() != 3 or keys.shape[0] != B or keys.shape[2] != Dk:
            got = tuple(keys.shape) if isinstance(keys, Tensor) else type(keys).__name__
            raise ValueError(
                f"keys has shape {got}; expected (B, Lk, key_dim) = ({B}, Lk, {Dk}), or build the module "
                "with the keys' size as key_dim"
            )
        Lk = keys.shape[1]
        if not isinstance(prev_weights, Tensor) or tuple(prev_weights.shape) != (B, Lk):
            got = (
                tuple(prev_weights.shape) if isinstance(prev_weights, Tensor) else type(prev_weights).__name__
            )
            raise ValueError(
                f"prev_weights has shape {got}; expected (B, Lk) = ({B}, {Lk}); see initial_weights"
            )
        if not isinstance(values, Tensor) or values.dim() != 3 or tuple(values.shape[:2]) != (B, Lk):
            got = tuple(values.shape) if isinstance(values, Tensor) else type(values).__name__
            raise ValueError(f"values has shape {got}; expected (B, Lk, Dv) = ({B}, {Lk}, Dv)")
        self._check_dtypes_and_devices(query, keys, values, prev_weights)
        check_key_mask(key_mask, B, Lk)
        if key_mask is not None:
            if key_mask.device != keys.device:
                raise ValueError(
                    f"key_mask is on {key_mask.device} but keys are on {keys.device}; "
                    "move it with .to(device)"
                )
            prev_weights = prev_weights.masked_fill(~key_mask, 0.0)
            query, keys, values = zero_padding(query, keys, values, key_mask)  # NaN in padding never matters
        if prev_weights.device.type == "cpu" and not all_finite(prev_weights):  # no GPU sync
            raise ValueError(
                "prev_weights contains NaN or inf on a real key; pass the weights of the previous step "
                "(initial_weights(key_mask) for the first)"
            )
        if Lk == 0:  # nothing to attend to: a zero context, as ContentAttention gives
            return values.new_zeros(B, values.shape[2]), values.new_zeros(B, 0)
        features = self.conv(prev_weights[:, None, :].to(keys.dtype)).transpose(1, 2)  # (B, Lk, F)
        extended = torch.cat([keys, features], dim=-1)[:, None]  # (B, 1, Lk, Dk + F)
        w_kf = torch.cat([self.w_k, self.w_f], dim=1)  # (A, Dk + F)
        scores = additive(
            query[:, None, None, :], extended, self.w_q, w_kf, self.w, self.bias
        )  # (B, 1, 1, Lk)
        weights = normalize(scores, self.mechanism, key_mask=key_mask)[:, 0, 0]  # (B, Lk)
        context = (weights[:, None, :] @ values)[:, 0]  # (B, Dv)
        return context, weights

    def _check_dtypes_and_devices(self, query: Tensor, keys: Tensor, values: Tensor, prev: Tensor) -> None:
        weight = self.w_q
        for name, t in (("query", query), ("keys", keys), ("values", values), ("prev_weights", prev)):
            if not t.dtype.is_floating_point:
                raise ValueError(
                    f"{name} has dtype {t.dtype}; expected a floating dtype (cast it with .float())"
                )
            if t.device != weight.device:
                raise ValueError(
                    f"{name} is on {t.device} but MixedAttention's parameters are on {weight.device}; "
                    "move one with .to(device)"
                )
        if torch.is_autocast_enabled(query.device.type):  # mixed dtypes are autocast's to reconcile
            return
        for name, t in (("query", query), ("keys", keys), ("values", values)):
            if t.dtype != weight.dtype:
                raise ValueError(
                    f"{name} has dtype {t.dtype} but MixedAttention's parameters are {weight.dtype}; cast "
                    f"the inputs with .to({weight.dtype}) or the module with .to({t.dtype})"
                )

    def extra_repr(self) -> str:
        return (
            f"num_filters={self.conv.out_channels}, kernel_size={self.conv.kernel_size[0]}, "
            f"mechanism={self.mechanism.name}"
        )
