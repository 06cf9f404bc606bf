"""Validation of attention inputs and the combination of masks into one validity pattern.

Convention (DESIGN.md section 1): boolean masks with **True = real / may attend**.

- ``key_mask``   ``(B, Lk)``   False marks padded keys.
- ``query_mask`` ``(B, Lq)``   False marks padded queries (they get a zero output and never enter
  column normalizations).
- ``attn_mask``  broadcastable to ``(B, H, Lq, Lk)``; boolean (True = may attend) or floating
  (an additive score bias, ``-inf`` = may not attend), as in ``F.scaled_dot_product_attention``.
- ``causal``     query ``i`` sees keys ``j <= i`` (top-left aligned, as SDPA's ``is_causal``).

A pair ``(i, j)`` is valid when every mask allows it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

__all__ = ["MaskInfo", "check_qkv", "build_mask", "causal_leak_error"]


@dataclass
class MaskInfo:
    """The combined masks of one attention call.

    ``valid``: boolean, broadcastable to ``(B, H, Lq, Lk)``, or ``None`` when every pair is valid.
    ``bias``: additive float bias broadcastable to ``(B, H, Lq, Lk)`` (finite, 0 where invalid) or ``None``.
    ``key_mask`` / ``query_mask``: the validated 1-D masks, kept for backends that use them directly.
    """

    valid: Optional[Tensor]
    bias: Optional[Tensor]
    key_mask: Optional[Tensor] = None
    query_mask: Optional[Tensor] = None
    attn_mask: Optional[Tensor] = None
    causal: bool = False


def check_qkv(q: Tensor, k: Tensor, v: Tensor, *, same_head_dim: bool = True) -> None:
    """Raise a ``ValueError`` unless ``q (B,H,Lq,D)``, ``k (B,H,Lk,D)``, ``v (B,H,Lk,Dv)`` agree."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)} ({t.dim()}-D); expected 4-D (B, H, L, D). "
                "Add a head dimension with .unsqueeze(1) or reshape (B, L, H*D) to (B, H, L, D)."
            )
        if not t.dtype.is_floating_point:
            raise ValueError(f"{name} has dtype {t.dtype}; expected a floating dtype (float32, float64, bfloat16, float16)")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}; cast them with .to(dtype)")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}; move them with .to(device)")
    (Bq, Hq, _, Dq), (Bk, Hk, Lk, Dk), (Bv, Hv, Lv, _) = q.shape, k.shape, v.shape
    if not (Bq == Bk == Bv):
        raise ValueError(f"batch sizes differ: q has B={Bq}, k has B={Bk}, v has B={Bv}")
    if not (Hq == Hk == Hv):
        raise ValueError(f"head counts differ: q has H={Hq}, k has H={Hk}, v has H={Hv}")
    if same_head_dim and Dq != Dk:
        raise ValueError(f"q and k head dims differ: q has D={Dq}, k has D={Dk}; scores need equal D")
    if Lk != Lv:
        raise ValueError(f"k and v lengths differ: k has Lk={Lk}, v has {Lv}; each key needs one value")
    if Hq == 0:
        raise ValueError(f"q, k, v have H=0 heads (q has shape {tuple(q.shape)}); expected H >= 1")
    if Dq == 0 or Dk == 0:
        raise ValueError(
            f"q and k have head dim D=0 (q has shape {tuple(q.shape)}); scores q . k need D >= 1"
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[2] == 0:
            raise ValueError(f"{name} has an empty sequence (shape {tuple(t.shape)}); expected L >= 1")


def _check_1d_mask(name: str, mask: Tensor, B: int, L: int, length_name: str, device: torch.device) -> Tensor:
    if not isinstance(mask, Tensor):
        raise ValueError(f"{name} must be a boolean torch.Tensor of shape (B, {length_name}), got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise ValueError(
            f"{name} has dtype {mask.dtype}; expected torch.bool with True = real token "
            f"(convert with {name}.bool() if 1 marks real tokens)"
        )
    if tuple(mask.shape) != (B, L):
        raise ValueError(f"{name} has shape {tuple(mask.shape)}, expected (B, {length_name}) = ({B}, {L})")
    if mask.device != device:
        raise ValueError(f"{name} is on {mask.device} but the inputs are on {device}; move it with .to(device)")
    return mask


def causal_leak_error(mechanism: str) -> ValueError:
    return ValueError(
        f"mechanism {mechanism!r} normalizes over queries, so under a causal mask the weight of query i "
        "depends on later queries (a future-token leak). Use mechanism='softmax' or 'coda' for causal "
        "(decoder) attention, and keep dnas/hnas/sinkhorn for bidirectional (encoder) attention."
    )


def build_mask(
    B: int,
    H: int,
    Lq: int,
    Lk: int,
    *,
    key_mask: Optional[Tensor] = None,
    query_mask: Optional[Tensor] = None,
    attn_mask: Optional[Tensor] = None,
    causal: bool = False,
    device: torch.device,
    allow_bias: bool = True,
) -> MaskInfo:
    """Validate the masks and combine them into ``MaskInfo(valid, bias)``.

    ``valid`` has shape ``(B or 1, H or 1, Lq, Lk)``.
    """
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be True or False, got {causal!r}")
    if key_mask is not None:
        key_mask = _check_1d_mask("key_mask", key_mask, B, Lk, "Lk", device)
    if query_mask is not None:
        query_mask = _check_1d_mask("query_mask", query_mask, B, Lq, "Lq", device)

    valid: Optional[Tensor] = None
    bias: Optional[Tensor] = None

    def _and(m: Tensor) -> None:
        nonlocal valid
        valid = m if valid is None else valid & m

    if key_mask is not None:
        _and(key_mask[:, None, None, :])  # (B, 1, 1, Lk)
    if query_mask is not None:
        _and(query_mask[:, None, :, None])  # (B, 1, Lq, 1)
    if causal:
        _and(torch.ones(Lq, Lk, dtype=torch.bool, device=device).tril()[None, None])  # (1, 1, Lq, Lk)
    if attn_mask is not None:
        if not isinstance(attn_mask, Tensor):
            raise ValueError(f"attn_mask must be a torch.Tensor, got {type(attn_mask).__name__}")
        if attn_mask.device != device:
            raise ValueError(f"attn_mask is on {attn_mask.device} but the inputs are on {device}; move it with .to(device)")
        expected = (B, H, Lq, Lk)
        shape = tuple(attn_mask.shape)
        if not 2 <= len(shape) <= 4 or any(s not in (1, e) for s, e in zip(shape[::-1], expected[::-1])):
            raise ValueError(
                f"attn_mask has shape {shape}; expected a shape broadcastable to (B, H, Lq, Lk) = {expected}, "
                f"e.g. ({Lq}, {Lk}) or ({B}, 1, {Lq}, {Lk})"
            )
        m = attn_mask.reshape((1,) * (4 - len(shape)) + shape)  # (B|1, H|1, Lq|1, Lk|1)
        if m.dtype == torch.bool:
            _and(m)
        elif m.dtype.is_floating_point:
            if not allow_bias:
                raise ValueError(
                    f"attn_mask has dtype {m.dtype}: an additive float mask is meaningless for CoDA "
                    "(its masks are multiplicative); pass a boolean mask with True = may attend"
                )
            if torch.isnan(m).any() or (m == float("inf")).any():
                raise ValueError("attn_mask contains NaN or +inf; use finite biases and -inf for pairs that may not attend")
            finite = torch.isfinite(m)
            _and(finite)
            bias = m.masked_fill(~finite, 0.0)
        else:
            raise ValueError(
                f"attn_mask has dtype {m.dtype}; expected torch.bool (True = may attend) or a float additive bias"
            )
    return MaskInfo(
        valid=valid, bias=bias, key_mask=key_mask, query_mask=query_mask, attn_mask=attn_mask, causal=causal
    )
