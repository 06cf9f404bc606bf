"""DNAS, HNAS and Sinkhorn-k on CUDA: Triton kernels in the FlashAttention-2 style.

"Attention that does not explain away", sections 3.1-3.2 and 5; doubly-normalized attention draft,
eqs. (6)-(8) and section 6; the tiling and recomputation follow "FlashAttention-2: Faster Attention with
Better Parallelism and Work Partitioning" (arXiv:2307.08691). With ``a^0 = 0``, ``k`` rounds of

    b^t_j = -LSE_i (s_ij + a^{t-1}_i)     (column pass: one program per block of keys, all queries)
    a^t_i = -LSE_j (s_ij + b^t_j)         (row pass: one program per block of queries, all keys)

then ``out_i = sum_j exp(s_ij + b^k_j + a^k_i) v_j``, accumulated online in the last row pass
(``k = 1`` DNAS, ``k > 1`` Sinkhorn). HNAS computes the softmax half (``a^L_i = -LSE_j s_ij``, its
output) in the same last row pass and returns ``u * out_D + (1 - u) * out_L``.

Backward, one column pass and one row pass per round (the scores are recomputed block by block).
With ``P_ij = exp(s_ij + b^k_j + a^k_i)`` (row-normalized) and ``Qc_ij = exp(s_ij + a^{k-1}_i + b^k_j)``
(column-normalized), the last round has

    dy_ij = P_ij (dO_i . v_j - delta_i),  g_b_j = sum_i dy_ij,  ds_ij = dy_ij - Qc_ij g_b_j,
    g_a^{k-1}_i = -sum_j Qc_ij g_b_j,

and round ``t < k`` the same with ``dy_ij = -g_a^t_i Qr_ij`` (``Qr`` the row-normalized weights of round
``t``). ``g_b`` is a column sum and ``g_a`` a row sum, so the column pass computes ``g_b``, ``dV`` and
``dK_j = scale * (sum_i dy_ij q_i - g_b_j qbar_j)`` and the row pass ``dQ`` and ``g_a``. The column-normalized
mean queries ``qbar_j = sum_i Qc_ij q_i`` of each round do not depend on ``dO``: the forward's column pass
computes them when an input needs a gradient (one more product there), so that the backward's column pass
keeps two ``(N, D)`` accumulators, as FlashAttention-2's does, instead of three (which spilled registers: 768
to 936 bytes per thread in the sm_90 build of 64 x 64 tiles). The saved state is ``q, k, v``, the output(s),
``2k + 1`` potential vectors (in base 2, times log2(e), as the kernels use them) and the ``k`` mean-query
arrays ``(B*H, Lk, D)`` (in the inputs' dtype).

Masks: ``key_mask (B, Lk)`` and ``query_mask (B, Lq)`` (True = real). Invalid pairs weigh 0, padded queries
never enter a column normalization, potentials of empty rows/columns are 0 and queries without a valid key
return zeros, as in the other backends. Scores, potentials and accumulators are float32; ``tl.dot`` takes
the inputs' dtype (float32 dots in IEEE precision, no TF32). ``attn_mask`` and causal calls use
``potentials.py``.

On CUDA tensors the kernels are compiled by Triton. With ``TRITON_INTERPRET=1`` set before Triton is first
imported, they run in Triton's interpreter (numpy) on CPU tensors instead, which is how the test suite
checks them without a GPU.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl

    from . import _triton_kernels

    _TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
except ImportError:  # pragma: no cover - exercised where triton is not installed
    triton = None

from .blocking import reduce_to

__all__ = ["triton_available", "triton_attention", "TRITON_DTYPES"]

TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def triton_available(q: Tensor) -> bool:
    """True for CUDA tensors of a supported dtype when Triton is importable."""
    return triton is not None and q.is_cuda and q.dtype in TRITON_DTYPES


def triton_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    key_mask: Optional[Tensor],
    query_mask: Optional[Tensor],
    scale: float,
    iters: int,
    u: Optional[Tensor] = None,
    block: Optional[int] = None,
) -> Tensor:
    """Output ``(B, H, Lq, Dv)`` of DNAS (``iters=1``), Sinkhorn (``iters=k``) or, with ``u``
    (broadcastable to ``(B, H, 1, 1)``), the hybrid ``u * out(iters) + (1 - u) * out(softmax)``.

    Shapes: q ``(B|1, H|1, Lq, D)``, k ``(B|1, H|1, Lk, D)``, v ``(B|1, H|1, Lk, Dv)``; boolean
    ``key_mask (B|1, Lk)``, ``query_mask (B|1, Lq)``; ``u`` a number in [0, 1], a 0-d tensor, ``(H,)`` or
    ``(B|1, H|1, 1, 1)``. Padded rows must hold finite values: they weigh 0, but ``0 * nan`` is NaN in the
    products (``ak.attention`` zeroes them before calling). CUDA tensors, or CPU tensors under
    ``TRITON_INTERPRET=1`` (the interpreter).
    ``block`` fixes the tile size (a power of two >= 16; by default 16 interpreted, and compiled a tile per
    kernel and head size, ``_TILES``).
    """
    if triton is None:
        raise RuntimeError("Triton is not installed; install attnkit[triton] (pip install 'triton==3.9.*')")
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"iters={iters!r}; the Triton kernels need an integer >= 1 (softmax is SDPA)")
    if q.dtype not in TRITON_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(
            f"q, k, v have dtypes {q.dtype}, {k.dtype}, {v.dtype}; the Triton kernels take one of "
            f"{[str(d) for d in TRITON_DTYPES]} for all three (use backend='reference' for float64)"
        )
    if not q.is_cuda and not _triton_kernels.INTERPRETED:
        raise ValueError(
            f"the Triton kernels got {q.device.type} tensors; they run on CUDA tensors, or on CPU tensors in "
            "Triton's interpreter (set TRITON_INTERPRET=1 before triton is imported)"
        )
    if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 16
                              or block & (block - 1)):
        raise ValueError(f"block={block!r}; expected a power of two >= 16")
    B, H = _check_shapes(q, k, v)
    key_mask = _check_mask("key_mask", key_mask, B, k.shape[2])
    query_mask = _check_mask("query_mask", query_mask, B, q.shape[2])
    u = _check_hybrid(u, H, q, B)
    q = q.expand(B, H, -1, -1)
    k = k.expand(B, H, -1, -1)
    v = v.expand(B, H, -1, -1)
    km = None if key_mask is None else key_mask.to(torch.int8).expand(B, -1).contiguous()  # (B, Lk)
    qm = None if query_mask is None else query_mask.to(torch.int8).expand(B, -1).contiguous()  # (B, Lq)
    if block is None and not q.is_cuda:
        block = 16  # the interpreter: small tiles are fast
    return _TritonPotentials.apply(q, k, v, u, km, qm, float(scale), int(iters), block)


def _check_shapes(q: Tensor, k: Tensor, v: Tensor) -> tuple[int, int]:
    """``(B, H)`` of 4-D q, k, v whose batch and head sizes broadcast and whose sizes agree."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v have shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}; "
                         "expected (B, H, L, D) each")
    if k.shape[3] != q.shape[3] or v.shape[2] != k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: q and k need one head "
                         "size D, and k and v one length Lk")
    sizes = []
    for dim in (0, 1):
        n = max(q.shape[dim], k.shape[dim], v.shape[dim])
        if any(t.shape[dim] not in (1, n) for t in (q, k, v)):
            raise ValueError(f"q, k, v have {'batch' if dim == 0 else 'head'} sizes {q.shape[dim]}, "
                             f"{k.shape[dim]}, {v.shape[dim]}; each must be 1 or the largest")
        sizes.append(n)
    return sizes[0], sizes[1]


def _check_mask(name: str, mask: Optional[Tensor], B: int, L: int) -> Optional[Tensor]:
    """A boolean ``(B|1, L)`` mask on the inputs' device, or ``None``."""
    if mask is None:
        return None
    if mask.dtype != torch.bool or mask.dim() != 2 or mask.shape[1] != L or mask.shape[0] not in (1, B):
        raise ValueError(f"{name} has shape {tuple(mask.shape)} and dtype {mask.dtype}; expected a bool "
                         f"tensor of shape ({B}, {L}) (True = real token)")
    return mask


def _check_hybrid(u, H: int, like: Tensor, B: Optional[int] = None) -> Optional[Tensor]:
    """``u`` as a tensor broadcastable to ``(B, H, 1, 1)``: a number, a 0-d tensor, ``(H,)`` or
    a 4-D tensor; values in [0, 1] (checked where they can be read without a device synchronization)."""
    if u is None:
        return None
    if not torch.is_tensor(u):
        if isinstance(u, bool) or not isinstance(u, (int, float)):
            raise ValueError(f"u={u!r}; expected a number in [0, 1] or a tensor")
        u = torch.tensor(float(u), device=like.device)
    if u.dim() == 1 and u.shape[0] in (1, H):
        u = u.view(1, -1, 1, 1)
    if u.dim() == 0:
        u = u.view(1, 1, 1, 1)
    if u.dim() != 4 or u.shape[2:] != (1, 1) or u.shape[1] not in (1, H) or (B is not None
                                                                           and u.shape[0] not in (1, B)):
        batch = "B" if B is None else str(B)
        raise ValueError(
            f"u has shape {tuple(u.shape)}; expected a number, (), ({H},) or ({batch}|1, {H}|1, 1, 1)"
        )
    if not u.is_cuda and not (u.detach() >= 0).logical_and(u.detach() <= 1).all():
        raise ValueError("u holds values outside [0, 1] (or NaN); the hybrid weight mixes two normalizations")
    return u


# ------------------------------------------------------------------------------------ autograd


# Layout: q (BH, Lq, D), k (BH, Lk, D), v (BH, Lk, Dv) contiguous; potentials (BH, L) float32;
# masks (B, L) int8, head bh belongs to batch element bh // H. Program ids: (bh, block).


# Tiles (BLOCK_M, BLOCK_N, num_warps, num_stages) of each kernel when compiled, by operand kind and padded
# head size; a kernel may have a tile of its own for HNAS's last round ("<kernel>_hybrid"), whose variant
# holds the softmax half's accumulators too. The column kernels keep BLOCK_N keys resident and stream the
# queries, the row kernels the reverse. None of them spills registers in the sm_90 build that a launch with
# lengths and head sizes divisible by 16 gets (Triton specializes such integers: vectorized loads, fewer
# address registers); tests/kernels/test_triton_potentials.py checks it. Other lengths take the same tiles
# and may spill, which costs speed, not correctness.
_TILES = {
    # the fastest of 6-10 non-spilling candidates per kernel (benchmarks/triton_tiles.py on an H200,
    # bfloat16, B=4 H=16 L=4096), swept again for the base-2 / no-select kernels: fwd+bwd against the
    # previous table's tiles, D=64 DNAS 4.44 -> 4.45 ms, HNAS 6.35 -> 5.89, Sinkhorn-3 10.60 -> 10.62; D=128
    # DNAS 7.57 -> 7.28, HNAS 10.24 -> 9.84, Sinkhorn-3 18.31 -> 17.70
    ("half", 64): dict(col_fwd=(64, 64, 4, 3), row_fwd=(128, 64, 8, 3), col_bwd=(64, 64, 4, 3),
                       row_bwd=(64, 32, 4, 3), row_fwd_hybrid=(64, 64, 4, 3), col_bwd_hybrid=(64, 64, 4, 3),
                       row_bwd_hybrid=(128, 32, 4, 3)),
    ("half", 128): dict(col_fwd=(128, 64, 4, 3), row_fwd=(128, 32, 8, 3), col_bwd=(64, 128, 8, 3),
                        row_bwd=(64, 64, 4, 2), row_fwd_hybrid=(128, 64, 8, 3), col_bwd_hybrid=(32, 64, 4, 3),
                        row_bwd_hybrid=(128, 64, 8, 3)),
    # float32 (IEEE dots, no tensor cores) was not swept; col_fwd takes 8 warps, whose build keeps its tile
    # in registers with the base-2 scores (4 warps: 8 bytes of stack)
    ("float32", 64): dict(col_fwd=(32, 32, 8, 2), row_fwd=(32, 32, 8, 2), col_bwd=(16, 32, 8, 2),
                          row_bwd=(32, 32, 4, 2)),
}
_TILES_OTHER = (16, 16, 4, 2)  # the head sizes _TILES has no entry for (not checked for spills)
KERNEL_NAMES = ("col_fwd", "row_fwd", "col_bwd", "row_bwd")


def _tiles(block: Optional[int], width: int, dtype: torch.dtype) -> dict:
    """The tile of each kernel: ``block`` x ``block`` on 4 warps when given, else from ``_TILES``."""
    if block is not None:
        return {name: (block, block, 4, 3) for name in KERNEL_NAMES}
    kind = "float32" if dtype == torch.float32 else "half"
    for (k, limit), table in _TILES.items():
        if k == kind and width <= limit:
            return table
    return {name: _TILES_OTHER for name in KERNEL_NAMES}


class _Launch:
    """Shapes, tiles and mask pointers shared by every launch of one call."""

    def __init__(self, q3: Tensor, k3: Tensor, v3: Tensor, km, qm, H: int, scale: float,
                 block: Optional[int]):
        self.BH, self.Lq, self.D = q3.shape
        self.Lk, self.Dv = k3.shape[1], v3.shape[2]
        self.H, self.scale = H, scale
        self.km, self.qm = km, qm
        dummy = q3.new_empty(1, dtype=torch.float32)
        self.dummy = dummy
        # One padded width for q/k and v: compiled for an H100 in bfloat16 / float16 (Triton 3.6), tiles of
        # 64 and more gave wrong outputs (relative error ~1) when v's padded width was below q's (D=40 with
        # Dv=24, D=64 with Dv=32 at one pipeline stage) and right ones for every equal pair and for Dv > D;
        # the padded columns are masked, so a wider tile only costs their share of the product.
        block_d = max(16, triton.next_power_of_2(max(self.D, self.Dv)))
        self.dv_const = block_d
        self.even_d = self.D == block_d and self.Dv == block_d  # no padded columns: unmasked loads
        self.consts = dict(
            HAS_KM=km is not None, HAS_QM=qm is not None, BLOCK_D=block_d,
            PREC="ieee" if q3.dtype == torch.float32 else "tf32",
            IN_T=_TL_DTYPES[q3.dtype],
            DOT_T=tl.float32 if (q3.dtype == torch.bfloat16 and not q3.is_cuda) else _TL_DTYPES[q3.dtype],
        )
        self.tiles = _tiles(block, max(block_d, self.dv_const), q3.dtype)

    def masks(self):
        return (self.dummy if self.km is None else self.km), (self.dummy if self.qm is None else self.qm)

    def run(self, name: str, *args, **consts):
        """Launch kernel ``name``: a program per block of keys (column passes) or of queries (row passes)."""
        tile = self.tiles.get(name + "_hybrid") if consts.get("HYBRID") else None
        bm, bn, warps, stages = tile or self.tiles[name]
        column = name.startswith("col")
        blocks = triton.cdiv(self.Lk, bn) if column else triton.cdiv(self.Lq, bm)
        # the pairs need a mask when there are padding masks or the streamed axis ends in a partial tile
        # (the resident axis' partial tile is never stored); without one, no select per score
        streamed_partial = self.Lq % bm if column else self.Lk % bn
        mask_pairs = self.km is not None or self.qm is not None or streamed_partial != 0
        _triton_kernels.KERNELS[name][(self.BH, blocks)](
            *args, **consts, **self.consts, MASK_PAIRS=mask_pairs, EVEN_S=streamed_partial == 0,
            EVEN_D=self.even_d, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps,
            num_stages=stages
        )


def _forward(L: _Launch, q3, k3, v3, iters: int, hybrid: bool, train: bool):
    BH, Lq, Lk, Dv = L.BH, L.Lq, L.Lk, L.Dv
    f32 = dict(dtype=torch.float32, device=q3.device)
    a_all = torch.zeros(iters + 1, BH, Lq, **f32)  # a^0 = 0, ..., a^k
    b_all = torch.empty(iters, BH, Lk, **f32)
    # the column-normalized mean queries of each round, for the backward's dK (training only), in the inputs'
    # dtype (float32 made no difference to dK's error in bfloat16 / float16, and took twice the memory)
    qbar = torch.empty(iters, BH, Lk, L.D, dtype=q3.dtype, device=q3.device) if train else None
    out = torch.empty(BH, Lq, Dv, **f32)
    out_l = torch.empty(BH, Lq, Dv, **f32) if hybrid else L.dummy
    a_l = torch.empty(BH, Lq, **f32) if hybrid else L.dummy
    km, qm = L.masks()
    for t in range(1, iters + 1):
        L.run("col_fwd", q3, k3, a_all[t - 1], b_all[t - 1], L.dummy if qbar is None else qbar[t - 1],
              km, qm, L.scale, L.H, Lq, Lk, L.D, HAS_A=t > 1, QBAR=train)
        last = t == iters
        L.run("row_fwd", q3, k3, v3, b_all[t - 1], a_all[t], out, a_l, out_l, km, qm, L.scale,
              L.H, Lq, Lk, L.D, Dv, OUT=last, HYBRID=last and hybrid, BLOCK_DV=L.dv_const)
    return out, a_all, b_all, qbar, (out_l if hybrid else None), (a_l if hybrid else None)


def _backward(L: _Launch, q3, k3, v3, dO, out, a_all, b_all, qbar, out_l, a_l, u_bh, iters: int):
    BH, Lq, Lk, Dv = L.BH, L.Lq, L.Lk, L.Dv
    f32 = dict(dtype=torch.float32, device=q3.device)
    hybrid = u_bh is not None
    dOf = dO.float()
    if hybrid:
        delta = u_bh[:, None] * (dOf * out).sum(-1)  # (BH, Lq): dO_D . O_D with dO_D = u dO
        delta_l = (1 - u_bh[:, None]) * (dOf * out_l).sum(-1)
    else:
        delta = (dOf * out).sum(-1)  # (BH, Lq)
        delta_l = L.dummy
    dq = torch.empty(BH, Lq, L.D, **f32)
    dk = torch.empty(BH, Lk, L.D, **f32)
    dv = torch.empty(BH, Lk, Dv, **f32)
    gb = torch.empty(BH, Lk, **f32)
    ga = torch.empty(BH, Lq, **f32)
    ga_next = torch.empty(BH, Lq, **f32) if iters > 1 else L.dummy
    km, qm = L.masks()
    u_arg = L.dummy if u_bh is None else u_bh
    a_l = L.dummy if a_l is None else a_l
    for t in range(iters, 0, -1):
        output = t == iters
        shared = dict(OUTPUT=output, HYBRID=output and hybrid, ACCUM=not output, BLOCK_DV=L.dv_const)
        L.run("col_bwd", q3, k3, v3, dO, b_all[t - 1], a_all[t], qbar[t - 1], delta, ga, a_l,
              delta_l, u_arg, gb, dk, dv, km, qm, L.scale, L.H, Lq, Lk, L.D, Dv, **shared)
        L.run("row_bwd", q3, k3, v3, dO, b_all[t - 1], gb, a_all[t], a_all[t - 1], delta, ga,
              a_l, delta_l, u_arg, dq, ga_next, km, qm, L.scale, L.H, Lq, Lk, L.D, Dv, HAS_PREV=t > 1,
              WANT_GA=t > 1, **shared)
        if t > 1:
            ga, ga_next = ga_next, ga
    return dq, dk, dv


class _TritonPotentials(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, u, km, qm, scale, iters, block):
        B, H, Lq, D = q.shape
        Lk, Dv = k.shape[2], v.shape[3]
        q3 = q.reshape(B * H, Lq, D).contiguous()  # (B*H, Lq, D)
        k3 = k.reshape(B * H, Lk, D).contiguous()  # (B*H, Lk, D)
        v3 = v.reshape(B * H, Lk, Dv).contiguous()  # (B*H, Lk, Dv)
        hybrid = u is not None
        L = _Launch(q3, k3, v3, km, qm, H, scale, block)
        train = any(ctx.needs_input_grad[:4])  # inference (no input requires grad): nothing is saved
        out, a_all, b_all, qbar, out_l, a_l = _forward(L, q3, k3, v3, iters, hybrid, train)
        if train:
            ctx.save_for_backward(q3, k3, v3, u, km, qm, out, a_all, b_all, qbar, out_l, a_l)
        ctx.meta = (B, H, Lq, Lk, D, Dv, scale, iters, block)
        out = out.view(B, H, Lq, Dv)
        if hybrid:  # u * out_D + (1 - u) * out_L
            out = torch.lerp(out_l.view(B, H, Lq, Dv), out, u.float().expand(B, H, 1, 1))
        # not a view (autograd forbids in-place ops on a Function's view outputs): an in-place op on it is
        # allowed, and a backward after it is autograd's in-place error (the saved output shares its version)
        return out.to(q.dtype).detach()

    @staticmethod
    def backward(ctx, grad_out):
        q3, k3, v3, u, km, qm, out, a_all, b_all, qbar, out_l, a_l = ctx.saved_tensors
        B, H, Lq, Lk, D, Dv, scale, iters, block = ctx.meta
        dO = grad_out.to(q3.dtype)  # (B, H, Lq, Dv)
        # the rows of padded queries and of queries without a valid key are the constant 0: a NaN gradient
        # there (o / o.norm() of a zero row) must not reach the real tokens through P^T dO
        rows = None if qm is None else qm.bool()[:, None, :, None]  # (B, 1, Lq, 1)
        if km is not None:
            has_key = km.bool().any(-1)[:, None, None, None]  # (B, 1, 1, 1)
            rows = has_key if rows is None else rows & has_key
        if rows is not None:
            dO = torch.where(rows, dO, torch.zeros((), dtype=dO.dtype, device=dO.device))
        dO = dO.reshape(B * H, Lq, Dv).contiguous()  # (B*H, Lq, Dv)
        u_bh = None if u is None else u.float().expand(B, H, 1, 1).reshape(B * H).contiguous()  # (B*H,)
        L = _Launch(q3, k3, v3, km, qm, H, scale, block)
        dq, dk, dv = _backward(L, q3, k3, v3, dO, out, a_all, b_all, qbar, out_l, a_l, u_bh, iters)
        du = None
        if u is not None and ctx.needs_input_grad[3]:
            # sum of dO * (out_D - out_L)
            du = (dO.float() * (out - out_l)).sum(dim=(-2, -1)).view(B, H, 1, 1)
            du = reduce_to(du, (1,) * (4 - u.dim()) + tuple(u.shape)).reshape(u.shape).to(u.dtype)
        dt = q3.dtype
        return (dq.view(B, H, Lq, D).to(dt), dk.view(B, H, Lk, D).to(dt), dv.view(B, H, Lk, Dv).to(dt), du,
                None, None, None, None, None)
