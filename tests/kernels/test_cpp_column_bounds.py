"""The first column step of the C++ kernels (csrc/potentials_cpu.cpp) takes its exponentials against the
bounds u_cj = scale q_c . k_j + |scale| max_{i in c} |q_i - q_c| |k_j| (q_c: the mean query of chunk c)
instead of the column maxima. A column whose bound is more than 25 (float32) / 300 (float64) above its largest
chunk sum is recomputed against its maximum (the robust column step): either way the results match the
float64 reference."""

from __future__ import annotations

import pytest
import torch

from attnkit.kernels import cpu_ext
from attnkit.kernels.cpp_potentials import fused_cpu_attention
from tests._reference import ref_attention

pytestmark = [
    pytest.mark.skipif(not cpu_ext.load(warn=False), reason="C++ CPU kernels not built"),
    pytest.mark.usefixtures("query_chunks_of_256"),
]

LQ, LK, D = 600, 300, 8
SCALE = D**-0.5


def _loose(big, seed=0):
    """Queries whose first chunk (rows 0-255) alternates +-big e_1, keys orthogonal to e_1: the scores of that
    chunk do not see `big`, but its radius (and so its bound) is big / sqrt(8) |k_j| ~ 0.9 big above them."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, LQ, D, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, LK, D, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, LK, 5, generator=g, dtype=torch.float64)
    q[..., :256, 0] = big * (1 - 2 * (torch.arange(256) % 2)).double()
    k[..., 0] = 0.0
    return q, k, v


def _gap(q, k):
    """The largest (bound - column maximum) of the first chunk over the columns: how loose its bound is."""
    qc = q[..., :256, :]
    mean = qc.mean(-2, keepdim=True)
    radius = SCALE * (qc - mean).norm(dim=-1).amax(-1)  # (1, 2)
    bound = SCALE * (mean @ k.transpose(-1, -2)).squeeze(-2) + radius[..., None] * k.norm(dim=-1)
    top = (SCALE * q @ k.transpose(-1, -2)).amax(-2)  # over all queries
    return (bound - top).amax().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("big", [0.0, 20.0, 60.0, 400.0])
@pytest.mark.parametrize("mechanism,iters", [("dnas", 1), ("sinkhorn", 3)])
@pytest.mark.parametrize("grad", [False, True])
def test_loose_first_step_bounds_match_reference(dtype, big, mechanism, iters, grad):
    q, k, v = _loose(big)
    if big == 60.0:
        assert _gap(q, k) > 25  # float32 takes the robust column step, float64 the bounds
    if big == 400.0:
        assert _gap(q, k) > 300  # both take the robust column step
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref, _ = ref_attention(qr, kr, vr, mechanism, iters=iters, scale=SCALE)
    x = [t.to(dtype).requires_grad_(grad) for t in (q, k, v)]
    out = fused_cpu_attention(*x, key_mask=None, query_mask=None, scale=SCALE, iters=iters)
    assert torch.isfinite(out).all()
    tol = {"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 1e-11, "rtol": 1e-9}
    torch.testing.assert_close(out.double(), ref.detach(), **tol)
    if grad:
        do = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        want = torch.autograd.grad(ref, (qr, kr, vr), do)
        got = torch.autograd.grad(out, x, do.to(dtype))
        for a, b in zip(got, want):
            torch.testing.assert_close(a.double(), b, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_loose_bounds_under_padding_match_reference(dtype):
    """Padded queries never enter the bounds (they are compacted away before the chunks are formed)."""
    q, k, v = _loose(60.0, seed=2)
    km = torch.ones(1, LK, dtype=torch.bool)
    km[0, -40:] = False
    qm = torch.ones(1, LQ, dtype=torch.bool)
    qm[0, 100:180] = False
    ref, _ = ref_attention(q, k, v, "dnas", key_mask=km, query_mask=qm, scale=SCALE)
    ref = ref * qm[:, None, :, None]
    with torch.no_grad():
        out = fused_cpu_attention(*(t.to(dtype) for t in (q, k, v)), key_mask=km, query_mask=qm, scale=SCALE,
                                  iters=1)
    tol = {"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 1e-11, "rtol": 1e-9}
    torch.testing.assert_close(out.double(), ref, **tol)


def _uneven(mult: float, seed: int):
    """Scores of a few hundred: every 7th key 4x longer, every 5th query 10x shorter, so that the first column
    step finds loose bounds (robust columns) next to tight ones."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 1, 40, 32, generator=g, dtype=torch.float64) * mult / 32**0.25
    k = torch.randn(1, 1, 60, 32, generator=g, dtype=torch.float64) * mult / 32**0.25
    v = torch.randn(1, 1, 60, 32, generator=g, dtype=torch.float64)
    k[..., ::7, :] *= 4
    q[..., ::5, :] *= 0.1
    return q, k, v


@pytest.mark.parametrize("mechanism,iters,limits", [("dnas", 1, (6e-5, 1.8e-5, 6e-6)),
                                                    ("sinkhorn", 3, (8e-5, 4e-5, 1.2e-5))])
def test_robust_columns_are_consistent_with_the_backward_scores(mechanism, iters, limits):
    """A robust column takes its scores from the strip's GEMM, which the backward pass recomputes: its own dot
    products rounded otherwise (up to ~|s| 1e-7), and at scores of a few hundred the float32 gradients were
    2-6x further from float64: max relative error of dq, dk, dv over three seeds, before / now: dnas 1.7e-4 /
    2.8e-5, 3.6e-5 / 7.5e-6, 1.1e-5 / 3.2e-6; sinkhorn 2.1e-4 / 3.7e-5, 1.1e-4 / 1.7e-5, 1.6e-5 / 7.3e-6."""
    worst = [0.0, 0.0, 0.0]
    for seed in range(3):
        q, k, v = _uneven(10.0, seed)
        scale = 32**-0.5
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        ref, _ = ref_attention(qr, kr, vr, mechanism, iters=iters, scale=scale)
        do = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        want = torch.autograd.grad(ref, (qr, kr, vr), do)
        x = [t.float().requires_grad_() for t in (q, k, v)]
        out = fused_cpu_attention(*x, key_mask=None, query_mask=None, scale=scale, iters=iters)
        got = torch.autograd.grad(out, x, do.float())
        for n, (a, b) in enumerate(zip(got, want)):
            worst[n] = max(worst[n], ((a.double() - b).abs().max() / b.abs().max()).item())
    assert all(w <= limit for w, limit in zip(worst, limits)), (worst, limits)
