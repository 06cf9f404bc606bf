"""DNAS and HNAS on the CPU as a few fused attention passes with exact gradients.

"Doubly-Normalized Attention", eqs. (6)-(8); docs/design.md section 2. DNAS is softmax attention with a
per-key bias ``-c_j``, where ``c_j = LSE_i s_ij`` (over valid queries) is the row log-sum-exp of the
transposed problem (queries = keys). With the fused CPU flash-attention kernel, which also returns the
row log-sum-exp, the forward pass is two fused passes:

    (A, c) = attend(k -> q, values q)          A_j = sum_i E_ij q_i,  E_ij = exp(s_ij - c_j)
    (out, r) = attend(q -> k, bias -c, values v)   out_i = sum_j P_ij v_j,  P_ij = exp(s_ij - c_j - r_i)

and the backward pass is the kernel's own backward (``dS'`` with ``c`` held fixed) plus two fused passes
for the gradient that flows through ``c``:

    g_j  = dL/dc_j = sum_i P_ij delta_i - v_j . dv_j          (delta_i = dO_i . out_i)
    dq_i += scale * exp(r_i) * sum_j P_ij g_j k_j             (an attention pass with values g_j k_j)
    dk_j += scale * g_j * A_j

``sum_i P_ij delta_i`` is a pass over the transposed problem with bias ``-r_i``. Nothing of size
``(Lq, Lk)`` is stored. The path takes key and query padding masks (no ``attn_mask``); other calls use
the block kernel of ``blockwise.py``.

The kernel is reached through ``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu``: the
public ``F.scaled_dot_product_attention`` does not return the log-sum-exp that DNAS needs.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["fused_available", "fused_dnas_attention"]

_NEG_INF = float("-inf")


def _ops():
    forward = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    backward = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    return forward, backward


def fused_available(q: Tensor, v: Tensor) -> bool:
    """The fused path runs on CPU tensors with equal q/k/v head sizes when the kernel exists."""
    forward, backward = _ops()
    return (
        forward is not None and backward is not None and q.device.type == "cpu" and q.shape[-1] == v.shape[-1]
    )


def _attend(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], scale: float) -> tuple[Tensor, Tensor]:
    """Fused softmax attention ``(out (B, H, Lq, D), lse (B, H, Lq))`` with an additive ``bias``."""
    forward, _ = _ops()
    out, lse = forward(q, k, v, 0.0, False, attn_mask=bias, scale=scale)
    return out, lse


class _DNAS(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, key_bias: Optional[Tensor],
                query_bias: Optional[Tensor],
                query_valid: Optional[Tensor], key_valid: Optional[Tensor], scale: float) -> Tensor:
        # q (B, H, Lq, D), k (B, H, Lk, D), v (B, H, Lk, D); key_bias (B, 1, 1, Lk), query_bias (B, 1, 1, Lq)
        A, c = _attend(k, q, q, query_bias, scale)  # (B, H, Lk, D), (B, H, Lk)
        bias = -c[:, :, None, :]  # (B, H, 1, Lk)
        if key_bias is not None:
            bias = bias + key_bias
        # contiguous: given a strided mask (c comes back as a transposed view), the kernel's backward
        # copies it out to the full (B, H, Lq, Lk) shape
        bias = bias.contiguous()
        out, r = _attend(q, k, v, bias, scale)  # (B, H, Lq, D), (B, H, Lq)
        ctx.save_for_backward(q, k, v, out, r, c, A, bias, query_bias, query_valid, key_valid)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, k, v, out, r, c, A, bias, query_bias, query_valid, key_valid = ctx.saved_tensors
        scale = ctx.scale
        _, backward = _ops()
        dout = dout.contiguous()
        dq, dk, dv = backward(dout, q, k, v, out, r, 0.0, False, attn_mask=bias, scale=scale)
        D = q.shape[-1]
        # Temporaries of size (B, H, L, D) are freed as soon as they are used and the corrections are
        # added in place, so that the peak stays a few such tensors above the gradients themselves.
        delta = (dout * out).sum(-1)  # (B, H, Lq)
        # sum_i P_ij delta_i as a pass over the transposed problem with the query bias -r_i
        t_bias = -r[:, :, None, :]  # (B, H, 1, Lq)
        if query_bias is not None:
            t_bias = t_bias + query_bias
        values = delta[..., None].expand(-1, -1, -1, D).contiguous()  # the kernel wants D-wide values
        weighted, lse_t = _attend(k, q, values, t_bias.contiguous(), scale)
        del values
        column_delta = torch.exp(lse_t - c) * weighted[..., 0]  # (B, H, Lk)
        del weighted
        g = column_delta - (v * dv).sum(-1)  # dL/dc_j, (B, H, Lk)
        if key_valid is not None:  # padded keys have P_ij = 0: no gradient through their c_j
            g = torch.where(key_valid != 0, g, 0.0)  # (their exp(lse_t - c) may be inf: inf * 0 is NaN)
        gk = g[..., None] * k  # (B, H, Lk, D)
        through_c, _ = _attend(q, k, gk, bias, scale)  # sum_j P_ij g_j k_j, (B, H, Lq, D)
        del gk
        row_scale = scale * torch.exp(r)  # (B, H, Lq)
        if query_valid is not None:  # padded queries are not part of c
            row_scale = torch.where(query_valid != 0, row_scale, 0.0)
        dq.addcmul_(row_scale[..., None], through_c)
        del through_c
        dk.addcmul_(g[..., None], A, value=scale)
        return dq, dk, dv, None, None, None, None, None


def fused_dnas_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    key_mask: Optional[Tensor],
    query_mask: Optional[Tensor],
    scale: float,
    u: Optional[Tensor] = None,
) -> Tensor:
    """DNAS (``u is None``) or HNAS (``u * out_D + (1 - u) * out_L``) output ``(B, H, Lq, Dv)``.

    ``key_mask (B, Lk)`` / ``query_mask (B, Lq)``: True = real. Queries without a valid key, and padded
    queries, return zeros; padded queries never enter ``c``.
    """
    dtype = q.dtype
    if dtype in (torch.float16, torch.bfloat16):
        q, k, v = q.float(), k.float(), v.float()
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    key_bias = query_bias = None
    row_valid = None  # (B, 1, Lq, 1): queries that have a valid key and are real
    key_valid = query_valid = None
    if key_mask is not None:
        has_key = key_mask.any(dim=-1)  # (B,)
        km = key_mask | ~has_key[:, None]  # batch elements without any key: compute on all, zero below
        key_bias = torch.zeros(B, 1, 1, Lk, dtype=q.dtype).masked_fill(~km[:, None, None, :], _NEG_INF)
        key_valid = key_mask[:, None, :].to(q.dtype)  # (B, 1, Lk)
        row_valid = has_key[:, None, None, None].expand(B, 1, Lq, 1)
    if query_mask is not None:
        has_query = query_mask.any(dim=-1)  # (B,)
        qm = query_mask | ~has_query[:, None]
        query_bias = torch.zeros(B, 1, 1, Lq, dtype=q.dtype).masked_fill(~qm[:, None, None, :], _NEG_INF)
        query_valid = query_mask[:, None, :].to(q.dtype)  # (B, 1, Lq)
        qv = query_mask[:, None, :, None]  # (B, 1, Lq, 1)
        row_valid = qv if row_valid is None else row_valid & qv
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = _DNAS.apply(q, k, v, key_bias, query_bias, query_valid, key_valid, scale)  # (B, H, Lq, D)
    if u is not None:
        out_l = F.scaled_dot_product_attention(q, k, v, attn_mask=key_bias, scale=scale)  # (B, H, Lq, D)
        u = u.to(out.dtype)
        out = u * out + (1 - u) * out_l
    if row_valid is not None:
        out = out.masked_fill(~row_valid, 0.0)
    return out.to(dtype)
