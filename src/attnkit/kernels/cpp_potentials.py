"""DNAS, HNAS and Sinkhorn on the CPU through the C++ kernels of ``csrc/potentials_cpu.cpp``.

"Attention that does not Explain Away" (arXiv:2009.14308), sections 3.1-3.2 and 5; "Doubly-Normalized
Attention",
eqs. (6)-(8); docs/design.md section 2. The kernel computes ``k`` rounds of log-domain potentials

    b^t_j = -LSE_i (s_ij + a^{t-1}_i),    a^t_i = -LSE_j (s_ij + b^t_j),    a^0 = 0,
    out_i = sum_j exp(s_ij + b^k_j + a^k_i) v_j,

(``k = 1`` DNAS, ``k > 1`` Sinkhorn) in strips of keys that hold every query, so that each column
log-sum-exp is complete within its strip and nothing ``(Lq, Lk)``-shaped is stored; the backward pass
recomputes the strips and is exact. HNAS (``u * out_D + (1 - u) * out_L``) computes its softmax half in
the same sweeps, sharing the scores and ``dO V^T``; ``k = 0`` is softmax alone (each query chunk sweeps the
keys with a running maximum per row), for softmax with attention dropout (route ``cpp_softmax``). Padding
masks (``key_mask``, ``query_mask``) are handled by compaction inside the kernel; ``attn_mask`` and causal
calls use ``blockwise.py``. Attention
dropout drops the final weights with a hash of (seed, head, query, key) that the backward pass replays, so
nothing mask-sized is stored (the seed is drawn from PyTorch's default generator).

Without the softmax half the forward runs in the scaling domain: round 1 takes ``E = exp(s - u)`` against
Cauchy-Schwarz bounds ``u`` on the scores of each query chunk (no pass for the column maxima), and a later
Sinkhorn round is a weighted sum of ``E`` over each column (no exponentials), as long as the potentials of a
chunk spread over less than 25 (float32); otherwise, and for columns whose bound is too loose, the kernel
falls back to exact log-domain steps. Sinkhorn's rounds all read the same scores: the kernel keeps ``E`` (or
the scores) of as many key strips as fit in ``SCORE_CACHE_BYTES`` (shared by the worker threads) from the
first sweep that computes them, and the later sweeps of the forward and of the backward read them back
instead of recomputing them; the results do not depend on the budget (``0`` turns it off). The budget is
64 MiB (a whole float32 head at L=4096) unless the environment variable ``ATTNKIT_SCORE_CACHE_MB`` sets
another: at L=8192 a head's exponentials take 256 MiB, and a budget that holds them all
(``ATTNKIT_SCORE_CACHE_MB=256``) saves the recomputation of three quarters of the strips in every later round.
A head whose scores need more than one thread's share of the budget runs after the others with its query
chunks spread over the threads and the whole budget (8 heads at L=4096 on 2 threads: all of each head's
scores kept instead of half). DNAS and HNAS (one round) keep nothing.

Scratch blocks of 2 MiB and more (the strips, the kept exponentials) stay allocated between calls, up to
128 MiB in all, so that a call does not pay for first touching fresh memory (page faults and zero-filling: a
sixth of a Sinkhorn forward of one head at L=4096); ``scratch_bytes()`` says how much is kept and
``release_scratch()`` frees it.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import Tensor

from . import cpu_ext
from .blocking import reduce_to

__all__ = [
    "fused_cpu_available", "fused_cpu_attention", "SCORE_CACHE_BYTES", "score_cache_bytes", "scratch_bytes",
    "release_scratch",
]

# bytes of exponentials (or scores) kept between Sinkhorn rounds: a whole 4096 x 4096 float32 head, one thread
SCORE_CACHE_BYTES = 64 * 2**20
SCORE_CACHE_ENV = "ATTNKIT_SCORE_CACHE_MB"
_SCORE_CACHE_MAX_MIB = 2**24  # 16 TiB


def score_cache_bytes() -> int:
    """The budget of kept Sinkhorn scores, shared by the threads: ``ATTNKIT_SCORE_CACHE_MB`` MiB when set
    (an integer >= 0; 0 keeps nothing), else ``SCORE_CACHE_BYTES`` (64 MiB)."""
    raw = os.environ.get(SCORE_CACHE_ENV)
    if raw is None or raw.strip() == "":
        return SCORE_CACHE_BYTES
    text = raw.strip()
    # int() would take "1_0" and "+8", and refuses more than 4300 digits in its own words
    mib = int(text) if text.isascii() and text.isdigit() and len(text) <= 20 else -1
    if not 0 <= mib <= _SCORE_CACHE_MAX_MIB:  # above it the byte count leaves the kernels' int64
        raise ValueError(
            f"{SCORE_CACHE_ENV}={raw!r}; expected a whole number of MiB in [0, {_SCORE_CACHE_MAX_MIB}] "
            "(default 64; 256 keeps a whole head at L=8192)"
        )
    return mib * 2**20
# queries per chunk of a key strip (fewer when one head is spread over the threads); large chunks amortize the
# packing of the GEMMs' shared operand, small ones let the tests cover several chunks with small inputs
QUERY_CHUNK_ROWS = 1024


def scratch_bytes() -> int:
    """Bytes of scratch memory the C++ kernels keep between calls (at most 128 MiB; 0 before any call)."""
    return int(torch.ops.attnkit_cpu.scratch_pool_bytes()) if cpu_ext.load(warn=False) else 0


def release_scratch() -> None:
    """Free the scratch memory the C++ kernels keep between calls (the next call allocates it again)."""
    if cpu_ext.load(warn=False):
        torch.ops.attnkit_cpu.release_scratch()


def fused_cpu_available(q: Tensor) -> bool:
    """True for CPU tensors when the C++ extension is built (it is built on the first call)."""
    return (
        q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
        and (cpu_ext.load())
    )


def fused_cpu_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    key_mask: Optional[Tensor],
    query_mask: Optional[Tensor],
    scale: float,
    iters: int,
    u: Optional[Tensor] = None,
    dropout_p: float = 0.0,
) -> Tensor:
    """Output ``(B, H, Lq, Dv)`` of softmax (``iters=0``), DNAS (``iters=1``), Sinkhorn (``iters=k``) or,
    with ``u`` (broadcastable to ``(B, H, 1, 1)``), the hybrid ``u * out(iters) + (1 - u) * out(softmax)``.

    ``key_mask (B, Lk)`` / ``query_mask (B, Lq)``: True = real. Padded queries and queries without a
    valid key return zeros; padded queries never enter a column normalization. Half-precision inputs
    are computed in float32 and the result is cast back. ``dropout_p > 0`` drops the final weights
    ``pi_ij`` (kept ones scaled by ``1 / (1 - p)``, ``p`` rounded to a multiple of ``2**-16``), as
    ``F.dropout`` on the materialized weights would.
    """
    if iters < 0:
        raise ValueError(f"iters={iters}; expected 0 (softmax alone) or more normalization rounds")
    if iters == 0 and u is not None:
        raise ValueError("u (a hybrid weight) needs iters >= 1; iters=0 is softmax alone")
    if not cpu_ext.load():
        raise RuntimeError(f"the C++ CPU kernels are not available ({cpu_ext.load_error()})")
    dtype = q.dtype
    work = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    B = max(q.shape[0], k.shape[0], v.shape[0])
    H = max(q.shape[1], k.shape[1], v.shape[1])
    q = q.to(work).expand(B, H, -1, -1)
    k = k.to(work).expand(B, H, -1, -1)
    v = v.to(work).expand(B, H, -1, -1)
    km = None if key_mask is None else key_mask.to(torch.bool).expand(B, -1).contiguous()
    qm = None if query_mask is None else query_mask.to(torch.bool).expand(B, -1).contiguous()
    seed = int(torch.randint(0, 2**62, (1,)).item()) if dropout_p > 0 else 0
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, u))
    if needs_grad:
        out = _Potentials.apply(q, k, v, u, km, qm, scale, iters, float(dropout_p), seed)
    else:
        out = _inference(q, k, v, u, km, qm, scale, iters, float(dropout_p), seed)
    return out.to(dtype)


def _inference(q, k, v, u, km, qm, scale, iters, dropout_p, seed) -> Tensor:
    """The forward pass alone (``potentials_inference``): the same arithmetic as the training forward, so
    the output is bit-identical, without the potentials and row statistics that only the backward reads."""
    B, H, Lq, D = q.shape
    Lk, Dv = k.shape[2], v.shape[3]
    out, out_l = torch.ops.attnkit_cpu.potentials_inference(
        q.reshape(B * H, Lq, D).contiguous(), k.reshape(B * H, Lk, D).contiguous(),
        v.reshape(B * H, Lk, Dv).contiguous(), km, qm, H, float(scale), int(iters), u is not None,
        dropout_p, seed, score_cache_bytes(), QUERY_CHUNK_ROWS,
    )  # (B*H, Lq, Dv), [(B*H, Lq, Dv)]
    out = out.view(B, H, Lq, Dv)
    if u is not None:  # as in _Potentials.forward
        return torch.lerp(out_l.view(B, H, Lq, Dv), out, u.to(out.dtype).expand(B, H, 1, 1))
    return out


class _Potentials(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, u, km, qm, scale, iters, dropout_p, seed):
        B, H, Lq, D = q.shape
        Lk, Dv = k.shape[2], v.shape[3]
        q3 = q.reshape(B * H, Lq, D).contiguous()  # (B*H, Lq, D)
        k3 = k.reshape(B * H, Lk, D).contiguous()  # (B*H, Lk, D)
        v3 = v.reshape(B * H, Lk, Dv).contiguous()  # (B*H, Lk, Dv)
        hybrid = u is not None
        out, a_all, b_all, out_l, a_l = torch.ops.attnkit_cpu.potentials_forward(
            q3, k3, v3, km, qm, H, float(scale), int(iters), hybrid, dropout_p, seed, score_cache_bytes(),
            QUERY_CHUNK_ROWS,
        )  # (B*H, Lq, Dv), (k+1, B*H, Lq), (k, B*H, Lk), [(B*H, Lq, Dv), (B*H, Lq)]
        if any(ctx.needs_input_grad[:4]):  # inference (no input requires grad): nothing is saved
            ctx.save_for_backward(q3, k3, v3, u, km, qm, out, a_all, b_all, out_l if hybrid else None,
                                  a_l if hybrid else None)
        ctx.shape = (B, H, Lq, Lk, D, Dv)
        ctx.scale, ctx.iters, ctx.dropout = float(scale), int(iters), (dropout_p, seed)
        out = out.view(B, H, Lq, Dv)
        if hybrid:  # u * out + (1 - u) * out_l, without temporaries of the output's size
            return torch.lerp(out_l.view(B, H, Lq, Dv), out, u.to(out.dtype).expand(B, H, 1, 1))
        # not a view (autograd forbids in-place ops on a Function's view outputs): an in-place op on it is
        # allowed, and a backward after it is autograd's in-place error (the saved output shares its version)
        return out.detach()

    @staticmethod
    def backward(ctx, grad_out):
        q3, k3, v3, u, km, qm, out, a_all, b_all, out_l, a_l = ctx.saved_tensors
        B, H, Lq, Lk, D, Dv = ctx.shape
        dO = grad_out.to(q3.dtype).reshape(B * H, Lq, Dv).contiguous()  # (B*H, Lq, Dv)
        u_bh = None
        if u is not None:
            u_bh = u.to(q3.dtype).expand(B, H, 1, 1).reshape(B * H).contiguous()  # (B*H,)
        dq, dk, dv = torch.ops.attnkit_cpu.potentials_backward(
            dO, q3, k3, v3, out, out_l, a_all, b_all, a_l, u_bh, km, qm, H, ctx.scale, ctx.iters,
            *ctx.dropout, score_cache_bytes(), QUERY_CHUNK_ROWS,
        )
        du = None
        if u is not None and ctx.needs_input_grad[3]:
            flat = dO.view(B * H, 1, Lq * Dv)
            du = torch.bmm(flat, out.view(B * H, Lq * Dv, 1)) - torch.bmm(flat, out_l.view(B * H, Lq * Dv, 1))
            du = du.view(B, H, 1, 1)  # sum over (Lq, Dv) of dO * (out - out_l)
            du = reduce_to(du, (1,) * (4 - u.dim()) + tuple(u.shape)).reshape(u.shape).to(u.dtype)
        # q, k, v were expanded to (B, H, ...) before the call: autograd sums broadcast gradients
        return (dq.view(B, H, Lq, D), dk.view(B, H, Lk, D), dv.view(B, H, Lk, Dv), du,
                None, None, None, None, None, None)
