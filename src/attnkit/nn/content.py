r"""Content-based attention for recurrent encoder-decoders: a score function, then any attnkit normalization.

Lecture "Attention and Transformers", soft attention math; Bahdanau et al., "Neural Machine Translation by
Jointly Learning to Align and Translate" (arXiv:1409.0473), eqs. (5)-(6):

.. math::
    e_{ij} = a(s_{i-1}, h_j), \qquad \alpha_{i\cdot} = \mathrm{normalize}(e_{i\cdot}), \qquad
    c_i = \sum_j \alpha_{ij} h_j

The score ``a`` is one of ``attnkit.scores`` (additive, bilinear, dot, scaled dot; see the subclasses in
``additive.py``, ``bilinear.py`` and ``dot.py``); the normalization is ``attnkit.normalize`` with any
mechanism (``"softmax"`` by default, which makes every row sum to 1 over the valid keys).

Shapes: ``query (B, Dq)`` (one decoder step) or ``(B, Lq, Dq)``; ``keys (B, Lk, Dk)``; ``values (B, Lk, Dv)``
(default: the keys); ``key_mask (B, Lk)`` bool, True = real; ``query_mask`` bool of the query's leading shape,
``(B,)`` or ``(B, Lq)``, True = real. Returns ``context (B, Dv)`` / ``(B, Lq, Dv)`` and ``weights (B, Lk)`` /
``(B, Lq, Lk)``. Padded keys get weight exactly 0 and padded queries take no part in any normalization
(the query-normalized mechanisms below sum over real queries only), so a padded batch gives, on its real
queries and keys, the result of each sequence alone; whatever the padded rows hold (even NaN or inf) never
matters. A padded query, or one with no valid key, gets zero weights and a zero context.

With ``mechanism="hnas"`` the module learns its hybrid weight as the multi-head modules do: one parameter
``theta`` (shape ``(1,)``, the module's one head), ``u = sigmoid(theta)`` (``.u``;
``attnkit.nn.hybrid_weights`` collects it), starting from the config's ``u0`` (``ak.Hybrid(u0=0.1)``).

Query-normalized mechanisms (``dnas``, ``hnas``, ``sinkhorn``) normalize over the queries passed in one call:
with one query per call (a decoder step, ``(B, Dq)``) they would see a single query and give uniform weights
(refused: ``ValueError``), and a decoder that passes all its steps at once would let step ``i`` see later
steps. ``attnkit.models.RNNSeq2Seq`` therefore accepts row-normalized mechanisms only.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from ..config import Hybrid
from ..functional import normalize
from ..registry import initial_theta, normalizes_over_queries, resolve_mechanism
from ..validators import NotScriptable, check_int
from .module_utils import HybridWeightAccess, check_like_parameters, zero_where

__all__ = ["ContentAttention"]


def _hidden_pairs(key_mask: Optional[Tensor], query_mask: Optional[Tensor]) -> Optional[Tensor]:
    """``(B, 1, Lq, Lk)`` True where a padded query or key hides the pair (``query_mask (B, Lq)``, ``key_mask
    (B, Lk)``; either may be None), or None when nothing is hidden."""
    if key_mask is None and query_mask is None:
        return None
    visible = True
    if key_mask is not None:
        visible = key_mask[:, None, None, :]  # (B, 1, 1, Lk)
    if query_mask is not None:
        visible = query_mask[:, None, :, None] & visible  # (B, 1, Lq, Lk | 1)
    return ~visible


class ContentAttention(HybridWeightAccess, NotScriptable, nn.Module):
    """Base class: ``score(q (B, 1, Lq, Dq), k (B, 1, Lk, Dk)) -> (B, 1, Lq, Lk)`` is given by subclasses.

    ``mechanism`` is the resolved config (``ak.Hybrid(...)``, ...); for hnas ``theta`` ``(1,)`` is the
    learnable hybrid weight (else ``None``) and ``u = sigmoid(theta)``."""

    def __init__(self, mechanism="softmax") -> None:
        super().__init__()
        self.mechanism = resolve_mechanism(mechanism)
        if self.mechanism.name == "coda" and not self._supports_coda:
            raise ValueError(
                f"{type(self).__name__} cannot use mechanism 'coda' (its gate needs queries and keys of one "
                f"size); "
                "use DotAttention for coda or pick another mechanism"
            )
        if isinstance(self.mechanism, Hybrid):
            self.theta = nn.Parameter(torch.empty(1))
        else:
            self.register_parameter("theta", None)
        self._reset_theta()

    def _reset_theta(self) -> None:
        if self.theta is not None:
            with torch.no_grad():
                self.theta.fill_(initial_theta(self.mechanism))
            self._theta_unset = self.theta.is_meta  # built on the meta device: no value yet

    def reset_parameters(self) -> None:
        """Re-initialize the learnable parameters (the hybrid weight to ``u0``; subclasses add theirs)."""
        self._reset_theta()

    def _hybrid_config(self):
        return self.mechanism

    _supports_coda = False
    query_dim: Optional[int] = None  # the feature sizes a subclass is built for (None: any)
    key_dim: Optional[int] = None

    def score(self, q: Tensor, k: Tensor) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def gate_scores(self, q: Tensor, k: Tensor) -> Optional[Tensor]:
        return None

    def forward(
        self,
        query: Tensor,
        keys: Tensor,
        values: Optional[Tensor] = None,
        key_mask: Optional[Tensor] = None,
        query_mask: Optional[Tensor] = None,
    ) -> tuple[Tensor, Tensor]:
        values = keys if values is None else values
        single = _check_inputs(query, keys, values, key_mask)
        if normalizes_over_queries(self.mechanism) and single:
            raise ValueError(
                f"mechanism={self.mechanism.name!r} normalizes over the queries of one call, and a single "
                "step (B, Dq) is one query: its weights would be uniform whatever the scores; pass all "
                "queries at once (B, Lq, Dq), or use a row-normalized mechanism such as 'softmax' for "
                "step-by-step decoding"
            )
        _check_query_mask(query_mask, query)
        self._check_against_module(query, keys)
        if single and query_mask is not None:
            query_mask = query_mask[:, None]  # (B, 1)
        query, keys, values = zero_padding(query, keys, values, key_mask, query_mask, single)
        q = (query[:, None] if single else query)[:, None]  # (B, 1, Lq, Dq)
        k = keys[:, None]  # (B, 1, Lk, Dk)
        scores = self.score(q, k)  # (B, 1, Lq, Lk)
        gate = self.gate_scores(q, k)
        hidden = _hidden_pairs(key_mask, query_mask)  # (B, 1, Lq | 1, Lk) or None
        if hidden is not None:
            # large finite padding (1e20 in float32, 200 in float16) can overflow a padded pair's score to
            # inf, which normalize refuses; those pairs get no weight, so their scores are set to 0
            scores = scores.masked_fill(hidden, 0.0)
            gate = None if gate is None else gate.masked_fill(hidden, 0.0)
        weights = normalize(
            scores, self.mechanism, key_mask=key_mask, query_mask=query_mask, gate_scores=gate,
            hybrid_weight=None if self.theta is None else self._hybrid_weight().to(scores.dtype),
        )  # (B, 1, Lq, Lk)
        weights = weights[:, 0]  # (B, Lq, Lk)
        context = weights @ values  # (B, Lq, Dv)
        if single:
            return context[:, 0], weights[:, 0]  # (B, Dv), (B, Lk)
        return context, weights

    def _check_against_module(self, query: Tensor, keys: Tensor) -> None:
        """The inputs' feature sizes, dtype and device must be those of the module."""
        name = type(self).__name__
        Dq, Dk, q_dim, k_dim = query.shape[-1], keys.shape[-1], self.query_dim, self.key_dim
        if (q_dim is not None and Dq != q_dim) or (k_dim is not None and Dk != k_dim):
            raise ValueError(
                f"{name}(query_dim={q_dim}, key_dim={k_dim}) got query {tuple(query.shape)} and keys "
                f"{tuple(keys.shape)}; pass query (B, {q_dim}) or (B, Lq, {q_dim}) and keys "
                f"(B, Lk, {k_dim}), or build the module with query_dim={Dq}, key_dim={Dk}"
            )
        # the score's parameters fix the dtype; the hybrid weight alone (DotAttention with hnas) takes the
        # inputs' dtype, as the module without it does, and must only share their device
        weight = next((p for n, p in self.named_parameters() if n != "theta"), None)
        if weight is not None:
            check_like_parameters(query, weight, "the inputs", name, plural=True)
        elif self.theta is not None and self.theta.device != query.device:
            raise ValueError(
                f"{name}'s hybrid weight theta is on {self.theta.device} but the inputs are on "
                f"{query.device}; move the module with .to({str(query.device)!r})"
            )

    def extra_repr(self) -> str:
        return f"mechanism={self.mechanism.name}"


def check_size(value, what: str, *, optional: bool = False) -> Optional[int]:
    """``value`` if it is a positive integer (or ``None`` when ``optional``); ``what`` names it in the error,
    e.g. ``"AdditiveAttention(hidden_dim=0)"``."""
    if optional and value is None:
        return None
    return check_int(value, what, "expected a positive integer" + (" or None" if optional else ""), low=1)


def _check_inputs(query: Tensor, keys: Tensor, values: Tensor, key_mask: Optional[Tensor]) -> bool:
    """Validate shapes; return whether ``query`` is a single step ``(B, Dq)``."""
    if not isinstance(query, Tensor) or query.dim() not in (2, 3):
        got = tuple(query.shape) if isinstance(query, Tensor) else type(query).__name__
        raise ValueError(f"query has shape {got}; expected (B, Dq) or (B, Lq, Dq)")
    if not isinstance(keys, Tensor) or keys.dim() != 3 or keys.shape[0] != query.shape[0]:
        got = tuple(keys.shape) if isinstance(keys, Tensor) else type(keys).__name__
        raise ValueError(f"keys has shape {got}; expected (B, Lk, Dk) with B = {query.shape[0]}")
    B, Lk = keys.shape[:2]
    if not isinstance(values, Tensor) or values.dim() != 3 or tuple(values.shape[:2]) != (B, Lk):
        got = tuple(values.shape) if isinstance(values, Tensor) else type(values).__name__
        raise ValueError(f"values has shape {got}; expected (B, Lk, Dv) = ({B}, {Lk}, Dv)")
    for name, t in (("keys", keys), ("values", values)):
        if t.device != query.device:
            raise ValueError(
                f"query is on {query.device} but {name} is on {t.device}; move one with .to(device)"
            )
    for name, t in (("query", query), ("keys", keys), ("values", values)):
        if not t.dtype.is_floating_point:
            raise ValueError(f"{name} has dtype {t.dtype}; expected a floating dtype (cast it with .float())")
    if not (query.dtype == keys.dtype == values.dtype) and not torch.is_autocast_enabled(query.device.type):
        raise ValueError(
            f"query, keys, values have dtypes {query.dtype}, {keys.dtype}, {values.dtype}; expected one "
            "dtype (cast them with .to(dtype))"
        )
    check_key_mask(key_mask, B, Lk)
    if key_mask is not None and key_mask.device != keys.device:
        raise ValueError(
            f"key_mask is on {key_mask.device} but keys are on {keys.device}; move it with .to(device)"
        )
    return query.dim() == 2


def _check_query_mask(query_mask: Optional[Tensor], query: Tensor) -> None:
    """``query_mask`` must be ``None`` or a bool tensor of the query's leading shape, ``(B,)`` or
    ``(B, Lq)``."""
    if query_mask is None:
        return
    want = tuple(query.shape[:-1])
    mask = query_mask
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != want:
        got = (
            (tuple(query_mask.shape), query_mask.dtype)
            if isinstance(query_mask, Tensor)
            else type(query_mask).__name__
        )
        names = "(B,)" if query.dim() == 2 else "(B, Lq)"
        raise ValueError(
            f"query_mask is {got}; expected a bool tensor of shape {names} = {want} (the query's shape "
            "without its feature size), True = real"
        )
    if query_mask.device != query.device:
        raise ValueError(
            f"query_mask is on {query_mask.device} but query is on {query.device}; move it with .to(device)"
        )


def zero_padding(
    query: Tensor,
    keys: Tensor,
    values: Tensor,
    key_mask: Optional[Tensor],
    query_mask: Optional[Tensor] = None,
    single: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """Zero the padded keys, values (``key_mask (B, Lk)`` False) and queries (``query_mask`` False, ``(B, 1)``
    for a single step ``query (B, Dq)``, else ``(B, Lq)``) so that whatever they hold never matters.

    Padded pairs weigh exactly 0, but ``0 * nan = nan`` in ``weights @ values`` and a NaN score is an error:
    a select (``torch.where``, never a multiplication) makes "padding = truncation" hold for NaN and inf too,
    and passes zero gradients to the padded rows (and finite ones to the real rows). As in
    ``attnkit.attention``.
    """
    if key_mask is not None:
        keep = key_mask[:, :, None]  # (B, Lk, 1)
        keys = zero_where(keep, keys)  # (B, Lk, Dk)
        values = keys if values is keys else zero_where(keep, values)  # (B, Lk, Dv)
    if query_mask is not None:
        keep_q = query_mask if single else query_mask[:, :, None]  # (B, 1) or (B, Lq, 1)
        query = zero_where(keep_q, query)  # (B, Dq) or (B, Lq, Dq)
    return query, keys, values



def check_key_mask(key_mask: Optional[Tensor], B: int, Lk: int) -> None:
    """``key_mask`` must be a bool ``(B, Lk)`` tensor (True = real) or ``None``."""
    if key_mask is None:
        return
    if not isinstance(key_mask, Tensor) or key_mask.dtype != torch.bool or tuple(key_mask.shape) != (B, Lk):
        got = (
            (tuple(key_mask.shape), key_mask.dtype)
            if isinstance(key_mask, Tensor)
            else type(key_mask).__name__
        )
        raise ValueError(
            f"key_mask is {got}; expected a bool tensor of shape (B, Lk) = ({B}, {Lk}), True = real"
        )
