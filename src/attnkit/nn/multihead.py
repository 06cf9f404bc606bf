r"""A drop-in ``torch.nn.MultiheadAttention`` with a choice of normalization.

Vaswani et al. multi-head attention ("Attention Is All You Need", arXiv:1706.03762, "multi-head");
the normalizations of docs/design.md section 2: softmax (LNAS, "Doubly-Normalized Attention" eq. 3), DNAS
("Doubly-Normalized Attention" eqs. 6-8), HNAS ("Doubly-Normalized Attention" section 6; "Attention that does
not Explain Away" (arXiv:2009.14308) section 5, one ``u`` per layer and head), Sinkhorn ("Attention that does
not Explain Away" section 3.2) and CoDA ("Compositional De-Attention Networks" eqs. 1-10).

.. math::
    q = x_q W_Q^T + b_Q,\quad k = x_k W_K^T + b_K,\quad v = x_v W_V^T + b_V \quad\text{(split into H heads)}

    \text{head}_h = \pi_h v_h,\quad \pi_h = \text{normalize}(q_h k_h^T / \sqrt{D})

    \text{out} = [\text{head}_1, \dots, \text{head}_H] W_O^T + b_O

The parameters, call signature, mask conventions and return values are those of
``torch.nn.MultiheadAttention``; the math goes through ``attnkit.functional.attention``.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from ..config import CoDA, MechanismLike
from ..functional import (
    BACKENDS, attention, check_causal_pattern, check_constant_key_bias, observed_query_padding, observing,
)
from ..masks import MASKED_BIAS, build_mask, check_dense
from ..registry import normalizes_over_queries
from ..validators import NotScriptable, check_not_traced, check_number, values_hidden
from .module_utils import (
    HybridWeightMixin,
    append_columns,
    canonical_mask,
    flag,
    mechanism_label,
    positive_int,
    same_tensor,
    resolve_module_mechanism,
    to_additive,
)

__all__ = ["MultiheadAttention"]


class MultiheadAttention(HybridWeightMixin, NotScriptable, nn.Module):
    r"""Multi-head attention with ``mechanism`` in ``softmax | dnas | hnas | sinkhorn | coda``.

    With ``mechanism="softmax"`` it computes what ``torch.nn.MultiheadAttention`` computes (same
    parameter names, so a torch ``state_dict`` loads; into an hnas module too, whose ``theta`` then keeps
    its value, ``logit(u0)`` in a new module). ``mechanism="hnas"`` adds one parameter,
    ``theta`` of shape ``(H,)``, with the per-head hybrid weight ``u = sigmoid(theta)``
    (initialised to ``u0`` from ``ak.Hybrid(u0=...)`` or the ``u0`` argument, default 0.5):

    .. math::
        \pi^H_h = u_h \pi^D_h + (1 - u_h) \pi^L_h

    Masks follow torch: ``key_padding_mask`` True = ignore (or float additive), ``attn_mask`` boolean
    True = not allowed (or float additive) of shape ``(Lq, Lk)`` or ``(B*H, Lq, Lk)``.

    **Query padding.** dnas, hnas and sinkhorn normalize each key's column over the queries, so padded queries
    must stay out of it. ``query_padding_mask (B, Lq)`` (True = ignore) marks them; when it is not given and
    the call is self-attention (``query`` and ``key`` one tensor, or two views of the same elements) with a
    ``key_padding_mask`` of equal length, the key padding is used for the queries too (for every mechanism but
    softmax, whose real-token outputs do not depend on other queries and whose padded outputs stay as torch
    computes them). Padded queries then get a zero attention output (``out_proj.bias`` after the projection).

    The positional arguments, their defaults (``batch_first=False``, ``need_weights=True``,
    ``average_attn_weights=True``) and the returned ``(out, weights)`` are torch's; ``mechanism``,
    ``u0`` and ``backend`` are keyword-only additions.

    Shapes: query ``(Lq, B, E)``, key ``(Lk, B, kdim)``, value ``(Lk, B, vdim)`` -> out ``(Lq, B, E)``
    (``(B, L, *)`` everywhere with ``batch_first=True``); weights ``(B, Lq, Lk)`` (averaged over heads)
    or ``(B, H, Lq, Lk)`` in both layouts.
    Unbatched inputs ``(L, E)`` give ``(Lq, E)`` and ``(Lq, Lk)`` / ``(H, Lq, Lk)``. ``Lk`` counts the
    extra keys of ``add_bias_kv`` / ``add_zero_attn``.

    In torch's ``nn.TransformerEncoderLayer`` / ``nn.TransformerEncoder`` the module is always called (their
    fused softmax inference path is not taken), and a nested tensor (torch's encoder nests padded batches in
    eval mode) is self-attention over each of its sequences, returned nested.

    **Attention dropout** (``dropout > 0``, training mode) keeps each weight with probability
    ``1 - dropout`` and scales it by ``1 / (1 - dropout)``, as torch does; which numbers are drawn depends on
    the route. On the CPU the default route (``backend="auto"`` with ``need_weights=False``: the C++ kernels,
    softmax included) takes one seed from torch's default generator and hashes the keep mask from it (the
    backward pass replays it; the rate is rounded to a multiple of ``2**-16``): the same distribution, but
    for the same ``torch.manual_seed`` the masks, and the generator's state afterwards, differ from
    ``torch.nn.MultiheadAttention``'s. ``backend="reference"`` applies ``F.dropout`` to the materialized
    weights, as torch's ``need_weights=True`` path does, and so reproduces torch's masks and generator state
    for the same seed (on the CPU for ``need_weights=False`` too); ``need_weights=True`` and an active
    ``attnkit.functional.observe_weights`` take that route as well, so they switch the draws from the hashed
    mask to torch's.

    Invariants: disallowed pairs weigh 0 and a query with no allowed key gets a zero attention output
    (torch gives NaN there for ``-inf`` or ``True`` masks, and uniform weights when every key of the query
    is masked by a large finite negative such as ``-1e9``, which attnkit counts as not allowed);
    ``is_causal=True`` raises a ``ValueError`` for dnas/hnas/sinkhorn.
    """

    __constants__ = ["batch_first"]

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: Optional[int] = None,
        vdim: Optional[int] = None,
        batch_first: bool = False,
        device=None,
        dtype=None,
        *,
        mechanism: MechanismLike = "softmax",
        u0: Optional[float] = None,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        embed_dim = positive_int(embed_dim, "embed_dim")
        num_heads = positive_int(num_heads, "num_heads")
        if embed_dim % num_heads != 0:
            raise ValueError(
                f"embed_dim={embed_dim} is not divisible by num_heads={num_heads}; each head gets "
                f"embed_dim // num_heads features (e.g. num_heads in {_divisors(embed_dim)})"
            )
        kdim = None if kdim is None else positive_int(kdim, "kdim", " or None (= embed_dim)")
        vdim = None if vdim is None else positive_int(vdim, "vdim", " or None (= embed_dim)")
        dropout = check_number(
            dropout, f"dropout={dropout!r}", "expected a probability in [0, 1)", low=0.0, high=1.0,
            high_open=True, sep="; ",
        )
        bias, add_bias_kv, add_zero_attn = (
            flag(bias, "bias"), flag(add_bias_kv, "add_bias_kv"), flag(add_zero_attn, "add_zero_attn")
        )
        batch_first = flag(batch_first, "batch_first")
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}; expected one of {BACKENDS}")

        self.config = resolve_module_mechanism(mechanism, u0)
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._same_dims = self.kdim == embed_dim and self.vdim == embed_dim  # one in_proj_weight
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = float(dropout)
        self.batch_first = batch_first
        self.add_zero_attn = add_zero_attn
        self.backend = backend

        if self._same_dims:
            self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim, **factory))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty(embed_dim, embed_dim, **factory))
            self.k_proj_weight = nn.Parameter(torch.empty(embed_dim, self.kdim, **factory))
            self.v_proj_weight = nn.Parameter(torch.empty(embed_dim, self.vdim, **factory))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        # torch's class: dynamic quantization leaves it alone, as it does torch's module's (the forward
        # reads its weight's device and dtype)
        self.out_proj = NonDynamicallyQuantizableLinear(embed_dim, embed_dim, bias=bias, **factory)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty(1, 1, embed_dim, **factory))
            self.bias_v = nn.Parameter(torch.empty(1, 1, embed_dim, **factory))
        else:
            self.bias_k = self.bias_v = None
        self._init_hybrid_weight(num_heads, **factory)
        self._init_projections()  # out_proj was just built: the numbers torch's module draws

    def _reset_parameters(self) -> None:
        """torch's name for ``reset_parameters`` (code written for torch's module calls it)."""
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """torch's initialisation: ``out_proj`` as ``nn.Linear``, Xavier-uniform input projections, zero
        biases, Xavier-normal ``bias_k/v``; ``theta = logit(u0)``. A seeded construction draws exactly the
        numbers ``torch.nn.MultiheadAttention`` draws; after ``to_empty()`` no leftover memory stays (torch's
        own reset leaves ``out_proj.weight`` as it was)."""
        self.out_proj.reset_parameters()
        self._init_projections()

    def _init_projections(self) -> None:
        if self._same_dims:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            nn.init.xavier_uniform_(self.q_proj_weight)
            nn.init.xavier_uniform_(self.k_proj_weight)
            nn.init.xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.zeros_(self.in_proj_bias)
            nn.init.zeros_(self.out_proj.bias)
        if self.bias_k is not None:
            nn.init.xavier_normal_(self.bias_k)
            nn.init.xavier_normal_(self.bias_v)
        self._reset_hybrid_weight()

    @property
    def _qkv_same_embed_dim(self) -> bool:
        """False, always: torch's ``TransformerEncoderLayer`` and ``TransformerEncoder`` (in eval mode without
        gradients) run their own fused softmax on ``in_proj_weight`` instead of calling ``self_attn`` when
        this flag is True, so this module placed in them would silently compute softmax attention. With
        False they call :meth:`forward`. (Whether q, k and v share ``in_proj_weight`` is
        ``in_proj_weight is not None``.)"""
        return False

    def __setstate__(self, state: dict) -> None:
        if "_qkv_same_embed_dim" in state:  # a whole module pickled by an earlier attnkit
            state["_same_dims"] = state.pop("_qkv_same_embed_dim")
        super().__setstate__(state)

    def extra_repr(self) -> str:
        parts = [
            f"embed_dim={self.embed_dim}",
            f"num_heads={self.num_heads}",
            f"mechanism={mechanism_label(self.config)}",
        ]
        if self.dropout:
            parts.append(f"dropout={self.dropout}")
        if not self._same_dims:
            parts.append(f"kdim={self.kdim}, vdim={self.vdim}")
        if self.bias_k is not None:
            parts.append("add_bias_kv=True")
        if self.add_zero_attn:
            parts.append("add_zero_attn=True")
        if not self.batch_first:
            parts.append("batch_first=False")
        if self.backend != "auto":
            parts.append(f"backend={self.backend}")
        return ", ".join(parts)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Optional[Tensor] = None,
        need_weights: bool = True,
        attn_mask: Optional[Tensor] = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
        query_padding_mask: Optional[Tensor] = None,
    ) -> tuple[Tensor, Optional[Tensor]]:
        """torch's ``MultiheadAttention.forward``, plus ``query_padding_mask`` (True = ignore).

        Returns ``(out, weights)``; ``weights`` is ``None`` unless ``need_weights``. ``is_causal=True``
        applies a causal mask (on top of ``attn_mask`` when both are given; torch treats it as a hint
        that ``attn_mask`` is causal, which gives the same result, and requires that mask). With
        ``add_bias_kv`` or ``add_zero_attn`` the appended key stays visible to every query, as torch does
        with ``need_weights=True``; torch's ``need_weights=False`` path instead drops ``attn_mask`` and
        lets SDPA's top-left ``is_causal`` over the ``Lk + 1`` keys hide the appended key, so the two
        differ there.
        """
        check_not_traced(type(self).__name__)
        need_weights = _flag(need_weights, "need_weights")
        average_attn_weights = _flag(average_attn_weights, "average_attn_weights")
        if query.is_nested and query is key and key is value:
            return self._forward_nested(
                query, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal,
                query_padding_mask,
            )
        self_attention = same_tensor(query, key)  # two views of one tensor too (x.transpose(0, 1) twice)
        if need_weights and self.backend == "efficient":
            raise ValueError(
                "need_weights=True asks for the (Lq, Lk) weights, which backend='efficient' "
                "never materializes; "
                "pass need_weights=False, or build the module with backend='auto'"
            )
        batched = self._check_inputs(query, key, value)
        if not batched:  # (L, E) -> (1, L, E)
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            key_padding_mask = _unsqueeze_1d(key_padding_mask, "key_padding_mask")
            query_padding_mask = _unsqueeze_1d(query_padding_mask, "query_padding_mask")
        elif not self.batch_first:  # (L, B, E) -> (B, L, E)
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        B, Lq, E = query.shape
        Lk = key.shape[1]
        H, D = self.num_heads, self.head_dim
        dtype = query.dtype

        key_padding_mask = canonical_mask(key_padding_mask, "key_padding_mask", dtype)
        query_padding_mask = canonical_mask(query_padding_mask, "query_padding_mask", dtype)
        attn_mask = canonical_mask(attn_mask, "attn_mask", dtype)
        if isinstance(self.config, CoDA):
            for name, m in (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
                if m is not None and m.dtype != torch.bool:
                    what = (
                        "a float mask inside torch.func.vmap (its values cannot be read)" if values_hidden(m)
                        else "a float mask that requires grad (a learned additive bias)" if m.requires_grad
                        else "an additive float mask (values other than 0 and -inf)"
                    )
                    raise ValueError(
                        f"{name} is {what}; CoDA's masks are multiplicative: pass a boolean mask (True = not "
                        "allowed, as torch) or a float mask of 0 and -inf only"
                    )
        self._check_masks(key_padding_mask, query_padding_mask, attn_mask, B, Lq, Lk, query.device)
        if attn_mask is not None and attn_mask.dim() == 3:
            attn_mask = attn_mask.view(B, H, Lq, Lk)  # (B*H, Lq, Lk) -> (B, H, Lq, Lk), batch-major as torch
        query_mask = self._query_mask(
            self_attention, key_padding_mask, query_padding_mask, attn_mask, B, Lq, Lk
        )

        causal = _flag(is_causal, "is_causal")
        if attn_mask is not None and not causal and (self.bias_k is not None or self.add_zero_attn):
            # the appended key is visible to every query, which hides a causal pattern from the core's
            # check: check the caller's mask before the column is appended
            _, user_mask = _functional_masks(None, attn_mask, dtype)
            user = build_mask(B, H, Lq, Lk, attn_mask=user_mask, device=query.device)
            check_causal_pattern(self.config, user)
        if causal and (self.bias_k is not None or self.add_zero_attn):
            # The appended key (bias or zeros) is visible to every query, as in torch: apply the causal
            # mask to the Lk real keys here, and let the core reject mechanisms that leak under it.
            attention(query.new_zeros(1, 1, 1, 1), query.new_zeros(1, 1, 1, 1), query.new_zeros(1, 1, 1, 1),
                      self.config, causal=True)
            # (Lq, Lk) True = later
            future = torch.ones(Lq, Lk, dtype=torch.bool, device=query.device).triu(1)
            if attn_mask is None:
                attn_mask = future
            elif attn_mask.dtype == torch.bool:
                attn_mask = attn_mask | future
            else:
                attn_mask = attn_mask.masked_fill(future, float("-inf"))
            causal = False
        q, k, v = self._project(query, key, value)  # (B, Lq, E), (B, Lk, E), (B, Lk, E)
        if self.bias_k is not None:
            k = torch.cat([k, self.bias_k.expand(B, 1, E)], dim=1)  # (B, Lk + 1, E)
            v = torch.cat([v, self.bias_v.expand(B, 1, E)], dim=1)  # (B, Lk + 1, E)
            attn_mask, key_padding_mask = append_columns(attn_mask, 1), append_columns(key_padding_mask, 1)
        q = q.view(B, Lq, H, D).transpose(1, 2)  # (B, H, Lq, D)
        k = k.view(B, k.shape[1], H, D).transpose(1, 2)  # (B, H, Lk', D)
        v = v.view(B, v.shape[1], H, D).transpose(1, 2)  # (B, H, Lk', D)
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(B, H, 1, D)], dim=2)  # (B, H, Lk' + 1, D)
            v = torch.cat([v, v.new_zeros(B, H, 1, D)], dim=2)  # (B, H, Lk' + 1, D)
            attn_mask, key_padding_mask = append_columns(attn_mask, 1), append_columns(key_padding_mask, 1)

        key_mask, valid_or_bias = _functional_masks(key_padding_mask, attn_mask, dtype)
        _check_key_bias(self.config, key_padding_mask, valid_or_bias, B, H, Lq, k.shape[2], query.device)
        # softmax keeps its padded query rows, as torch does; an observer leaves them out
        observed_only = (query_mask is not None and query_padding_mask is None
                         and self.config.name == "softmax")
        # a call without query padding of its own keeps an outer hint (a decoder layer's target padding for
        # its cross-attention)
        with observed_query_padding(~query_mask) if observed_only else contextlib.nullcontext():
            result = attention(
                q, k, v, self.config,
                key_mask=key_mask,
                query_mask=None if query_mask is None or observed_only else ~query_mask,
                attn_mask=valid_or_bias,
                causal=causal,
                dropout_p=self.dropout if self.training else 0.0,
                hybrid_weight=self._hybrid_weight(),
                return_weights=need_weights,
                backend=self.backend,
            )
        out, weights = result if need_weights else (result, None)
        out = self.out_proj(out.transpose(1, 2).reshape(B, Lq, E))  # (B, H, Lq, D) -> (B, Lq, E)
        if weights is not None and average_attn_weights:
            weights = weights.mean(dim=1)  # (B, Lq, Lk')
        if not batched:
            out = out.squeeze(0)  # (Lq, E)
            weights = weights.squeeze(0) if weights is not None else None
        elif not self.batch_first:
            out = out.transpose(0, 1)  # (Lq, B, E)
        return out, weights

    #: torch's own ``MultiheadAttention.merge_masks(attn_mask, key_padding_mask, query)``: the masks combined
    #: as torch's fused path takes them, ``(merged_mask, mask_type)`` with mask_type None (neither), 1
    #: (``key_padding_mask`` alone) or 2 (an ``attn_mask``, with or without ``key_padding_mask``, expanded to
    #: ``(B, H, L, L)``); it reads ``num_heads`` only.
    merge_masks = nn.MultiheadAttention.merge_masks

    # -- pieces of forward -------------------------------------------------------------------------

    def _forward_nested(
        self,
        x: Tensor,
        key_padding_mask: Optional[Tensor],
        need_weights: bool,
        attn_mask: Optional[Tensor],
        average_attn_weights: bool,
        is_causal: bool,
        query_padding_mask: Optional[Tensor],
    ) -> tuple[Tensor, Optional[Tensor]]:
        """Self-attention over a nested tensor of B sequences ``(L_b, E)``, as torch's ``TransformerEncoder``
        passes a padded batch in eval mode without gradients: padded to ``(B, L, E)``, its padding masked,
        and the output nested again (the weights, when asked for, padded)."""
        if key_padding_mask is not None or query_padding_mask is not None:
            raise ValueError(
                "a nested input carries its own lengths; pass key_padding_mask=None (or pad the input with "
                "torch.nested.to_padded_tensor and pass the mask)"
            )
        lengths = [t.shape[0] for t in x.unbind()]
        padded = torch.nested.to_padded_tensor(x, 0.0)  # (B, L, E)
        ends = torch.tensor(lengths, device=padded.device)  # (B,)
        # (B, L) True = padding
        padding = torch.arange(padded.shape[1], device=padded.device)[None, :] >= ends[:, None]
        if not self.batch_first:
            padded = padded.transpose(0, 1)  # (L, B, E)
        # this class's forward, by keyword: a subclass's override has run already (calling it again would
        # apply it twice) and may take other positional arguments (torch-style forward(q, k, v, **kwargs))
        out, weights = MultiheadAttention.forward(
            self, padded, padded, padded, key_padding_mask=padding, need_weights=need_weights,
            attn_mask=attn_mask, average_attn_weights=average_attn_weights, is_causal=is_causal,
        )
        if not self.batch_first:
            out = out.transpose(0, 1)  # (B, L, E)
        nested = torch.nested.as_nested_tensor([out[b, :n] for b, n in enumerate(lengths)], layout=x.layout)
        return nested, weights

    def _project(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if self._same_dims:
            w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        else:
            w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        b_q = b_k = b_v = None
        if self.in_proj_bias is not None:
            b_q, b_k, b_v = self.in_proj_bias.chunk(3)
        return F.linear(query, w_q, b_q), F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)

    def _query_mask(
        self,
        self_attention: bool,
        key_padding_mask: Optional[Tensor],
        query_padding_mask: Optional[Tensor],
        attn_mask: Optional[Tensor],
        B: int,
        Lq: int,
        Lk: int,
    ) -> Optional[Tensor]:
        """The query padding (True = ignore): given, or inferred in self-attention from the key padding and
        from a per-example ``attn_mask`` ``(B, H, Lq, Lk)`` that is a key padding mask in form (every query
        row alike) and hides keys from every query of every head (padding given as an ``attn_mask`` alone)."""
        if query_padding_mask is not None:
            if query_padding_mask.dtype != torch.bool:
                raise ValueError(
                    "query_padding_mask must be boolean (True = padded query) "
                    "or a float mask of only 0 and -inf; "
                    "finite additive biases have no meaning for queries"
                )
            return query_padding_mask
        # softmax's outputs do not depend on padded queries (torch's module keeps them); the weights observed
        # for diagnostics leave them out (their rows entered the softmax column sums): see forward
        padded = self.config.name != "softmax" or observing()
        if not (self_attention and padded and Lq == Lk):
            return None
        query_mask = None
        if key_padding_mask is not None:
            # a float mask that also holds biases (or requires grad): its masked entries (-inf, or at or
            # below MASKED_BIAS) are padded keys, and so padded queries (they entered the column sums)
            query_mask = (key_padding_mask if key_padding_mask.dtype == torch.bool
                          else key_padding_mask.detach() <= MASKED_BIAS)  # (B, Lk)
        if attn_mask is not None and attn_mask.dim() == 4 and not values_hidden(attn_mask):
            # padding given as a per-example attn_mask alone: a mask whose query rows are all alike (a key
            # padding mask in attn_mask's form) hides the padded keys from every query, and those positions
            # are padded queries too. A structural mask (a (Lq, Lk) one, alike for every sequence; causal
            # ones; a key hidden from some queries only) is not read as padding: a real query whose key it
            # hides from everyone stays a query
            hidden = attn_mask if attn_mask.dtype == torch.bool else attn_mask.detach() <= MASKED_BIAS
            padding_form = bool((hidden.all(dim=-2) == hidden.any(dim=-2)).all())  # rows alike
            hidden = hidden.all(dim=-2).all(dim=1)  # (B, Lk): hidden from every query of every head
            if padding_form and bool(hidden.any()):
                query_mask = hidden if query_mask is None else query_mask | hidden
        return query_mask

    def _check_inputs(self, query: Tensor, key: Tensor, value: Tensor) -> bool:
        """Validate shapes and return whether the inputs are batched."""
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            check_dense(t, name)
            if t.is_quantized:
                raise ValueError(
                    f"{name} is a quantized tensor ({t.dtype}); attnkit's attention runs in floating point: "
                    f"dequantize before it (a DeQuantStub, or {name}.dequantize()) and leave the module out "
                    "of static quantization (its qconfig = None), or use "
                    "torch.ao.quantization.quantize_dynamic"
                )
        if query.dim() not in (2, 3) or key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError(
                f"query, key, value have shapes {tuple(query.shape)}, {tuple(key.shape)}, "
                f"{tuple(value.shape)}; "
                "expected all 3-D (batched) or all 2-D (unbatched, (L, E))"
            )
        weight = self.out_proj.weight
        if callable(weight) or weight.is_quantized:  # a statically quantized out_proj: weight() is qint8
            raise ValueError(
                "out_proj is statically quantized; attnkit's MultiheadAttention runs in floating point: set "
                "its qconfig = None before torch.ao.quantization.prepare (dequantize its inputs with a "
                "DeQuantStub), or use torch.ao.quantization.quantize_dynamic (which keeps out_proj in "
                "floating point, as for torch's module)"
            )
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t.device != weight.device:
                raise ValueError(
                    f"{name} is on {t.device} but the module's parameters are on {weight.device}; move one "
                    f"with .to(device)"
                )
            if not t.is_floating_point():  # token ids, say: no module dtype would take them
                raise ValueError(
                    f"{name} has dtype {t.dtype}; expected floating embeddings of the module's dtype "
                    f"{weight.dtype} (embed token ids first, e.g. with nn.Embedding)"
                )
            if t.dtype != weight.dtype and not torch.is_autocast_enabled(t.device.type):
                raise ValueError(
                    f"{name} has dtype {t.dtype} but the module's parameters are {weight.dtype}; cast the "
                    f"input with .to({weight.dtype}) or the module with .to({t.dtype}) (or run under "
                    "torch.autocast)"
                )
        layout = "(B, L, E)" if self.batch_first else "(L, B, E)"
        for name, t, dim in (
            ("query", query, self.embed_dim),
            ("key", key, self.kdim),
            ("value", value, self.vdim),
        ):
            if t.shape[-1] != dim:
                raise ValueError(
                    f"{name} has shape {tuple(t.shape)}, expected last dimension {dim} (layout {layout}, "
                    f"batch_first={self.batch_first})"
                )
        if key.shape[:-1] != value.shape[:-1]:
            raise ValueError(
                f"key {tuple(key.shape)} and value {tuple(value.shape)} "
                "must agree in every dimension but the last"
            )
        batched = query.dim() == 3
        if batched:
            b = 0 if self.batch_first else 1
            if query.shape[b] != key.shape[b]:
                raise ValueError(
                    f"query {tuple(query.shape)} and key {tuple(key.shape)} have different batch sizes "
                    f"(layout {layout}, batch_first={self.batch_first})"
                )
        seq = 1 if batched and self.batch_first else 0
        if key.shape[seq] == 0 and self.bias_k is None and not self.add_zero_attn:
            raise ValueError(
                f"key {tuple(key.shape)} and value {tuple(value.shape)} hold no positions (layout {layout}, "
                f"batch_first={self.batch_first}): the queries have nothing to attend to; give at least one "
                "key (or build the module with add_bias_kv=True or add_zero_attn=True)"
            )
        return batched

    def _check_masks(
        self,
        key_padding_mask: Optional[Tensor],
        query_padding_mask: Optional[Tensor],
        attn_mask: Optional[Tensor],
        B: int,
        Lq: int,
        Lk: int,
        device: torch.device,
    ) -> None:
        for name, m in (
            ("key_padding_mask", key_padding_mask), ("query_padding_mask", query_padding_mask),
            ("attn_mask", attn_mask),
        ):
            if m is not None and m.device != device:
                raise ValueError(f"{name} is on {m.device} but the inputs are on {device}; move it with "
                                 f".to({str(device)!r})")
        for name, m, L in (
            ("key_padding_mask", key_padding_mask, Lk),
            ("query_padding_mask", query_padding_mask, Lq),
        ):
            if m is not None and tuple(m.shape) != (B, L):
                raise ValueError(
                    f"{name} has shape {tuple(m.shape)}, expected (B, L) = ({B}, {L}) (True = ignore)"
                )
        if attn_mask is not None:
            shapes = ((Lq, Lk), (B * self.num_heads, Lq, Lk))
            if tuple(attn_mask.shape) not in shapes:
                raise ValueError(
                    f"attn_mask has shape {tuple(attn_mask.shape)}, expected (Lq, Lk) = {shapes[0]} or "
                    f"(B * num_heads, Lq, Lk) = {shapes[1]}"
                )


def _flag(value, name: str) -> bool:
    """A forward flag as torch takes it (``if need_weights:``): True/False, what equals one of them (1/0, a
    numpy bool) and None (false, as callers passing ``need_weights=output_attentions`` rely on); anything
    else (a string such as "False", which torch would read as true) is a ``ValueError``."""
    if value is None:
        return False
    if isinstance(value, bool):
        return value
    try:
        if not isinstance(value, (str, bytes)) and value in (True, False):
            return bool(value)
    except (RuntimeError, ValueError, TypeError):  # e.g. a tensor of several elements
        pass
    raise ValueError(f"{name}={value!r}; expected True or False")


def _unsqueeze_1d(mask: Optional[Tensor], name: str) -> Optional[Tensor]:
    if mask is None:
        return None
    if not isinstance(mask, Tensor) or mask.dim() != 1:
        got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(f"{name} is {got} but the inputs are unbatched; expected a 1-D mask (L,)")
    return mask.unsqueeze(0)  # (1, L)


def _functional_masks(
    key_padding_mask: Optional[Tensor], attn_mask: Optional[Tensor], dtype: torch.dtype
) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """Torch-style masks -> ``(key_mask, attn_mask)`` of the functional core (True = may attend, or
    additive)."""
    any_float = any(m is not None and m.dtype != torch.bool for m in (key_padding_mask, attn_mask))
    if not any_float:
        key_mask = None if key_padding_mask is None else ~key_padding_mask  # (B, Lk)
        valid = None if attn_mask is None else ~attn_mask  # (Lq, Lk) or (B, H, Lq, Lk)
        return key_mask, valid
    bias = to_additive(attn_mask, dtype) if attn_mask is not None else None
    if key_padding_mask is not None:
        kp = to_additive(key_padding_mask, dtype)[:, None, None, :]  # (B, 1, 1, Lk)
        bias = kp if bias is None else bias + kp  # (B, H|1, Lq, Lk)
    return None, bias


def _check_key_bias(
    config, key_padding_mask: Optional[Tensor], bias: Optional[Tensor], B: int, H: int, Lq: int, Lk: int,
    device: torch.device,
) -> None:
    """The core's refusal of a key hidden by a finite fill (``check_constant_key_bias``: -1000 under dnas,
    hnas, sinkhorn), naming the module's masks: a float ``key_padding_mask`` on its own first, then the
    combined float ``bias`` ``(B|1, H|1, Lq|1, Lk)`` as ``attn_mask``."""
    if bias is None or bias.dtype == torch.bool or not normalizes_over_queries(config):
        return
    if key_padding_mask is not None and key_padding_mask.dtype != torch.bool:
        own = build_mask(B, H, Lq, Lk, attn_mask=key_padding_mask[:, None, None, :], device=device)
        check_constant_key_bias(
            config, own, "key_padding_mask",
            f"mark keys to ignore with True in a boolean key_padding_mask, or with -inf (or <= "
            f"{MASKED_BIAS:g})",
        )
    check_constant_key_bias(
        config, build_mask(B, H, Lq, Lk, attn_mask=bias, device=device), "attn_mask",
        f"mark pairs that may not attend with -inf (or <= {MASKED_BIAS:g}), True in a boolean attn_mask, or "
        "padded keys with True in a boolean key_padding_mask",
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, min(n, 64) + 1) if n % d == 0]
