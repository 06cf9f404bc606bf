"""CoDA quasi-attention on the CPU through the fused C++ kernel of ``csrc/coda_cpu.cpp``.

"Compositional De-Attention Networks", eqs. (1)-(6) and (10); docs/design.md section 3:

    E_ij = alpha * scale * q_i . k_j,    N_ij = -beta * scale * ||q_i - k_j||_1
    M    = f_E(E - mean E) * g(N - mean N),    out = (M * z) v

The kernel computes, per query chunk and key strip, the ``E`` tile (a GEMM), the L1 tile (register tiles
over the transposed keys), the activations, the gate, the multiplicative mask and the dropout keep mask
``z``, and adds ``M_tile V_strip`` to the output; the backward pass recomputes the tiles (``dO V^T``,
``dV``, ``dQ`` / ``dK`` by GEMM and the L1 backward in the same sweep). Only ``q``, ``k``, ``v`` (and the
means) are saved. Masks: key / query padding (compacted in the kernel), a boolean ``attn_mask`` (read in
place, broadcast dimensions included) and causal. The centred variants (eqs. 4 and 6) take their means
from the chunked sum pass of ``coda_blockwise.coda_means``, through which their gradient flows. Under
``no_grad`` (or with no input requiring a gradient) the same forward runs without autograd, so its output
is bit-identical to the training forward's. Dropout drops ``M`` with a hash of (seed, head, query, key)
that the backward pass replays (the seed is drawn from PyTorch's default generator).

At an exact tie ``q_id == k_jd`` the L1 gradient takes the subgradient ``+1`` for ``sign(0)`` (``torch.cdist``
takes 0); elsewhere the gradients are exact.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..config import CoDA
from ..masks import MaskInfo
from . import cpu_ext
from .coda_blockwise import coda_means

__all__ = ["coda_cpp_available", "coda_cpp_attention"]

_ACTIVATION_CODES = {"tanh": 0, "sigmoid": 1, "arctan": 2, "algebraic": 3}
_GATE_CODES = {"sigmoid": 0, "scaled": 1, "centered": 2}


def coda_cpp_available(q: Tensor) -> bool:
    """True for CPU tensors of a floating dtype when the C++ extension is built (built on the first call)."""
    return (
        q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
        and cpu_ext.load()
    )


def coda_cpp_attention(
    q: Tensor, k: Tensor, v: Tensor, masks: MaskInfo, config: CoDA, *, scale: float, dropout_p: float = 0.0
) -> Tensor:
    """CoDA output ``(B, H, Lq, Dv)``, equal to ``coda_weights(E, N) @ v`` of the reference (with
    ``F.dropout`` on the weights for ``dropout_p > 0``, ``p`` rounded to a multiple of ``2**-16``).

    ``q (B, H, Lq, D)``, ``k (B, H, Lk, D)``, ``v (B, H, Lk, Dv)`` on the CPU; half-precision inputs are
    computed in float32 and the result is cast back. Invalid pairs weigh 0; a query without a valid key
    returns zeros.
    """
    if not cpu_ext.load():
        raise RuntimeError(f"the C++ CPU kernels are not available ({cpu_ext.load_error()})")
    dtype = q.dtype
    work = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    B = max(q.shape[0], k.shape[0], v.shape[0])
    H = max(q.shape[1], k.shape[1], v.shape[1])
    q = q.to(work).expand(B, H, -1, -1)
    k = k.to(work).expand(B, H, -1, -1)
    v = v.to(work).expand(B, H, -1, -1)
    Lq, Lk = q.shape[2], k.shape[2]
    mean_e, mean_n = coda_means(q, k, masks, config, scale=scale)  # (B, H, 1, 1) or None
    if mean_e is not None:
        mean_e = mean_e.to(work).expand(B, H, 1, 1).reshape(B * H).contiguous()  # (B*H,)
    if mean_n is not None:
        mean_n = mean_n.to(work).expand(B, H, 1, 1).reshape(B * H).contiguous()  # (B*H,)
    km = None if masks.key_mask is None else masks.key_mask.to(torch.bool).expand(B, Lk).contiguous()
    qm = None if masks.query_mask is None else masks.query_mask.to(torch.bool).expand(B, Lq).contiguous()
    pair = None if masks.pair is None else masks.pair.expand(B, H, Lq, Lk)  # a view: broadcast dims stride 0
    seed = int(torch.randint(0, 2**62, (1,)).item()) if dropout_p > 0 else 0
    options = (
        km, qm, pair, bool(masks.causal), H, float(scale), float(config.alpha), float(config.beta),
        _ACTIVATION_CODES[config.e_activation], _ACTIVATION_CODES[config.n_activation],
        _GATE_CODES[config.gate],
    )
    inputs = (q, k, v, mean_e, mean_n)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
        out = _CoDA.apply(*inputs, options, float(dropout_p), seed)
    else:
        out = _forward(*_flat(q, k, v), mean_e, mean_n, options, float(dropout_p), seed)
    return out.view(B, H, Lq, v.shape[3]).to(dtype)  # (B, H, Lq, Dv)


def _flat(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    B, H, Lq, D = q.shape
    Lk, Dv = k.shape[2], v.shape[3]
    return (
        q.reshape(B * H, Lq, D).contiguous(),  # (B*H, Lq, D)
        k.reshape(B * H, Lk, D).contiguous(),  # (B*H, Lk, D)
        v.reshape(B * H, Lk, Dv).contiguous(),  # (B*H, Lk, Dv)
    )


def _forward(q3, k3, v3, mean_e, mean_n, options, dropout_p, seed) -> Tensor:
    km, qm, pair, causal, H, scale, alpha, beta, fe, fn, gate = options
    return torch.ops.attnkit_cpu.coda_forward(
        q3, k3, v3, km, qm, pair, causal, H, scale, alpha, beta, fe, fn, gate, mean_e, mean_n, dropout_p, seed
    )  # (B*H, Lq, Dv)


class _CoDA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mean_e, mean_n, options, dropout_p, seed):
        q3, k3, v3 = _flat(q, k, v)
        out = _forward(q3, k3, v3, mean_e, mean_n, options, dropout_p, seed)
        ctx.save_for_backward(q3, k3, v3, mean_e, mean_n)
        ctx.options, ctx.dropout, ctx.shapes = options, (dropout_p, seed), (q.shape, k.shape, v.shape)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q3, k3, v3, mean_e, mean_n = ctx.saved_tensors
        km, qm, pair, causal, H, scale, alpha, beta, fe, fn, gate = ctx.options
        dq, dk, dv, dme, dmn = torch.ops.attnkit_cpu.coda_backward(
            grad_out.to(q3.dtype).contiguous(), q3, k3, v3, km, qm, pair, causal, H, scale, alpha, beta, fe,
            fn, gate, mean_e, mean_n, *ctx.dropout,
        )  # (B*H, Lq, D), (B*H, Lk, D), (B*H, Lk, Dv), (B*H,), (B*H,)
        qs, ks, vs = ctx.shapes
        return (
            dq.view(qs), dk.view(ks), dv.view(vs),
            None if mean_e is None else dme,
            None if mean_n is None else dmn,
            None, None, None,
        )
