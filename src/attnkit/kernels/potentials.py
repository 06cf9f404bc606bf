"""Softmax, DNAS, HNAS and Sinkhorn attention in ``O(L)`` extra memory, with exact gradients.

"Attention that does not explain away", sections 3.1-3.2 and 5; doubly-normalized attention draft,
eqs. (6)-(8) and section 6; DESIGN.md section 2. All four mechanisms are softmax attention with a
per-key bias ``b`` built from log-sum-exp potentials (``a = 0``, then ``k`` rounds of)

    b_j = -LSE_i (s_ij + a_i)          (column step, over valid queries i)
    a_i = -LSE_j (s_ij + b_j)          (row step, over valid keys j)

    out_i = sum_j softmax_j(s_ij + b_j) v_j

``k = 0`` is softmax, ``k = 1`` is DNAS (``b = -c``), ``k > 1`` is Sinkhorn; HNAS returns
``u * out(k=1) + (1 - u) * out(k=0)``. The column step of a block of keys needs every query but only
those keys, so each round is one sweep over key blocks ``(B, H, Lq, C)`` with an online row
log-sum-exp; the last sweep also accumulates the output. The backward pass recomputes the blocks
and walks the rounds in reverse (one sweep per round): the gradient of a column potential is complete
within its block, that of a row potential accumulates across blocks. Nothing ``(Lq, Lk)``-shaped is
ever stored; the saved state is ``q, k, v``, the output and ``2k + 1`` potential vectors.

Conventions: invalid pairs weigh exactly 0; a query without a valid key gets zeros; a key without a
valid query is left out of every column normalization; potentials of empty rows/columns are 0
(finite placeholders), so neither pass meets ``inf - inf``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._blocks import BlockMasks, chunk_size, reduce_to

__all__ = ["potential_attention"]

NEG_INF = float("-inf")


def potential_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    masks: BlockMasks,
    *,
    scale: float,
    iters: int,
    u: Optional[Tensor] = None,
    block: Optional[int] = None,
) -> Tensor:
    """``out (B, H, Lq, Dv)`` of softmax (``iters=0``), DNAS (``iters=1``) or Sinkhorn (``iters=k``).

    With ``u`` (broadcastable to ``(B, H, 1, 1)``) the result is the hybrid
    ``u * out(iters) + (1 - u) * out(softmax)``, computed in the same sweeps.
    Inputs in half precision are computed in float32 and the result is cast back.
    """
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    width = block if block is not None else chunk_size(B * H, Lq, Lk)
    bias = masks.bias
    if u is None:
        out = _PotentialAttention.apply(q, k, v, bias, masks, scale, iters, width)
        return out
    return _HybridAttention.apply(q, k, v, u, bias, masks, scale, iters, width)


def _compute(t: Tensor) -> Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


class _Sweeps:
    """Recomputable score blocks ``s[:, :, :, j0:j1]`` (bias added, invalid pairs = -inf)."""

    def __init__(self, q: Tensor, k: Tensor, masks: BlockMasks, bias: Optional[Tensor], scale: float, width: int):
        self.qs = q * scale  # (B, H, Lq, D)
        self.k = k
        self.masks = masks
        self.bias = bias
        self.Lq = q.shape[2]
        self.Lk = k.shape[2]
        self.width = width

    def ranges(self):
        for j0 in range(0, self.Lk, self.width):
            yield j0, min(self.Lk, j0 + self.width)

    def scores(self, j0: int, j1: int) -> tuple[Tensor, Optional[Tensor]]:
        """``(s, valid)``: the block ``(B, H, Lq, C)`` with -inf on invalid pairs, and its validity."""
        s = torch.matmul(self.qs, self.k[:, :, j0:j1].transpose(-1, -2))  # (B, H, Lq, C)
        if self.bias is not None:
            s = s + self.masks.bias_block(0, self.Lq, j0, j1).to(s.dtype)
        valid = self.masks.valid(0, self.Lq, j0, j1)
        if valid is not None:
            s = s.masked_fill(~valid, NEG_INF)
        return s, valid


def _col_potential(x: Tensor) -> Tensor:
    """``-LSE_i x_ij`` over dim -2 ``(B, H, 1, C)``; 0 for columns without a finite entry."""
    lse = torch.logsumexp(x, dim=-2, keepdim=True)  # (B, H, 1, C)
    return torch.where(torch.isfinite(lse), -lse, torch.zeros_like(lse))


class _RowLSE:
    """Online ``LSE_j`` over key blocks, with an optional accumulated output ``sum_j p_ij v_j``."""

    def __init__(self, like: Tensor, Dv: Optional[int]):
        B, H, Lq = like.shape[0], like.shape[1], like.shape[2]
        self.m = torch.full((B, H, Lq, 1), NEG_INF, dtype=like.dtype, device=like.device)
        self.l = torch.zeros((B, H, Lq, 1), dtype=like.dtype, device=like.device)
        self.acc = None if Dv is None else torch.zeros((B, H, Lq, Dv), dtype=like.dtype, device=like.device)

    def update(self, y: Tensor, v_block: Optional[Tensor]) -> None:
        """Add the block ``y (B, H, Lq, C)`` (consumed in place)."""
        m_new = torch.maximum(self.m, y.amax(dim=-1, keepdim=True))  # (B, H, Lq, 1)
        m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        rescale = torch.exp(self.m - m_safe)  # (B, H, Lq, 1); 0 while nothing was seen
        p = torch.exp_(y.sub_(m_safe))  # (B, H, Lq, C)
        self.l = self.l * rescale + p.sum(dim=-1, keepdim=True)
        if self.acc is not None:
            self.acc = self.acc * rescale + p @ v_block  # (B, H, Lq, Dv)
        self.m = m_new

    def finish(self) -> tuple[Tensor, Optional[Tensor], Tensor]:
        """``(row_potential, out, nonempty)``: ``-LSE`` (0 on empty rows), ``acc / l`` (0 on empty rows)."""
        nonempty = self.l > 0  # (B, H, Lq, 1)
        l_safe = torch.where(nonempty, self.l, torch.ones_like(self.l))
        lse = torch.where(nonempty, self.m + torch.log(l_safe), torch.zeros_like(self.l))
        out = None if self.acc is None else self.acc / l_safe
        return -lse, out, nonempty


def _forward(sw: _Sweeps, v: Tensor, iters: int, softmax_too: bool):
    """Run the ``max(iters, 1)`` sweeps; return ``out``, potentials ``a (iters+1)``, ``b (iters)`` and the
    plain softmax output/row potential when ``softmax_too``."""
    B, H, Lq, _ = sw.qs.shape
    Dv = v.shape[-1]
    a_list = [torch.zeros((B, H, Lq, 1), dtype=sw.qs.dtype, device=sw.qs.device)]  # a^0 = 0
    b_list: list[Tensor] = []
    out = None
    soft = None
    n_sweeps = max(iters, 1)
    for t in range(1, n_sweeps + 1):
        last = t == n_sweeps
        row = _RowLSE(sw.qs, Dv if last else None)
        row_soft = _RowLSE(sw.qs, Dv) if (last and softmax_too) else None
        b_blocks = []
        for j0, j1 in sw.ranges():
            s, _ = sw.scores(j0, j1)  # (B, H, Lq, C)
            if row_soft is not None:
                row_soft.update(s.clone(), v[:, :, j0:j1])
            if iters == 0:
                row.update(s, v[:, :, j0:j1] if last else None)
                continue
            b = _col_potential(s + a_list[-1] if t > 1 else s)  # (B, H, 1, C)
            b_blocks.append(b)
            row.update(s.add_(b), v[:, :, j0:j1] if last else None)
        if iters > 0:
            b_list.append(torch.cat(b_blocks, dim=-1))  # (B, H, 1, Lk)
        a, o, _ = row.finish()
        a_list.append(a)
        if last:
            out = o
            if row_soft is not None:
                a_soft, out_soft, _ = row_soft.finish()
                soft = (out_soft, a_soft)
    return out, a_list, b_list, soft


def _backward(sw: _Sweeps, v: Tensor, iters: int, a_list, b_list, mains, bias_grad: bool):
    """Gradients ``(dq, dk, dv, dbias_blocks)`` of the sweeps.

    ``mains``: a list of ``(weight_grad dO (B,H,Lq,Dv), out, a_row, b_key or None)`` output heads whose
    row softmax over ``s + b`` we differentiate; the first one (with ``b = b^k``) continues into the rounds.
    """
    qs, k = sw.qs, sw.k
    dqs = torch.zeros_like(qs)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    dbias = torch.zeros_like(sw.bias, dtype=qs.dtype) if bias_grad else None
    deltas = [(dO * o).sum(dim=-1, keepdim=True) for dO, o, _, _ in mains]  # (B, H, Lq, 1) each
    g_a = None  # gradient of the row potential a^{t-1}, accumulated across blocks
    for j0, j1 in sw.ranges():
        s, _ = sw.scores(j0, j1)  # (B, H, Lq, C)
        vj = v[:, :, j0:j1]
        ds = torch.zeros_like(s)
        g_b = None
        for idx, ((dO, _, a_row, b_key), delta) in enumerate(zip(mains, deltas)):
            y = s if b_key is None else s + b_key[..., j0:j1]
            p = torch.exp(y + a_row)  # (B, H, Lq, C), row softmax; 0 on invalid pairs
            dv[:, :, j0:j1] += p.transpose(-1, -2) @ dO  # (B, H, C, Dv)
            dy = p.mul_(dO @ vj.transpose(-1, -2) - delta)  # (B, H, Lq, C)
            ds += dy
            if idx == 0 and iters > 0:
                g_b = dy.sum(dim=-2, keepdim=True)  # (B, H, 1, C): d/d b^k_j
        if iters > 0:
            g_a = _column_step_grad(s, a_list[iters - 1], b_list[iters - 1][..., j0:j1], g_b, ds, g_a, iters > 1)
        _accumulate(sw, s, ds, j0, j1, dqs, dk, dbias)
    for t in range(iters - 1, 0, -1):  # rounds t = k-1 .. 1: row step a^t, then column step b^t
        g_row = g_a
        g_a = None
        for j0, j1 in sw.ranges():
            s, _ = sw.scores(j0, j1)
            b_t = b_list[t - 1][..., j0:j1]  # (B, H, 1, C)
            qr = torch.exp(s + b_t + a_list[t])  # (B, H, Lq, C), row-normalized
            ds = qr.mul_(-g_row)  # d a^t_i / d s_ij = -qr_ij
            g_b = ds.sum(dim=-2, keepdim=True)  # (B, H, 1, C): d/d b^t_j
            g_a = _column_step_grad(s, a_list[t - 1], b_t, g_b, ds, g_a, t > 1)
            _accumulate(sw, s, ds, j0, j1, dqs, dk, dbias)
    return dqs, dk, dv, dbias


def _column_step_grad(s, a_prev, b_t, g_b, ds, g_a, need_g_a):
    """Backward of ``b_j = -LSE_i(s_ij + a_i)`` for one key block: adds to ``ds`` in place, returns ``g_a``."""
    qc = torch.exp(s + a_prev + b_t)  # (B, H, Lq, C), column-normalized; 0 on invalid pairs
    contrib = qc.mul_(-g_b)  # (B, H, Lq, C)
    ds += contrib
    if not need_g_a:
        return None
    part = contrib.sum(dim=-1, keepdim=True)  # (B, H, Lq, 1)
    return part if g_a is None else g_a + part


def _accumulate(sw: _Sweeps, s: Tensor, ds: Tensor, j0, j1, dqs, dk, dbias) -> None:
    kj = sw.k[:, :, j0:j1]
    dqs += ds @ kj  # (B, H, Lq, D), gradient wrt q * scale
    dk[:, :, j0:j1] += ds.transpose(-1, -2) @ sw.qs  # (B, H, C, D)
    if dbias is not None:  # only when a float attn_mask requires grad; it has the user's shape
        target = dbias[..., j0:j1] if dbias.shape[-1] != 1 else dbias
        target += reduce_to(ds, target.shape)


def _bias_grad(bias: Optional[Tensor], dbias: Optional[Tensor]) -> Optional[Tensor]:
    return None if dbias is None else dbias.to(bias.dtype)


class _PotentialAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, masks, scale, iters, width):
        dtype = q.dtype
        qc, kc, vc = _compute(q), _compute(k), _compute(v)
        sw = _Sweeps(qc, kc, masks, bias, scale, width)
        out, a_list, b_list, _ = _forward(sw, vc, iters, softmax_too=False)
        ctx.save_for_backward(q, k, v, bias, out, *a_list, *b_list)
        ctx.masks, ctx.scale, ctx.iters, ctx.width = masks, scale, iters, width
        return out.to(dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, bias, out, *pots = ctx.saved_tensors
        iters = ctx.iters
        n_a = max(iters, 1) + 1
        a_list, b_list = pots[:n_a], pots[n_a:]
        qc, kc, vc = _compute(q), _compute(k), _compute(v)
        sw = _Sweeps(qc, kc, ctx.masks, bias, ctx.scale, ctx.width)
        dO = grad_out.to(out.dtype)
        b_last = b_list[-1] if iters > 0 else None
        mains = [(dO, out, a_list[-1], b_last)]
        dqs, dk, dv, dbias = _backward(sw, vc, iters, a_list, b_list, mains, ctx.needs_input_grad[3])
        dq = (dqs * ctx.scale).to(q.dtype)
        return dq, dk.to(k.dtype), dv.to(v.dtype), _bias_grad(bias, dbias), None, None, None, None


class _HybridAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, u, bias, masks, scale, iters, width):
        dtype = q.dtype
        qc, kc, vc = _compute(q), _compute(k), _compute(v)
        sw = _Sweeps(qc, kc, masks, bias, scale, width)
        out_d, a_list, b_list, (out_l, a_l) = _forward(sw, vc, iters, softmax_too=True)
        uc = u.to(out_d.dtype)
        out = uc * out_d + (1 - uc) * out_l  # (B, H, Lq, Dv)
        ctx.save_for_backward(q, k, v, u, bias, out_d, out_l, a_l, *a_list, *b_list)
        ctx.masks, ctx.scale, ctx.iters, ctx.width = masks, scale, iters, width
        return out.to(dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, u, bias, out_d, out_l, a_l, *pots = ctx.saved_tensors
        iters = ctx.iters
        n_a = max(iters, 1) + 1
        a_list, b_list = pots[:n_a], pots[n_a:]
        qc, kc, vc = _compute(q), _compute(k), _compute(v)
        sw = _Sweeps(qc, kc, ctx.masks, bias, ctx.scale, ctx.width)
        dO = grad_out.to(out_d.dtype)
        uc = u.to(out_d.dtype)
        b_last = b_list[-1] if iters > 0 else None
        mains = [(uc * dO, out_d, a_list[-1], b_last), ((1 - uc) * dO, out_l, a_l, None)]
        dqs, dk, dv, dbias = _backward(sw, vc, iters, a_list, b_list, mains, ctx.needs_input_grad[4])
        du = None
        if ctx.needs_input_grad[3]:
            du = (dO * (out_d - out_l)).sum(dim=(-2, -1), keepdim=True)  # (B, H, 1, 1)
            du = reduce_to(du, (1,) * (4 - u.dim()) + tuple(u.shape)).reshape(u.shape).to(u.dtype)
        dq = (dqs * ctx.scale).to(q.dtype)
        return dq, dk.to(k.dtype), dv.to(v.dtype), du, _bias_grad(bias, dbias), None, None, None, None
