"""attnkit as a Hugging Face transformers attention implementation (DESIGN.md sections 2 and 6).

Mechanisms: softmax (seed eq. 1/3), doubly-normalized DNAS (draft eqs. 6-8), hybrid HNAS (draft sec. 6,
``u * pi^D + (1 - u) * pi^L`` with ``u = sigmoid(theta)`` per head), Sinkhorn (later version sec. 3.2) and
CoDA (compositional-de-attention eqs. 1-10), all through ``attnkit.attention``.

transformers dispatches attention through two registries, both keyed by ``config._attn_implementation``:

- ``AttentionInterface``: ``fn(module, query, key, value, attention_mask, scaling=, dropout=, **kwargs)``
  with ``query (B, H, Lq, D)``, ``key``/``value`` ``(B, H_kv, Lk, D)``, returning ``(out (B, Lq, H, D), weights)``.
- ``AttentionMaskInterface``: builds the ``attention_mask`` that the model passes to the attention function.
  Without an entry, transformers passes ``attention_mask=None`` and padding would be silently ignored.

The mask registered here is the boolean ``(B, 1, Lq, Lk)`` mask of ``sdpa_mask`` (True = may attend), always
materialized for causal models so that causality is never implicit. transformers masks keys only; for
self-attention a query position is real exactly when the key at the same position is, so the query mask of the
query-normalized mechanisms (dnas, hnas, sinkhorn) is recovered from the key columns: padded queries stay out of
the column normalizations (``c_j`` of DNAS) and a padded batch gives, on its real tokens, what each sequence
gives alone.

Each converted attention module carries its mechanism (``module.attnkit_mechanism``, a config object) and, for
hnas, the learnable ``module.attnkit_theta`` of shape ``(H,)`` with ``u = sigmoid(theta)``. Modules that were not
converted run softmax attention, identical to transformers' ``eager`` implementation.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from ..config import Hybrid, MechanismConfig, Softmax
from ..functional import attention
from ..masks import causal_leak_error

__all__ = [
    "IMPLEMENTATION",
    "attention_forward",
    "attention_mask",
    "register",
    "is_registered",
    "module_mechanism",
]

IMPLEMENTATION = "attnkit"
"""The name under which attnkit registers with ``AttentionInterface`` and ``AttentionMaskInterface``."""

_MECHANISM_ATTR = "attnkit_mechanism"
_THETA_ATTR = "attnkit_theta"
_SELF_ATTR = "attnkit_self_attention"


def module_mechanism(module: nn.Module) -> MechanismConfig:
    """The mechanism config of an attention module (``Softmax()`` for a module that was not converted)."""
    return getattr(module, _MECHANISM_ATTR, None) or Softmax()


def _repeat_kv(x: Tensor, groups: int) -> Tensor:
    """Repeat each key/value head ``groups`` times (grouped-query attention)."""
    if groups == 1:
        return x
    B, Hkv, L, D = x.shape
    return x[:, :, None].expand(B, Hkv, groups, L, D).reshape(B, Hkv * groups, L, D)  # (B, H, L, D)


def _split_mask(mask: Optional[Tensor]) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """``(bool_mask, additive_bias)`` of a transformers mask: ours is boolean; a user's 4-D mask may be float."""
    if mask is None:
        return None, None
    if mask.dtype == torch.bool:
        return mask, None
    if mask.dtype.is_floating_point:
        return None, mask
    raise ValueError(
        f"attention_mask has dtype {mask.dtype}; expected a boolean mask (True = may attend) or a float additive mask"
    )


def _query_mask(valid: Tensor, Lq: int) -> Tensor:
    """Recover which queries are real in self-attention from a key-only boolean mask ``(B, 1|H, Lq, Lk)``.

    A key column with no query allowed to attend to it is padding; in self-attention the query at the same
    position is padding too. With a cache (``Lq < Lk``) the queries are the last ``Lq`` positions.
    """
    key_valid = valid.any(dim=-2).any(dim=1)  # (B, Lk)
    return key_valid[:, -Lq:]  # (B, Lq)


def _as_key_mask(valid: Optional[Tensor]) -> Optional[Tensor]:
    """``(B, Lk)`` when the boolean mask ``(B, 1, Lq, Lk)`` is pure key padding (every row the same), else ``None``."""
    if valid is None or valid.dim() != 4 or valid.shape[1] != 1:
        return None
    key_mask = valid[:, 0].any(dim=-2)  # (B, Lk)
    return key_mask if torch.equal(valid, key_mask[:, None, None, :].expand_as(valid)) else None


def attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    is_causal: Optional[bool] = None,
    **kwargs,
) -> tuple[Tensor, Optional[Tensor]]:
    """The ``AttentionInterface`` entry of attnkit.

    Shapes:
        query ``(B, H, Lq, D)``, key/value ``(B, H_kv, Lk, D)`` (``H`` a multiple of ``H_kv``);
        attention_mask ``(B, 1, Lq, Lk)`` boolean (True = may attend) or float additive, or ``None``
        -> ``(out (B, Lq, H, D), None)``.

    Raises a ``ValueError`` when a query-normalized mechanism (dnas, hnas, sinkhorn) meets causal attention.
    """
    config = module_mechanism(module)
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", False))
    if causal and config.query_normalized:
        raise causal_leak_error(config.name)
    B, H, Lq, D = query.shape
    Hkv = key.shape[1]
    if H % Hkv != 0:
        raise ValueError(f"query has {H} heads and key {Hkv}; grouped-query attention needs H to be a multiple of H_kv")
    key, value = _repeat_kv(key, H // Hkv), _repeat_kv(value, H // Hkv)  # (B, H, Lk, D)

    valid, bias = _split_mask(attention_mask)
    query_mask = None
    if config.query_normalized and valid is not None and getattr(module, _SELF_ATTR, False):
        query_mask = _query_mask(valid, Lq)
    key_mask = _as_key_mask(valid)
    if key_mask is not None:
        valid = None  # the same pairs, in the factored form that the fused kernels take
    u = torch.sigmoid(getattr(module, _THETA_ATTR)) if isinstance(config, Hybrid) else None
    out = attention(
        query, key, value, config,
        key_mask=key_mask,
        query_mask=query_mask,
        attn_mask=valid if valid is not None else bias,
        # causality is inside the mask of our mask interface; a missing mask on a causal module is a plain causal call
        causal=causal and attention_mask is None and Lq > 1,
        scale=scaling,
        dropout_p=float(dropout),
        hybrid_weight=u,
    )  # (B, H, Lq, D)
    return out.transpose(1, 2).contiguous(), None  # (B, Lq, H, D)


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
    """The ``AttentionMaskInterface`` entry of attnkit: a boolean ``(B, 1, Lq, Lk)`` mask, True = may attend.

    It is transformers' ``sdpa_mask`` with causal masks always materialized (never left to an ``is_causal``
    flag), and ``None`` only for bidirectional attention without padding.
    """
    from transformers.masking_utils import causal_mask_function, sdpa_mask

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


_REGISTERED = False


def is_registered() -> bool:
    """Whether ``register()`` has run in this process."""
    return _REGISTERED


def register() -> None:
    """Register attnkit with transformers (idempotent).

    After it, ``attn_implementation="attnkit"`` is valid in ``from_pretrained`` / ``set_attn_implementation``,
    and a model saved after ``attnkit.hf.convert`` is restored by a plain ``from_pretrained``: its config names
    the ``"attnkit"`` implementation and carries the conversion, which is re-applied when the model is built,
    before its weights (the hnas ``theta`` included) are loaded.
    """
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface, PreTrainedModel
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, attention_mask)

    original_post_init = PreTrainedModel.post_init

    def post_init(self) -> None:
        original_post_init(self)
        from .convert import restore_conversion

        restore_conversion(self)

    post_init.__wrapped__ = original_post_init  # type: ignore[attr-defined]
    PreTrainedModel.post_init = post_init
    _REGISTERED = True
