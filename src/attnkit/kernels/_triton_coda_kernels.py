"""Triton kernels of ``triton_coda`` (CoDA quasi-attention): one forward and two backward sweeps.

The equations and the conventions are in ``triton_coda``' docstring. This module imports Triton at the top,
so only import it where Triton is installed. With ``TRITON_INTERPRET=1`` in the environment when Triton is
first imported, the kernels run in Triton's interpreter on CPU tensors (how the tests run them).

Layout: q (BH, Lq, D), k (BH, Lk, D), v (BH, Lk, Dv), dO (BH, Lq, Dv) contiguous; means and corrections
(BH,) float32; key mask (B, Lk), query mask (B, Lq) int8; the pair mask int8 read through four strides
(batch, head, query, key; 0 where it broadcasts). Head ``bh`` is batch element ``bh // H``, head ``bh % H``.
Program ids: (bh, block). The L1 distance runs over ``D`` in chunks of ``BLOCK_DC`` columns, so the widest
temporary holds ``BLOCK_M * BLOCK_N * BLOCK_DC`` values; the L1 part of ``dQ`` / ``dK`` is accumulated chunk
by chunk in the float32 output buffer (zero-initialized, each block owned by one program). The axis that a
chunk is summed over comes first in those temporaries (``(C, M, N)`` for the distance, ``(N, C, M)`` /
``(M, C, N)`` for the gradients): Triton's layout then keeps it within each thread, and the sums take no
shuffles between lanes. Summed over the last axis, the sm_90 builds (bfloat16, 32 x 32 tiles, chunks of 8)
spent 2.7x the instructions per tile step in the forward (5078 against 1892, 192 of them lane shuffles per
chunk) and 1.5x in the backward kernels; counted in the SASS, not yet timed on a GPU.
"""

import triton
import triton.language as tl

__all__ = ["KERNELS", "TANH", "SIGMOID", "ARCTAN", "ALGEBRAIC"]

TANH, SIGMOID, ARCTAN, ALGEBRAIC = 0, 1, 2, 3


@triton.jit
def _atan(x):
    """arctan in float32 (Cephes ``atanf``: range reduction to |x| <= tan(pi/8), then a degree-9 odd
    polynomial; error ~1e-7). Triton's interpreter has no libdevice, so it is written out."""
    ax = tl.abs(x)
    big = ax > 2.414213562373095
    mid = (ax > 0.4142135623730950) & (~big)
    safe = tl.where(ax > 0.0, ax, 1.0)
    r = tl.where(big, -1.0 / safe, tl.where(mid, (ax - 1.0) / (ax + 1.0), ax))
    y0 = tl.where(big, 1.5707963267948966, tl.where(mid, 0.7853981633974483, 0.0))
    z = r * r
    p = ((8.05374449538e-2 * z - 1.38776856032e-1) * z + 1.99777106478e-1) * z - 3.33329491539e-1
    p = p * z * r + r
    y = y0 + p
    return tl.where(x < 0.0, -y, y)


@triton.jit
def _act(x, ACT: tl.constexpr):
    """``f(x)`` and ``f'(x)`` of one activation (``TANH``, ``SIGMOID``, ``ARCTAN``, ``ALGEBRAIC``)."""
    if ACT == 0:  # tanh, from exp(-2|x|) <= 1 (no overflow)
        t = tl.exp(-2.0 * tl.abs(x))
        f = (1.0 - t) / (1.0 + t)
        f = tl.where(x < 0.0, -f, f)
        df = 1.0 - f * f
    elif ACT == 1:  # sigmoid
        f = 1.0 / (1.0 + tl.exp(-x))
        df = f * (1.0 - f)
    elif ACT == 2:  # arctan
        f = _atan(x)
        df = 1.0 / (1.0 + x * x)
    else:  # algebraic x / sqrt(1 + x^2)
        r = tl.rsqrt(1.0 + x * x)
        f = x * r
        df = r * r * r
    return f, df


@triton.jit
def _valid(KM, QM, PM, batch, head, offs_m, offs_n, row_in, col_in, Lq, Lk, pm_b, pm_h, pm_i, pm_j,
           HAS_KM: tl.constexpr, HAS_QM: tl.constexpr, HAS_PM: tl.constexpr, CAUSAL: tl.constexpr):
    """Validity of the tile ``(BLOCK_M, BLOCK_N)``: inside the matrix and allowed by every mask."""
    inside = row_in[:, None] & col_in[None, :]
    valid = inside
    if HAS_KM:
        valid = valid & (tl.load(KM + batch * Lk + offs_n, mask=col_in, other=0) != 0)[None, :]
    if HAS_QM:
        valid = valid & (tl.load(QM + batch * Lq + offs_m, mask=row_in, other=0) != 0)[:, None]
    if CAUSAL:
        valid = valid & (offs_n[None, :] <= offs_m[:, None])
    if HAS_PM:
        pm = tl.load(PM + batch * pm_b + head * pm_h + offs_m[:, None] * pm_i + offs_n[None, :] * pm_j,
                     mask=inside, other=0)
        valid = valid & (pm != 0)
    return valid


@triton.jit
def _tile(Q, K, qb, kb, q_base, k_base, offs_m, offs_n, row_in, col_in, D, se, sn, mean_e, mean_n,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DC: tl.constexpr, PREC: tl.constexpr):
    """``E = se * q k^T - mean_e`` (``tl.dot`` of the loaded tiles ``qb``, ``kb``) and
    ``N = -sn * ||q_i - k_j||_1 - mean_n`` (float32, ``D`` in chunks of ``BLOCK_DC``), ``(M, N)`` each."""
    e = tl.dot(qb, tl.trans(kb), input_precision=PREC) * se - mean_e
    dist = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for d0 in range(0, D, BLOCK_DC):
        offs_c = d0 + tl.arange(0, BLOCK_DC)
        qc = tl.load(Q + q_base + offs_m[None, :] * D + offs_c[:, None],
                     mask=row_in[None, :] & (offs_c[:, None] < D), other=0.0).to(tl.float32)  # (C, M)
        kc = tl.load(K + k_base + offs_n[None, :] * D + offs_c[:, None],
                     mask=col_in[None, :] & (offs_c[:, None] < D), other=0.0).to(tl.float32)  # (C, N)
        dist += tl.sum(tl.abs(qc[:, :, None] - kc[:, None, :]), axis=0)  # (M, N)
    n = -sn * dist - mean_n
    return e, n


@triton.jit
def _l1_grad(Q, K, G, dn, q_base, k_base, offs_m, offs_n, row_in, col_in, D,
             ROWS: tl.constexpr, BLOCK_DC: tl.constexpr):
    """Add ``sum_j dn_ij sign(q_i - k_j)`` (``ROWS``, into ``G`` rows ``offs_m``) or
    ``sum_i dn_ij sign(q_i - k_j)`` (into ``G`` rows ``offs_n``), chunk by chunk over ``D``."""
    if ROWS:
        dnt = tl.trans(dn)[:, None, :]  # (N, 1, M)
    else:
        dnt = dn[:, None, :]  # (M, 1, N)
    for d0 in range(0, D, BLOCK_DC):
        offs_c = d0 + tl.arange(0, BLOCK_DC)
        c_in = offs_c < D
        if ROWS:
            qc = tl.load(Q + q_base + offs_m[None, :] * D + offs_c[:, None],
                         mask=row_in[None, :] & c_in[:, None], other=0.0).to(tl.float32)  # (C, M)
            kc = tl.load(K + k_base + offs_n[:, None] * D + offs_c[None, :],
                         mask=col_in[:, None] & c_in[None, :], other=0.0).to(tl.float32)  # (N, C)
            diff = qc[None, :, :] - kc[:, :, None]  # (N, C, M)
            ptr = G + q_base + offs_m[None, :] * D + offs_c[:, None]
            msk = row_in[None, :] & c_in[:, None]
        else:
            qc = tl.load(Q + q_base + offs_m[:, None] * D + offs_c[None, :],
                         mask=row_in[:, None] & c_in[None, :], other=0.0).to(tl.float32)  # (M, C)
            kc = tl.load(K + k_base + offs_n[None, :] * D + offs_c[:, None],
                         mask=col_in[None, :] & c_in[:, None], other=0.0).to(tl.float32)  # (C, N)
            diff = qc[:, :, None] - kc[None, :, :]  # (M, C, N)
            ptr = G + k_base + offs_n[None, :] * D + offs_c[:, None]
            msk = col_in[None, :] & c_in[:, None]
        # dn * sign(diff), sign(0) = 0; reduced over the leading axis (the one each thread holds)
        part = tl.sum(tl.where(diff > 0.0, dnt, 0.0) - tl.where(diff < 0.0, dnt, 0.0), axis=0)  # (C, M|N)
        tl.store(ptr, tl.load(ptr, mask=msk, other=0.0) + part, mask=msk)
        tl.debug_barrier()


@triton.jit
def _grads(e, n, valid, dov, ce, cn, g_lo, g_scale, E_ACT: tl.constexpr, N_ACT: tl.constexpr):
    """``M`` and the gradients of the loss wrt ``E`` and ``N`` on one tile (0 on invalid pairs), with the
    corrections ``ce`` / ``cn`` of the centered variants (the mean's share of each pair)."""
    fe, dfe = _act(e, E_ACT)
    fn, dfn = _act(n, N_ACT)
    g = (fn - g_lo) * g_scale
    m = tl.where(valid, fe * g, 0.0)
    dm = tl.where(valid, dov, 0.0)
    de = tl.where(valid, dm * g * dfe - ce, 0.0)
    dn = tl.where(valid, dm * fe * dfn * g_scale - cn, 0.0)
    return m, de, dn


@triton.jit
def _row_forward(
    Q, K, V, Out, SE, SN, CNT, MEAN_E, MEAN_N, KM, QM, PM, pm_b, pm_h, pm_i, pm_j,
    se, sn, g_lo, g_scale, H, Lq, Lk, D, Dv,
    SUMS: tl.constexpr, CENTER_E: tl.constexpr, CENTER_N: tl.constexpr, E_ACT: tl.constexpr,
    N_ACT: tl.constexpr, HAS_KM: tl.constexpr, HAS_QM: tl.constexpr, HAS_PM: tl.constexpr,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_DC: tl.constexpr, PREC: tl.constexpr, IN_T: tl.constexpr,
    DOT_T: tl.constexpr,
):
    """One block of queries: ``out_i = sum_j M_ij v_j``; with ``SUMS`` instead the row sums of ``E`` and
    ``N`` over the valid pairs and their count (for the means of the centered variants)."""
    bh = tl.program_id(0).to(tl.int64)
    ib = tl.program_id(1)
    batch, head = bh // H, bh % H
    offs_m = ib * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_in = offs_m < Lq
    q_base, k_base, v_base = bh * Lq * D, bh * Lk * D, bh * Lk * Dv
    qb = tl.load(Q + q_base + offs_m[:, None] * D + offs_d[None, :],
                 mask=row_in[:, None] & (offs_d[None, :] < D), other=0.0).to(DOT_T)  # (M, Dp)
    mean_e = 0.0
    mean_n = 0.0
    if CENTER_E:
        mean_e = tl.load(MEAN_E + bh)
    if CENTER_N:
        mean_n = tl.load(MEAN_N + bh)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    sum_e = tl.zeros([BLOCK_M], tl.float32)
    sum_n = tl.zeros([BLOCK_M], tl.float32)
    count = tl.zeros([BLOCK_M], tl.float32)
    for j0 in range(0, Lk, BLOCK_N):
        offs_n = j0 + tl.arange(0, BLOCK_N)
        col_in = offs_n < Lk
        kb = tl.load(K + k_base + offs_n[:, None] * D + offs_d[None, :],
                     mask=col_in[:, None] & (offs_d[None, :] < D), other=0.0).to(DOT_T)  # (N, Dp)
        valid = _valid(KM, QM, PM, batch, head, offs_m, offs_n, row_in, col_in, Lq, Lk, pm_b, pm_h, pm_i,
                       pm_j, HAS_KM, HAS_QM, HAS_PM, CAUSAL)
        e, n = _tile(Q, K, qb, kb, q_base, k_base, offs_m, offs_n, row_in, col_in, D, se, sn, mean_e,
                     mean_n, BLOCK_M, BLOCK_N, BLOCK_DC, PREC)
        if SUMS:
            sum_e += tl.sum(tl.where(valid, e, 0.0), axis=1)
            sum_n += tl.sum(tl.where(valid, n, 0.0), axis=1)
            count += tl.sum(valid.to(tl.float32), axis=1)
        else:
            fe, _ = _act(e, E_ACT)
            fn, _ = _act(n, N_ACT)
            m = tl.where(valid, fe * ((fn - g_lo) * g_scale), 0.0)  # (M, N)
            vb = tl.load(V + v_base + offs_n[:, None] * Dv + offs_dv[None, :],
                         mask=col_in[:, None] & (offs_dv[None, :] < Dv), other=0.0).to(DOT_T)  # (N, Dvp)
            acc += tl.dot(m.to(IN_T).to(DOT_T), vb, input_precision=PREC)
    if SUMS:
        tl.store(SE + bh * Lq + offs_m, sum_e, mask=row_in)
        tl.store(SN + bh * Lq + offs_m, sum_n, mask=row_in)
        tl.store(CNT + bh * Lq + offs_m, count, mask=row_in)
    else:
        tl.store(Out + bh * Lq * Dv + offs_m[:, None] * Dv + offs_dv[None, :], acc,
                 mask=row_in[:, None] & (offs_dv[None, :] < Dv))


@triton.jit
def _row_backward(
    Q, K, V, DO, DQ, SE, SN, MEAN_E, MEAN_N, CE, CN, KM, QM, PM, pm_b, pm_h, pm_i, pm_j,
    se, sn, g_lo, g_scale, H, Lq, Lk, D, Dv,
    SUMS: tl.constexpr, CENTER_E: tl.constexpr, CENTER_N: tl.constexpr, E_ACT: tl.constexpr,
    N_ACT: tl.constexpr, HAS_KM: tl.constexpr, HAS_QM: tl.constexpr, HAS_PM: tl.constexpr,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_DC: tl.constexpr, PREC: tl.constexpr, IN_T: tl.constexpr,
    DOT_T: tl.constexpr,
):
    """One block of queries: ``dQ_i = se sum_j dE_ij k_j - sn sum_j dN_ij sign(q_i - k_j)``; with
    ``SUMS`` instead the row sums of the uncorrected ``dE``, ``dN`` (the centered variants' corrections)."""
    bh = tl.program_id(0).to(tl.int64)
    ib = tl.program_id(1)
    batch, head = bh // H, bh % H
    offs_m = ib * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_in = offs_m < Lq
    q_base, k_base, v_base = bh * Lq * D, bh * Lk * D, bh * Lk * Dv
    q_mask = row_in[:, None] & (offs_d[None, :] < D)
    qb = tl.load(Q + q_base + offs_m[:, None] * D + offs_d[None, :], mask=q_mask, other=0.0).to(DOT_T)
    dob = tl.load(DO + bh * Lq * Dv + offs_m[:, None] * Dv + offs_dv[None, :],
                  mask=row_in[:, None] & (offs_dv[None, :] < Dv), other=0.0).to(DOT_T)  # (M, Dvp)
    mean_e = 0.0
    mean_n = 0.0
    ce = 0.0
    cn = 0.0
    if CENTER_E:
        mean_e = tl.load(MEAN_E + bh)
        if not SUMS:
            ce = tl.load(CE + bh)
    if CENTER_N:
        mean_n = tl.load(MEAN_N + bh)
        if not SUMS:
            cn = tl.load(CN + bh)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    sum_de = tl.zeros([BLOCK_M], tl.float32)
    sum_dn = tl.zeros([BLOCK_M], tl.float32)
    for j0 in range(0, Lk, BLOCK_N):
        offs_n = j0 + tl.arange(0, BLOCK_N)
        col_in = offs_n < Lk
        kb = tl.load(K + k_base + offs_n[:, None] * D + offs_d[None, :],
                     mask=col_in[:, None] & (offs_d[None, :] < D), other=0.0).to(DOT_T)  # (N, Dp)
        vb = tl.load(V + v_base + offs_n[:, None] * Dv + offs_dv[None, :],
                     mask=col_in[:, None] & (offs_dv[None, :] < Dv), other=0.0).to(DOT_T)  # (N, Dvp)
        valid = _valid(KM, QM, PM, batch, head, offs_m, offs_n, row_in, col_in, Lq, Lk, pm_b, pm_h, pm_i,
                       pm_j, HAS_KM, HAS_QM, HAS_PM, CAUSAL)
        e, n = _tile(Q, K, qb, kb, q_base, k_base, offs_m, offs_n, row_in, col_in, D, se, sn, mean_e,
                     mean_n, BLOCK_M, BLOCK_N, BLOCK_DC, PREC)
        dov = tl.dot(dob, tl.trans(vb), input_precision=PREC)  # (M, N): dO_i . v_j
        _, de, dn = _grads(e, n, valid, dov, ce, cn, g_lo, g_scale, E_ACT, N_ACT)
        if SUMS:
            sum_de += tl.sum(de, axis=1)
            sum_dn += tl.sum(dn, axis=1)
        else:
            dq += tl.dot(de.to(IN_T).to(DOT_T), kb, input_precision=PREC)
            _l1_grad(Q, K, DQ, dn, q_base, k_base, offs_m, offs_n, row_in, col_in, D, True, BLOCK_DC)
    if SUMS:
        tl.store(SE + bh * Lq + offs_m, sum_de, mask=row_in)
        tl.store(SN + bh * Lq + offs_m, sum_dn, mask=row_in)
    else:
        dq_ptr = DQ + q_base + offs_m[:, None] * D + offs_d[None, :]
        l1 = tl.load(dq_ptr, mask=q_mask, other=0.0)
        tl.store(dq_ptr, dq * se - l1 * sn, mask=q_mask)


@triton.jit
def _col_backward(
    Q, K, V, DO, DK, DV, MEAN_E, MEAN_N, CE, CN, KM, QM, PM, pm_b, pm_h, pm_i, pm_j,
    se, sn, g_lo, g_scale, H, Lq, Lk, D, Dv,
    CENTER_E: tl.constexpr, CENTER_N: tl.constexpr, E_ACT: tl.constexpr,
    N_ACT: tl.constexpr, HAS_KM: tl.constexpr, HAS_QM: tl.constexpr, HAS_PM: tl.constexpr,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_DC: tl.constexpr, PREC: tl.constexpr, IN_T: tl.constexpr,
    DOT_T: tl.constexpr,
):
    """One block of keys: ``dV_j = sum_i M_ij dO_i`` and
    ``dK_j = se sum_i dE_ij q_i + sn sum_i dN_ij sign(q_i - k_j)``."""
    bh = tl.program_id(0).to(tl.int64)
    jb = tl.program_id(1)
    batch, head = bh // H, bh % H
    offs_n = jb * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    col_in = offs_n < Lk
    q_base, k_base, v_base = bh * Lq * D, bh * Lk * D, bh * Lk * Dv
    k_mask = col_in[:, None] & (offs_d[None, :] < D)
    v_mask = col_in[:, None] & (offs_dv[None, :] < Dv)
    kb = tl.load(K + k_base + offs_n[:, None] * D + offs_d[None, :], mask=k_mask, other=0.0).to(DOT_T)
    vb = tl.load(V + v_base + offs_n[:, None] * Dv + offs_dv[None, :], mask=v_mask, other=0.0).to(DOT_T)
    mean_e = 0.0
    mean_n = 0.0
    ce = 0.0
    cn = 0.0
    if CENTER_E:
        mean_e = tl.load(MEAN_E + bh)
        ce = tl.load(CE + bh)
    if CENTER_N:
        mean_n = tl.load(MEAN_N + bh)
        cn = tl.load(CN + bh)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    for i0 in range(0, Lq, BLOCK_M):
        offs_m = i0 + tl.arange(0, BLOCK_M)
        row_in = offs_m < Lq
        qb = tl.load(Q + q_base + offs_m[:, None] * D + offs_d[None, :],
                     mask=row_in[:, None] & (offs_d[None, :] < D), other=0.0).to(DOT_T)  # (M, Dp)
        dob = tl.load(DO + bh * Lq * Dv + offs_m[:, None] * Dv + offs_dv[None, :],
                      mask=row_in[:, None] & (offs_dv[None, :] < Dv), other=0.0).to(DOT_T)  # (M, Dvp)
        valid = _valid(KM, QM, PM, batch, head, offs_m, offs_n, row_in, col_in, Lq, Lk, pm_b, pm_h, pm_i,
                       pm_j, HAS_KM, HAS_QM, HAS_PM, CAUSAL)
        e, n = _tile(Q, K, qb, kb, q_base, k_base, offs_m, offs_n, row_in, col_in, D, se, sn, mean_e,
                     mean_n, BLOCK_M, BLOCK_N, BLOCK_DC, PREC)
        dov = tl.dot(dob, tl.trans(vb), input_precision=PREC)  # (M, N)
        m, de, dn = _grads(e, n, valid, dov, ce, cn, g_lo, g_scale, E_ACT, N_ACT)
        dv += tl.dot(tl.trans(m).to(IN_T).to(DOT_T), dob, input_precision=PREC)
        dk += tl.dot(tl.trans(de).to(IN_T).to(DOT_T), qb, input_precision=PREC)
        _l1_grad(Q, K, DK, dn, q_base, k_base, offs_m, offs_n, row_in, col_in, D, False, BLOCK_DC)
    dk_ptr = DK + k_base + offs_n[:, None] * D + offs_d[None, :]
    l1 = tl.load(dk_ptr, mask=k_mask, other=0.0)
    tl.store(dk_ptr, dk * se + l1 * sn, mask=k_mask)
    tl.store(DV + v_base + offs_n[:, None] * Dv + offs_dv[None, :], dv, mask=v_mask)


KERNELS = {"row_fwd": _row_forward, "row_bwd": _row_backward, "col_bwd": _col_backward}
