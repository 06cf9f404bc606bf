"""Softmax, DNAS, HNAS and Sinkhorn attention in ``O(L)`` extra memory, with exact gradients.

"Attention that does not Explain Away" (arXiv:2009.14308), sections 3.1-3.2 and 5; "Doubly-Normalized
Attention",
eqs. (6)-(8) and section 6; docs/design.md section 2. All four mechanisms are softmax attention with a
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

from ..masks import MaskInfo
from .blocking import chunk_size, head_groups, reduce_to

__all__ = ["potential_attention"]

NEG_INF = float("-inf")


def potential_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    masks: MaskInfo,
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
    ``block`` fixes the key-block width (default: blocks of about ``BLOCK_ELEMENTS`` scores).
    """
    if u is not None and iters == 0:
        u = None  # u * softmax + (1 - u) * softmax
    return _PotentialAttention.apply(q, k, v, u, masks.bias, masks, scale, iters, block)


def _compute(t: Tensor) -> Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _tiny(dtype: torch.dtype) -> float:
    """Row sums below this are recomputed with a running maximum (their entries may have underflowed)."""
    return torch.finfo(dtype).tiny ** 0.5


class _Sweeps:
    """Recomputable score blocks ``s[..., j0:j1]`` of one group of heads (bias added, invalid = -inf)."""

    def __init__(self, qs: Tensor, k: Tensor, masks: MaskInfo, width: int):
        self.qs = qs  # (b, h, Lq, D), already multiplied by the scale
        self.k = k  # (b, h, Lk, D)
        self.masks = masks
        self.Lq = qs.shape[2]
        self.Lk = k.shape[2]
        self.width = width

    def ranges(self):
        for j0 in range(0, self.Lk, self.width):
            yield j0, min(self.Lk, j0 + self.width)

    def scores(self, j0: int, j1: int) -> tuple[Tensor, Optional[Tensor]]:
        """``(s, valid)``: the block ``(b, h, Lq, C)`` with -inf on invalid pairs, and its validity."""
        s = torch.matmul(self.qs, self.k[:, :, j0:j1].transpose(-1, -2))  # (b, h, Lq, C)
        if self.masks.bias is not None:
            s += self.masks.bias_block(0, self.Lq, j0, j1).to(s.dtype)
        valid = self.masks.block_valid(0, self.Lq, j0, j1)
        if valid is not None:
            s.masked_fill_(~valid, NEG_INF)
        return s, valid


class _RowLSE:
    """Online ``LSE_j`` over key blocks with a running maximum, and an optional output ``sum_j p_ij v_j``."""

    def __init__(self, like: Tensor, Dv: Optional[int]):
        shape = like.shape[:-1] + (1,)  # (b, h, Lq, 1)
        self.m = torch.full(shape, NEG_INF, dtype=like.dtype, device=like.device)
        self.l = torch.zeros(shape, dtype=like.dtype, device=like.device)
        self.acc = None if Dv is None else like.new_zeros(like.shape[:-1] + (Dv,))  # (b, h, Lq, Dv)

    def update(self, y: Tensor, v_block: Optional[Tensor]) -> None:
        """Add the block ``y (b, h, Lq, C)`` (consumed in place)."""
        m_new = torch.maximum(self.m, y.amax(dim=-1, keepdim=True))  # (b, h, Lq, 1)
        m_safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        rescale = torch.exp(self.m - m_safe)  # 0 while nothing was seen
        p = y.sub_(m_safe).exp_()  # (b, h, Lq, C)
        self.l = self.l * rescale + p.sum(dim=-1, keepdim=True)
        if self.acc is not None:
            self.acc = self.acc * rescale + p @ v_block  # (b, h, Lq, Dv)
        self.m = m_new

    def finish(self) -> tuple[Tensor, Optional[Tensor]]:
        """``(row_potential, out)``: ``-LSE`` and ``acc / l``, both 0 on rows without a valid key."""
        nonempty = self.l != 0  # a NaN sum (a NaN score) is not an empty row: the NaN is kept
        l_safe = torch.where(nonempty, self.l, torch.ones_like(self.l))
        a = torch.where(nonempty, -(self.m + torch.log(l_safe)), torch.zeros_like(self.l))
        return a, (None if self.acc is None else self.acc / l_safe)


def _robust_rows(
    sw: _Sweeps, b: Optional[Tensor], v: Tensor, with_out: bool
) -> tuple[Tensor, Optional[Tensor]]:
    """Row potential ``-LSE_j(s_ij + b_j)`` (and the softmax output) with a running maximum."""
    row = _RowLSE(sw.qs, v.shape[-1] if with_out else None)
    for j0, j1 in sw.ranges():
        s, _ = sw.scores(j0, j1)
        if b is not None:
            s += b[..., j0:j1]
        row.update(s, v[:, :, j0:j1] if with_out else None)
    return row.finish()


def _forward_group(sw: _Sweeps, v: Tensor, iters: int, softmax_too: bool):
    """Forward sweeps of one group of heads.

    Returns ``out``, the row potentials ``[a^0 = 0, a^1, ..., a^k]`` (``k = max(iters, 1)``), the column
    potentials ``[b^1, ..., b^iters]`` and, when ``softmax_too``, ``(out_softmax, a_softmax)``.
    """
    if iters == 0:
        a, out = _robust_rows(sw, None, v, with_out=True)
        return out, [torch.zeros_like(a), a], [], None
    qs = sw.qs
    Dv = v.shape[-1]
    tiny = _tiny(qs.dtype)
    a_list = [qs.new_zeros(qs.shape[:-1] + (1,))]  # a^0 = 0, (b, h, Lq, 1)
    b_list: list[Tensor] = []
    nonempty: Optional[Tensor] = None  # rows with a valid key, known after the first sweep
    soft = None
    out = None
    for t in range(1, iters + 1):
        last = t == iters
        a_prev = a_list[-1]
        l = torch.zeros_like(a_prev)  # (b, h, Lq, 1): sum_j w_ij
        acc = qs.new_zeros(qs.shape[:-1] + (Dv,)) if last else None  # (b, h, Lq, Dv)
        row_soft = _RowLSE(qs, Dv) if (last and softmax_too) else None
        b_blocks = []
        for j0, j1 in sw.ranges():
            x, valid = sw.scores(j0, j1)  # (b, h, Lq, C)
            vj = v[:, :, j0:j1]
            if t == 1 and valid is not None:
                hit = valid.any(dim=-1, keepdim=True)
                nonempty = hit if nonempty is None else nonempty | hit
            if row_soft is not None:
                row_soft.update(x.clone(), vj)
            if t > 1:
                x += a_prev
            # column step: b_j = -LSE_i x_ij; w_ij = exp(x_ij + b_j) is column-normalized, in [0, 1]
            m = x.amax(dim=-2, keepdim=True)  # (b, h, 1, C)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            w = x.sub_(m).exp_()
            z = w.sum(dim=-2, keepdim=True)  # (b, h, 1, C)
            has = z != 0  # not empty; a NaN sum (a NaN query poisons every column, as in exact math) stays
            z_safe = torch.where(has, z, torch.ones_like(z))
            b_blocks.append(torch.where(has, -(m + torch.log(z_safe)), torch.zeros_like(z)))
            w.mul_(1.0 / z_safe)
            # row step: exp(s_ij + b_j) = w_ij * exp(-a_prev_i), so a^t = a_prev - log(sum_j w_ij)
            l += w.sum(dim=-1, keepdim=True)
            if acc is not None:
                acc.add_(w @ vj)  # (b, h, Lq, Dv)
        b_t = torch.cat(b_blocks, dim=-1)  # (b, h, 1, Lk)
        b_list.append(b_t)
        underflow = l < tiny if nonempty is None else (l < tiny) & nonempty
        if bool(underflow.any()):  # rows whose weights all underflowed: redo them with a running max
            a_t, out_t = _robust_rows(sw, b_t, v, with_out=last)
        else:
            has = l != 0  # a NaN row sum propagates
            l_safe = torch.where(has, l, torch.ones_like(l))
            a_t = torch.where(has, a_prev - torch.log(l_safe), torch.zeros_like(l))
            out_t = acc / l_safe if last else None
        a_list.append(a_t)
        if last:
            out = out_t
            if row_soft is not None:
                a_soft, out_soft = row_soft.finish()
                soft = (out_soft, a_soft)
    return out, a_list, b_list, soft


def _backward_group(sw: _Sweeps, v: Tensor, iters: int, a_list, b_list, mains, dbias: Optional[Tensor]):
    """Gradients ``(d(q * scale), dk, dv)`` of one group of heads; adds the bias gradient to ``dbias``.

    ``mains``: ``(dO, out, a_row, uses_b)`` per output head; the first one is the mechanism's own
    (row softmax of ``s + b^k``, ``uses_b``), a second one is the softmax half of the hybrid.
    """
    qs, k = sw.qs, sw.k
    dqs = torch.zeros_like(qs)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    deltas = [(dO * o).sum(dim=-1, keepdim=True) for dO, o, _, _ in mains]  # (b, h, Lq, 1)
    if iters > 0:
        r_col = torch.exp(a_list[iters - 1] - a_list[iters])  # (b, h, Lq, 1), <= Lk: column/row ratio
    g_a = None  # gradient of the row potential a^{t-1}, accumulated across key blocks
    for j0, j1 in sw.ranges():
        s, _ = sw.scores(j0, j1)  # (b, h, Lq, C)
        vj = v[:, :, j0:j1]
        ds = None
        q_col = None
        for idx, ((dO, _, a_row, uses_b), delta) in enumerate(zip(mains, deltas)):
            y = s if idx + 1 == len(mains) else s.clone()  # the last head may overwrite s
            if uses_b:
                y += b_list[-1][..., j0:j1]
            p = y.add_(a_row).exp_()  # (b, h, Lq, C): row softmax, 0 on invalid pairs
            if uses_b:
                q_col = p * r_col  # column-normalized weights of the last column step
            dv[:, :, j0:j1] += p.transpose(-1, -2) @ dO  # (b, h, C, Dv)
            dy = (dO @ vj.transpose(-1, -2)).sub_(delta).mul_(p)  # (b, h, Lq, C)
            ds = dy if ds is None else ds.add_(dy)
            if uses_b:
                g_b = dy.sum(dim=-2, keepdim=True)  # (b, h, 1, C): d/d b^k_j
        if iters > 0:
            ds.addcmul_(q_col, g_b, value=-1.0)  # d b_j / d s_ij = -q_col_ij
            if iters > 1:
                part = -(q_col @ g_b.transpose(-1, -2))  # (b, h, Lq, 1): d/d a^{k-1}_i
                g_a = part if g_a is None else g_a.add_(part)
        _accumulate(sw, ds, j0, j1, dqs, dk, dbias)
    for t in range(iters - 1, 0, -1):  # rounds t = k-1 .. 1: row step a^t, then column step b^t
        g_row, g_a = g_a, None
        r_col = torch.exp(a_list[t - 1] - a_list[t])  # (b, h, Lq, 1)
        for j0, j1 in sw.ranges():
            s, _ = sw.scores(j0, j1)
            q_row = s.add_(b_list[t - 1][..., j0:j1]).add_(a_list[t]).exp_()  # (b, h, Lq, C), row-normalized
            q_col = q_row * r_col  # column-normalized weights of the column step b^t
            ds = q_row.mul_(-g_row)  # d a^t_i / d s_ij = -q_row_ij
            g_b = ds.sum(dim=-2, keepdim=True)  # (b, h, 1, C): d/d b^t_j
            ds.addcmul_(q_col, g_b, value=-1.0)
            if t > 1:
                part = -(q_col @ g_b.transpose(-1, -2))  # (b, h, Lq, 1)
                g_a = part if g_a is None else g_a.add_(part)
            _accumulate(sw, ds, j0, j1, dqs, dk, dbias)
    return dqs, dk, dv


def _accumulate(sw: _Sweeps, ds: Tensor, j0, j1, dqs, dk, dbias) -> None:
    dqs += ds @ sw.k[:, :, j0:j1]  # (b, h, Lq, D): gradient wrt q * scale
    dk[:, :, j0:j1] += ds.transpose(-1, -2) @ sw.qs  # (b, h, C, D)
    if dbias is not None:  # only when a float attn_mask requires grad; it has the user's shape
        target = dbias[..., j0:j1] if dbias.shape[-1] != 1 else dbias
        target += reduce_to(ds, target.shape)


def _groups(q: Tensor, k: Tensor, block: Optional[int]):
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    for b0, b1, h0, h1 in head_groups(B, H, Lq * min(Lk, 64)):
        width = block if block is not None else chunk_size(h1 - h0, Lq, Lk)
        yield (slice(b0, b1), slice(h0, h1)), (b0, b1, h0, h1), width


class _PotentialAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, u, bias, masks, scale, iters, block):
        qc, kc, vc = _compute(q), _compute(k), _compute(v)
        B, H, Lq, _ = q.shape
        Lk, Dv = k.shape[2], v.shape[3]
        hybrid = u is not None
        n_a = max(iters, 1) + 1
        out = qc.new_empty((B, H, Lq, Dv))
        a_all = qc.new_empty((n_a, B, H, Lq, 1))
        b_all = qc.new_empty((iters, B, H, 1, Lk))
        out_l = qc.new_empty((B, H, Lq, Dv)) if hybrid else None
        a_l = qc.new_empty((B, H, Lq, 1)) if hybrid else None
        for sl, (b0, b1, h0, h1), width in _groups(q, k, block):
            sw = _Sweeps(qc[sl] * scale, kc[sl], masks.select(b0, b1, h0, h1), width)
            o, a_list, b_list, soft = _forward_group(sw, vc[sl], iters, hybrid)
            out[sl] = o
            for i, a in enumerate(a_list):
                a_all[i][sl] = a
            for i, b in enumerate(b_list):
                b_all[i][sl] = b
            if hybrid:
                out_l[sl], a_l[sl] = soft
        ctx.save_for_backward(q, k, v, u, bias, out, a_all, b_all, out_l, a_l)
        ctx.masks, ctx.scale, ctx.iters, ctx.block = masks, scale, iters, block
        if hybrid:
            uc = u.to(out.dtype)
            return (uc * out + (1 - uc) * out_l).to(q.dtype)  # (B, H, Lq, Dv)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, u, bias, out, a_all, b_all, out_l, a_l = ctx.saved_tensors
        iters, scale, masks = ctx.iters, ctx.scale, ctx.masks
        qc, kc, vc = _compute(q), _compute(k), _compute(v)
        dO = grad_out.to(out.dtype)
        hybrid = u is not None
        if hybrid:
            uc = u.to(out.dtype).expand(q.shape[0], q.shape[1], 1, 1)  # (B, H, 1, 1)
        dq, dk, dv = torch.zeros_like(qc), torch.zeros_like(kc), torch.zeros_like(vc)
        dbias = torch.zeros_like(bias, dtype=qc.dtype) if ctx.needs_input_grad[4] else None
        for sl, (b0, b1, h0, h1), width in _groups(q, k, block=ctx.block):
            sw = _Sweeps(qc[sl] * scale, kc[sl], masks.select(b0, b1, h0, h1), width)
            a_list = [a[sl] for a in a_all]
            b_list = [b[sl] for b in b_all]
            if hybrid:
                mains = [
                    (uc[sl] * dO[sl], out[sl], a_list[-1], iters > 0),
                    ((1 - uc[sl]) * dO[sl], out_l[sl], a_l[sl], False),
                ]
            else:
                mains = [(dO[sl], out[sl], a_list[-1], iters > 0)]
            sub_bias = None
            if dbias is not None:
                sub_bias = dbias
                if dbias.shape[0] != 1:
                    sub_bias = sub_bias[b0:b1]
                if dbias.shape[1] != 1:
                    sub_bias = sub_bias[:, h0:h1]
            g = _backward_group(sw, vc[sl], iters, a_list, b_list, mains, sub_bias)
            dq[sl], dk[sl], dv[sl] = g[0] * scale, g[1], g[2]
        du = None
        if hybrid and ctx.needs_input_grad[3]:
            du = (dO * (out - out_l)).sum(dim=(-2, -1), keepdim=True)  # (B, H, 1, 1)
            du = reduce_to(du, (1,) * (4 - u.dim()) + tuple(u.shape)).reshape(u.shape).to(u.dtype)
        return (
            dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), du,
            None if dbias is None else dbias.to(bias.dtype), None, None, None, None,
        )
