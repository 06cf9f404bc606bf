"""attnkit as a Hugging Face transformers attention implementation (docs/design.md sections 2, 3 and 6).

Every mechanism of the registry (``attnkit.registry``) runs through ``attnkit.attention``: softmax, DNAS and
HNAS (``u * pi^D + (1 - u) * pi^L`` with ``u = sigmoid(theta)`` per head) of "Attention that does not Explain
Away" (arXiv:2009.14308), Sinkhorn (its section 3.2; "Sinkformers", arXiv:2110.11773) and CoDA
("Compositional De-Attention Networks", eqs. 1-10).

transformers dispatches attention through two registries, both keyed by ``config._attn_implementation``:

- ``AttentionInterface``: ``fn(module, query, key, value, attention_mask, scaling=, dropout=, **kwargs)``
  with ``query (B, H, Lq, D)``, ``key``/``value`` ``(B, H_kv, Lk, D)``, returning ``(out (B, Lq, H, D),
  weights)``.
- ``AttentionMaskInterface``: builds the ``attention_mask`` that the model passes to the attention function.
  Without an entry, transformers passes ``attention_mask=None`` and padding would be silently ignored.

The mask registered here is, for bidirectional attention with padding, the ``(B, Lk)`` key padding mask itself
(True = real), passed straight through to ``attnkit.attention`` as ``key_mask``; otherwise the boolean
``(B, 1, Lq, Lk)`` mask of ``sdpa_mask`` (True = may attend), always materialized for causal models so that
causality is never implicit. transformers masks keys only; for
self-attention a query position is real exactly when the key at the same position is, so the query mask of the
query-normalized mechanisms (dnas, hnas, sinkhorn) is recovered from the key columns: padded queries stay out
of
the column normalizations (``c_j`` of DNAS) and a padded batch gives, on its real tokens, what each sequence
gives alone.

Each converted attention module carries its mechanism (``module.attnkit_mechanism``, a config object) and, for
hnas, the learnable ``module.attnkit_theta`` of shape ``(H,)`` with ``u = sigmoid(theta)``. Modules that were
not
converted run softmax attention, identical to transformers' ``eager`` implementation but in a row with no
allowed key (an all-padding sequence), whose output is 0 where eager spreads the weight over every key.

CoDA's L1 distance is not invariant under rotary position embeddings (Llama, RoFormer, ...), as a dot
product is: its outputs depend on the absolute positions, so a left-padded sequence without ``position_ids``
that count its real tokens differs from the sequence alone (``attnkit finetune`` pads on the right).
"""

from __future__ import annotations

import functools
import inspect
import math
import re
from typing import Optional

import torch
from torch import Tensor, nn

from ..config import CoDA, Hybrid, MechanismConfig, Softmax
from ..functional import attention, observed_query_padding, observing
from ..masks import MASKED_BIAS
from ..mechanisms import sigmoid_weight
from ..registry import check_causal, normalizes_over_queries

__all__ = [
    "IMPLEMENTATION",
    "attention_forward",
    "attention_mask",
    "module_mechanism",
]

IMPLEMENTATION = "attnkit"
"""The name under which attnkit registers with ``AttentionInterface`` and ``AttentionMaskInterface``."""

_MECHANISM_ATTR = "attnkit_mechanism"
_THETA_ATTR = "attnkit_theta"
_SELF_ATTR = "attnkit_self_attention"
_BACKEND_ATTR = "attnkit_backend"  # set by attnkit.hf.set_backend; "auto" when absent

# Keyword arguments of transformers' attention functions that change what attention computes and that attnkit
# does not implement. (``position_bias``, T5's relative position bias, is taken: an additive score bias.)
# Modules that scale q after its projection and pass scaling=1.0 (OPT, Whisper, Qwen2-Audio, Voxtral, ...):
# the scores are the same, but CoDA's L1 distance would be taken between a scaled q and an unscaled k.
# Kosmos-2.5 writes ``self.scaling * query_states``, another ``query_states * self.scaling``.
_PRESCALED_QUERY = re.compile(
    r"(q_proj\(hidden_states\)|query_states)\s*\*\s*self\.scaling\b|self\.scaling\s*\*\s*query_states"
)


@functools.lru_cache(maxsize=None)
def forward_source(cls: type) -> str:
    """The source of ``cls.forward`` (read once per class), or ``""`` where it cannot be read."""
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return ""


def prescales_query(module: nn.Module) -> bool:
    """Whether ``module``'s forward calls its attention function with ``scaling=1.0``: it scaled q itself."""
    return "scaling=1.0" in forward_source(type(module))


def _query_prescale(module: nn.Module, scaling: Optional[float]) -> Optional[float]:
    """The factor ``s`` by which ``module`` multiplied q before its attention function, or None. Only for a
    module whose own forward multiplies q (``q_proj(hidden_states)`` or ``query_states``) by a float
    ``self.scaling`` and calls with ``scaling=1.0``."""
    return _prescale_factor(module, scaling, coda_prescale(module)[1])


def _prescale_factor(module: nn.Module, scaling: Optional[float], multiplies: bool) -> Optional[float]:
    """:func:`_query_prescale` from the source's verdict ``multiplies``; ``self.scaling`` is read now, not
    kept (a model whose scaling changes after ``convert`` is read at its current value)."""
    s = getattr(module, "scaling", None)
    if not multiplies or scaling != 1.0 or not isinstance(s, float) or not math.isfinite(s):
        return None
    return None if s in (0.0, 1.0) else s


_PRESCALE_ATTR = "_attnkit_query_prescale"


def coda_prescale(module: nn.Module) -> tuple[bool, bool]:
    """What ``module``'s source says: whether it calls its attention function with ``scaling=1.0``
    (:func:`prescales_query`), and whether it multiplies q by ``self.scaling`` first. Read once and kept on
    the module (``convert`` reads it): read at every call, the cached source lookup made torch.compile warn of
    "silent incorrectness" for every converted CoDA model."""
    found = module.__dict__.get(_PRESCALE_ATTR)
    if found is None:
        prescaled = prescales_query(module)
        found = (prescaled, prescaled and bool(_PRESCALED_QUERY.search(forward_source(type(module)))))
        module.__dict__[_PRESCALE_ATTR] = found
    return found


def _coda_prescale_problem(module: nn.Module) -> str:
    return (
        f"{type(module).__name__} scales its queries before attention (it passes scaling=1.0) by a factor "
        "attnkit cannot undo (a learned or per-dimension scale), so CoDA's L1 distance would be taken "
        "between a scaled q and an unscaled k; convert it to softmax, dnas, hnas or sinkhorn"
    )


UNSUPPORTED_FEATURES = {
    "softcap": "soft-capping of the attention logits (Gemma 2)",
    "s_aux": "attention sinks (GPT-OSS)",
    "sinks": "attention sinks",
    "indices": "sparse attention over selected keys",
    "block_indices": "block-sparse attention",
}


def module_mechanism(module: nn.Module) -> MechanismConfig:
    """The mechanism config of an attention module (``Softmax()`` for a module that was not converted)."""
    return getattr(module, _MECHANISM_ATTR, None) or Softmax()


def _repeat_kv(x: Tensor, groups: int) -> Tensor:
    """Repeat each key/value head ``groups`` times (grouped-query attention)."""
    if groups == 1:
        return x
    B, Hkv, L, D = x.shape
    return x[:, :, None].expand(B, Hkv, groups, L, D).reshape(B, Hkv * groups, L, D)  # (B, H, L, D)


def _split_mask(mask: Optional[Tensor], keep_grad: bool = True) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """``(bool_mask, additive_bias)`` of a transformers mask: ours is boolean; a user's 4-D mask may be
    float. With ``keep_grad`` a float mask that requires grad stays a bias, whatever its values (CoDA, which
    takes no bias, reads one of 0 and masked entries as the padding it is)."""
    if mask is None:
        return None, None
    if mask.dtype == torch.bool:
        return mask, None
    if mask.dtype.is_floating_point:
        if keep_grad and mask.requires_grad and torch.is_grad_enabled():
            return None, mask  # a learned bias (BEiT's, Swin's: zero when built) keeps its gradient
        allowed = mask > MASKED_BIAS  # transformers' own float masks hold 0 and finfo(dtype).min
        if bool(((mask == 0) | ~allowed).all()):
            return allowed, None
        return None, mask
    raise ValueError(
        f"attention_mask has dtype {mask.dtype}; expected a boolean mask (True = may attend) or a float "
        "additive mask"
    )


def _query_mask(key_valid: Tensor, Lq: int) -> Tensor:
    """Which queries are real in self-attention, from the key padding ``(B, Lk)``.

    A padded key position is a padded query position too; with a cache (``Lq < Lk``) the queries are the
    last ``Lq`` positions.
    """
    return key_valid[:, -Lq:]  # (B, Lq)


def attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    is_causal: Optional[bool] = None,
    position_bias: Optional[Tensor] = None,
    **kwargs,
) -> tuple[Tensor, Optional[Tensor]]:
    """The ``AttentionInterface`` entry of attnkit.

    Shapes:
        query ``(B, H, Lq, D)``, key/value ``(B, H_kv, Lk, D)`` (``H`` a multiple of ``H_kv``);
        attention_mask ``(B, 1, Lq, Lk)`` boolean (True = may attend) or float additive (BEiT's and Swin's
        relative position bias, ``(1, H, Lq, Lk)``), or ``None``; a batch size of 1 broadcasts over ``B``;
        position_bias (T5's relative position bias) broadcastable to ``(B, H, Lq, Lk)``, added to the scores
        -> ``(out (B, Lq, H, D), None)``, or ``(out, weights (B, H, Lq, Lk))`` when the model was called with
        ``output_attentions=True`` (the mechanism's weights, materialized as transformers' ``eager`` does).

    Raises a ``ValueError`` when a query-normalized mechanism (dnas, hnas, sinkhorn) meets causal attention,
    when CoDA meets a position bias, and for a feature of ``UNSUPPORTED_FEATURES`` (soft-capping, sinks, ...).
    """
    config = module_mechanism(module)
    for name, feature in UNSUPPORTED_FEATURES.items():
        if kwargs.get(name) is not None:
            raise ValueError(
                f"{type(module).__name__} passes {name}= to its attention function: {feature}, which attnkit "
                "does not implement, so its attention cannot run through attnkit; use the model without "
                "attnkit.hf.convert"
            )
    prescaled, multiplies = coda_prescale(module) if isinstance(config, CoDA) else (False, False)
    if prescaled and _prescale_factor(module, 1.0, multiplies) is None:
        raise ValueError(_coda_prescale_problem(module))
    if position_bias is not None and isinstance(config, CoDA):
        raise ValueError(
            f"{type(module).__name__} adds a position bias to the attention scores, which "
            f"{config.name!r} cannot take (its masks are multiplicative); convert it to softmax, dnas, hnas "
            "or sinkhorn"
        )
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", False))
    check_causal(config, causal)
    B, H, Lq, D = query.shape
    Hkv = key.shape[1]
    if H % Hkv != 0:
        raise ValueError(
            f"query has {H} heads and key {Hkv}; grouped-query attention needs H to be a "
            "multiple of H_kv"
        )
    key, value = _repeat_kv(key, H // Hkv), _repeat_kv(value, H // Hkv)  # (B, H, Lk, D)
    if isinstance(config, CoDA):
        s = _prescale_factor(module, scaling, multiplies)
        if s is not None:  # E = alpha s q.k as the model's scores; N = -beta s ||q - k||_1 of the projections
            query, scaling = query / s, s

    key_mask = query_mask = key_valid = None
    if attention_mask is not None and attention_mask.dim() == 2:
        key_mask, valid, bias = attention_mask, None, None  # (B, Lk): key padding from our mask interface
        key_valid = key_mask
    else:
        valid, bias = _split_mask(attention_mask, keep_grad=not isinstance(config, CoDA))
        if bias is not None and isinstance(config, CoDA):
            raise ValueError(
                f"{type(module).__name__} passes a float score bias as its attention_mask (a relative "
                "position bias, or an additive mask), which CoDA cannot take (its masks are multiplicative); "
                "convert the model to softmax, dnas, hnas or sinkhorn, or pass a boolean attention_mask"
            )
        # the keys some query sees, from the boolean mask or the float bias alike (whether a learned bias
        # table happens to be all zeros must not change the query mask); a batch-1 mask broadcasts over B
        allowed = valid if valid is not None else None if bias is None else bias > MASKED_BIAS
        if allowed is not None:
            key_valid = allowed.any(dim=-2).any(dim=1).expand(B, allowed.shape[-1])  # (B, Lk)
    # the padded queries of self-attention: out of the column sums of dnas, hnas and sinkhorn and out of the
    # means of centred CoDA (docs/design.md sections 2-3), so that a padded batch gives each sequence alone
    over_queries = normalizes_over_queries(config) or (isinstance(config, CoDA) and config.uses_global_means)
    padded = over_queries or observing()  # observed softmax: padded query rows left out
    if padded and key_valid is not None and getattr(module, _SELF_ATTR, False):
        query_mask = _query_mask(key_valid, Lq)
    observed_only = None  # softmax keeps its padded query rows, as transformers; an observer leaves them out
    if query_mask is not None and not over_queries:
        observed_only, query_mask = query_mask, None
    if position_bias is not None:  # (B|1, H, Lq, Lk), added to the scores where a pair may attend
        if bias is not None:
            bias = bias + position_bias
        elif valid is not None:
            bias = torch.where(valid, position_bias, float("-inf"))
            valid = None
        else:
            bias = position_bias
    u = sigmoid_weight(getattr(module, _THETA_ATTR)) if isinstance(config, Hybrid) else None
    output_attentions = _attentions_requested(kwargs)
    with observed_query_padding(observed_only):
        result = attention(
            query, key, value, config,
            key_mask=key_mask,
            query_mask=query_mask,
            attn_mask=valid if valid is not None else bias,
            # causality is inside the mask of our mask interface; a missing mask on a causal module is a
            # plain causal call
            causal=causal and attention_mask is None and Lq > 1,
            scale=scaling,
            dropout_p=float(dropout),
            hybrid_weight=u,
            return_weights=output_attentions,
            backend=getattr(module, _BACKEND_ATTR, "auto"),
        )
    out, weights = result if output_attentions else (result, None)  # (B, H, Lq, D), (B, H, Lq, Lk)
    return out.transpose(1, 2).contiguous(), weights  # (B, Lq, H, D)


def _attentions_requested(kwargs) -> bool:
    """Whether the model asked for the attention weights: ``output_attentions`` in the call's keywords, or
    transformers' output collector gathering attentions (GPT-2 and GPTBigCode pop the keyword, OPT takes it
    as a parameter: neither passes it on, and the weights are collected from the modules' outputs)."""
    if kwargs.get("output_attentions", False):
        return True
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # transformers before the output collectors
        return False
    collected = _active_collector.get()
    return bool(collected) and any(str(key).endswith("attentions") for key in collected)


def attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: Optional[Tensor] = None,
    allow_is_bidirectional_skip: bool = False,
    use_vmap: bool = False,
    device="cpu",
    **kwargs,
) -> Optional[Tensor]:
    """The ``AttentionMaskInterface`` entry of attnkit, True = may attend.

    Bidirectional attention with a padding mask: the key padding mask ``(B, Lk)`` itself, which
    ``attention_forward`` passes straight to ``attnkit.attention`` as ``key_mask`` (the form the fused kernels
    take; nothing ``(Lq, Lk)``-shaped is built or compared per layer). Otherwise a boolean ``(B, 1, Lq, Lk)``
    mask: transformers' ``sdpa_mask`` with causal masks always materialized (never left to an ``is_causal``
    flag), and ``None`` only for bidirectional attention without padding.
    """
    from transformers.masking_utils import bidirectional_mask_function, causal_mask_function, sdpa_mask

    if (
        mask_function is bidirectional_mask_function
        and attention_mask is not None
        and attention_mask.dim() == 2
        and tuple(attention_mask.shape) == (batch_size, kv_length)
        and kv_offset == 0
    ):
        return attention_mask.to(device=device, dtype=torch.bool)  # (B, Lk)

    kwargs.pop("allow_is_causal_skip", None)
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function if mask_function is not None else causal_mask_function,
        attention_mask=attention_mask,
        allow_is_causal_skip=False,
        allow_is_bidirectional_skip=allow_is_bidirectional_skip,
        use_vmap=use_vmap,
        device=device,
        **kwargs,
    )
