"""CoDA quasi-attention on CUDA: a Triton kernel in the FlashAttention style (forward and backward).

"Compositional De-Attention Networks", eqs. (1)-(6) and (10); docs/design.md section 3; the tiling and
recomputation follow "FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning"
(arXiv:2307.08691). With ``se = alpha * scale`` and ``sn = beta * scale``:

    E_ij = se * q_i . k_j - mean E,     N_ij = -sn * ||q_i - k_j||_1 - mean N     (means: centered variants)
    M_ij = f_E(E_ij) * g(N_ij)  (0 on invalid pairs),     out_i = sum_j M_ij v_j

with ``g = (f_N - inf f_N) / (sup f_N - inf f_N)``, doubled for ``gate="scaled"`` (``GATE_FNS``). No
normalization, so one sweep over the keys per block of queries computes the output: the ``E`` tile with
``tl.dot``, the ``N`` tile from the L1 distances over ``D`` in chunks, both activations, the mask, and
``M v`` accumulated in float32. Nothing but the inputs is saved for the backward pass, which recomputes the
tiles; with ``dM_ij = dO_i . v_j``:

    dV_j = sum_i M_ij dO_i,   dE_ij = dM_ij g(N_ij) f_E'(E_ij),   dN_ij = dM_ij f_E(E_ij) g'(N_ij)
    dQ_i = se sum_j dE_ij k_j - sn sum_j dN_ij sign(q_i - k_j)      (one program per block of queries)
    dK_j = se sum_i dE_ij q_i + sn sum_i dN_ij sign(q_i - k_j)      (one program per block of keys)

The centered variants (eqs. 4 and 6) take the means over the valid pairs of each (batch, head) matrix: a
first sweep of the forward kernel returns the row sums of ``E``, ``N`` and the valid counts; in the backward
pass the mean passes the gradient ``-sum(dE) / count`` on to every valid pair (``sum(dE)`` from a first
sweep of the query kernel), and likewise for ``N``.

Masks (``MaskInfo``, multiplicative): key padding ``(B, Lk)``, query padding ``(B, Lq)``, causal (top-left
aligned) and a boolean ``attn_mask`` read in place through its broadcast strides; rows without a valid key
return zeros. Inputs float32 / bfloat16 / float16; ``tl.dot`` takes the inputs' dtype (float32 in IEEE
precision, no TF32), everything else is float32. With ``TRITON_INTERPRET=1`` set before Triton is first
imported, the kernels run in Triton's interpreter on CPU tensors (how the test suite checks them).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..config import CoDA
from ..masks import MaskInfo
from ..mechanisms.coda import ACTIVATION_RANGES
from .triton_potentials import _check_mask, _check_shapes

try:
    import triton
    import triton.language as tl

    from . import _triton_coda_kernels as _kernels
    from ._triton_kernels import INTERPRETED

    _TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
    _ACT_IDS = {"tanh": _kernels.TANH, "sigmoid": _kernels.SIGMOID, "arctan": _kernels.ARCTAN,
                "algebraic": _kernels.ALGEBRAIC}
except ImportError:  # pragma: no cover - exercised where triton is not installed
    triton = None

__all__ = ["triton_coda_available", "triton_coda_attention", "TRITON_DTYPES"]

TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def triton_coda_available(q: Tensor) -> bool:
    """True for CUDA tensors of a supported dtype when Triton is importable."""
    return triton is not None and q.is_cuda and q.dtype in TRITON_DTYPES


def triton_coda_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    masks: MaskInfo,
    config: CoDA,
    *,
    scale: float,
    block: Optional[int] = None,
    d_chunk: Optional[int] = None,
) -> Tensor:
    """CoDA output ``(B, H, Lq, Dv)``; equals ``coda_weights(E, N) @ v`` of the reference.

    Shapes: q ``(B, H, Lq, D)``, k ``(B, H, Lk, D)``, v ``(B, H, Lk, Dv)``; ``masks`` built by
    ``attnkit.masks.build_mask`` (no float bias: CoDA's masks are multiplicative). CUDA tensors, or CPU
    tensors under ``TRITON_INTERPRET=1``. ``block``: the tile size (a power of two >= 16; default 32
    compiled, 16 interpreted); ``d_chunk``: the columns of ``D`` per step of the L1 distance (a power of
    two; compiled default 8 for 16-bit inputs and 4 for float32, all of ``D`` interpreted). The compiled
    defaults are the largest whose kernels ptxas builds without register spills for sm_90 at D = 64 and 4
    warps (checked offline; the timings on a GPU are still to be taken).
    """
    if triton is None:
        raise RuntimeError("Triton is not installed; install attnkit[triton] (pip install 'triton==3.9.*')")
    if q.dtype not in TRITON_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(
            f"q, k, v have dtypes {q.dtype}, {k.dtype}, {v.dtype}; the Triton CoDA kernel takes one of "
            f"{[str(d) for d in TRITON_DTYPES]} for all three (use backend='reference' for float64)"
        )
    if not q.is_cuda and not INTERPRETED:
        raise ValueError(
            f"the Triton CoDA kernel got {q.device.type} tensors; it runs on CUDA tensors, or on CPU tensors "
            "in Triton's interpreter (set TRITON_INTERPRET=1 before triton is imported)"
        )
    if masks.bias is not None:
        raise ValueError("CoDA takes boolean masks only (multiplicative); got a float attn_mask bias")
    for name, value in (("block", block), ("d_chunk", d_chunk)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1
                                  or value & (value - 1) or (name == "block" and value < 16)):
            least = " >= 16" if name == "block" else ""
            raise ValueError(f"{name}={value!r}; expected a power of two{least}")
    # the shapes the kernel reads, checked as the potentials wrapper checks them (a mask of a smaller batch
    # was read past its end)
    _check_shapes(q, k, v)
    if q.shape[:2] != k.shape[:2] or k.shape[:2] != v.shape[:2]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: the Triton CoDA "
                         "kernel takes one batch and head size for all three (expand them first)")
    B, H, Lq, D = q.shape
    _check_mask("key_mask", masks.key_mask, B, k.shape[2])
    _check_mask("query_mask", masks.query_mask, B, Lq)
    if masks.pair is not None:
        pair = masks.pair
        if pair.dim() != 4 or any(p not in (1, n) for p, n in zip(pair.shape, (B, H, Lq, k.shape[2]))):
            raise ValueError(f"attn_mask has shape {tuple(pair.shape)}; expected one broadcastable to "
                             f"({B}, {H}, {Lq}, {k.shape[2]})")
    km = None if masks.key_mask is None else masks.key_mask.to(torch.int8).expand(B, -1).contiguous()
    qm = None if masks.query_mask is None else masks.query_mask.to(torch.int8).expand(B, -1).contiguous()
    pm = None if masks.pair is None else masks.pair.to(torch.int8)  # (B|1, H|1, Lq|1, Lk|1), read in place
    if block is None:
        block = 32 if q.is_cuda else 16
    if d_chunk is None:
        d_chunk = (4 if q.dtype == torch.float32 else 8) if q.is_cuda else max(16, triton.next_power_of_2(D))
    tiles = (int(block), int(d_chunk), bool(masks.causal))
    return _TritonCoDA.apply(q, k, v, km, qm, pm, config, float(scale), tiles)


class _Launch:
    """Shapes, tiles, masks and constants shared by every launch of one call."""

    def __init__(self, q3: Tensor, k3: Tensor, v3: Tensor, km, qm, pm, H: int, config: CoDA, scale: float,
                 tiles: tuple[int, int, bool]):
        block, d_chunk, causal = tiles
        self.BH, self.Lq, self.D = q3.shape
        self.Lk, self.Dv, self.H = k3.shape[1], v3.shape[2], H
        self.dummy = q3.new_empty(1, dtype=torch.float32)
        lo, hi = ACTIVATION_RANGES[config.n_activation]
        pm_strides = (0, 0, 0, 0) if pm is None else tuple(s if n > 1 else 0 for s, n in
                                                           zip(pm.stride(), pm.shape))
        self.mask_args = (self.dummy if km is None else km, self.dummy if qm is None else qm,
                          self.dummy if pm is None else pm, *pm_strides)
        self.scalars = (config.alpha * scale, config.beta * scale, lo,
                        (2.0 if config.gate == "scaled" else 1.0) / (hi - lo), H, self.Lq, self.Lk, self.D,
                        self.Dv)
        self.center_e, self.center_n = config.center_e, config.gate == "centered"
        dot_t = tl.float32 if (q3.dtype == torch.bfloat16 and not q3.is_cuda) else _TL_DTYPES[q3.dtype]
        self.consts = dict(
            CENTER_E=self.center_e, CENTER_N=self.center_n, E_ACT=_ACT_IDS[config.e_activation],
            N_ACT=_ACT_IDS[config.n_activation], HAS_KM=km is not None, HAS_QM=qm is not None,
            HAS_PM=pm is not None, CAUSAL=causal, BLOCK_M=block, BLOCK_N=block,
            BLOCK_D=max(16, triton.next_power_of_2(self.D)),
            BLOCK_DV=max(16, triton.next_power_of_2(self.Dv)),
            BLOCK_DC=min(d_chunk, max(16, triton.next_power_of_2(self.D))),
            PREC="ieee" if q3.dtype == torch.float32 else "tf32", IN_T=_TL_DTYPES[q3.dtype], DOT_T=dot_t,
        )
        self.grid_rows = (self.BH, triton.cdiv(self.Lq, block))
        self.grid_cols = (self.BH, triton.cdiv(self.Lk, block))

    def run(self, name: str, grid, *pointers, **consts):
        _kernels.KERNELS[name][grid](*pointers, *self.mask_args, *self.scalars, **consts, **self.consts)

    def per_head(self, rows: Tensor) -> Tensor:
        """Row partial sums ``(BH, Lq)`` -> ``(BH,)`` in float64 (many terms)."""
        return rows.double().sum(-1)


def _means(L: _Launch, q3, k3, v3) -> tuple[Tensor, Tensor, Tensor]:
    """``mean E``, ``mean N`` over the valid pairs of each head and their count (at least 1), ``(BH,)``
    each (means float32, zeros where the variant does not center; count float64)."""
    f32 = dict(dtype=torch.float32, device=q3.device)
    zero = torch.zeros(L.BH, **f32)
    if not (L.center_e or L.center_n):
        return zero, zero, zero.double()
    se, sn, cnt = (torch.empty(L.BH, L.Lq, **f32) for _ in range(3))
    L.run("row_fwd", L.grid_rows, q3, k3, v3, L.dummy, se, sn, cnt, zero, zero, SUMS=True)
    count = L.per_head(cnt).clamp_min(1)
    return (L.per_head(se) / count).float(), (L.per_head(sn) / count).float(), count


class _TritonCoDA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, km, qm, pm, config, scale, tiles):
        B, H, Lq, D = q.shape
        Lk, Dv = k.shape[2], v.shape[3]
        q3 = q.reshape(B * H, Lq, D).contiguous()  # (B*H, Lq, D)
        k3 = k.reshape(B * H, Lk, D).contiguous()  # (B*H, Lk, D)
        v3 = v.reshape(B * H, Lk, Dv).contiguous()  # (B*H, Lk, Dv)
        L = _Launch(q3, k3, v3, km, qm, pm, H, config, scale, tiles)
        mean_e, mean_n, count = _means(L, q3, k3, v3)
        out = torch.empty(B * H, Lq, Dv, dtype=torch.float32, device=q.device)
        L.run("row_fwd", L.grid_rows, q3, k3, v3, out, L.dummy, L.dummy, L.dummy, mean_e, mean_n, SUMS=False)
        if any(ctx.needs_input_grad[:3]):  # inference (no input requires grad): nothing is saved
            ctx.save_for_backward(q3, k3, v3, km, qm, pm, mean_e, mean_n, count)
        ctx.meta = (B, H, Lq, Lk, D, Dv, config, scale, tiles)
        # not a view (autograd forbids in-place ops on a Function's view outputs): an in-place op on it is
        # allowed (the backward does not read it)
        return out.view(B, H, Lq, Dv).to(q.dtype).detach()

    @staticmethod
    def backward(ctx, grad_out):
        q3, k3, v3, km, qm, pm, mean_e, mean_n, count = ctx.saved_tensors
        B, H, Lq, Lk, D, Dv, config, scale, tiles = ctx.meta
        dO = grad_out.to(q3.dtype)  # (B, H, Lq, Dv)
        if qm is not None:  # padded queries' rows are the constant 0: a NaN gradient there must not spread
            zero = torch.zeros((), dtype=dO.dtype, device=dO.device)
            dO = torch.where(qm.bool()[:, None, :, None], dO, zero)
        dO = dO.reshape(B * H, Lq, Dv).contiguous()  # (B*H, Lq, Dv)
        L = _Launch(q3, k3, v3, km, qm, pm, H, config, scale, tiles)
        f32 = dict(dtype=torch.float32, device=q3.device)
        ce = cn = torch.zeros(L.BH, **f32)
        if L.center_e or L.center_n:  # the mean's share of each valid pair: sum(dE) / count (and for N)
            sde, sdn = (torch.empty(L.BH, Lq, **f32) for _ in range(2))
            L.run("row_bwd", L.grid_rows, q3, k3, v3, dO, L.dummy, sde, sdn, mean_e, mean_n, ce, cn,
                  SUMS=True)
            ce, cn = (L.per_head(sde) / count).float(), (L.per_head(sdn) / count).float()
        dq = torch.zeros(L.BH, Lq, D, **f32)  # the kernels accumulate the L1 part in place
        dk = torch.zeros(L.BH, Lk, D, **f32)
        dv = torch.empty(L.BH, Lk, Dv, **f32)
        L.run("row_bwd", L.grid_rows, q3, k3, v3, dO, dq, L.dummy, L.dummy, mean_e, mean_n, ce, cn,
              SUMS=False)
        L.run("col_bwd", L.grid_cols, q3, k3, v3, dO, dk, dv, mean_e, mean_n, ce, cn)
        dt = q3.dtype
        return (dq.view(B, H, Lq, D).to(dt), dk.view(B, H, Lk, D).to(dt), dv.view(B, H, Lk, Dv).to(dt),
                None, None, None, None, None, None)
