"""The blockwise route's underflow recompute, per-example bias gradients and half-precision upcast.

The column-normalized weights ``w_ij`` of DNAS/Sinkhorn can all underflow for a row in float32 (a query
dominated in every column by another one); such rows are recomputed with a running maximum
(``_robust_rows``). No test reached that path, so a recompute without the column potentials, a recompute
skipped for calls without boolean validity, a validity taken from the last key block only and a threshold
of ``tiny`` instead of ``sqrt(tiny)`` all went unnoticed. References are the float64 reference route.
"""

from __future__ import annotations

import math

import pytest
import torch

import attnkit as ak
from attnkit.kernels.blockwise import potential_attention
from attnkit.masks import build_mask

CPU = torch.device("cpu")


def _dominated_row(Lk: int = 6):
    """Query 0 scores 100 + 3 t_j on every key, query 1 scores -100: query 1's column weights underflow.

    Returns float64 ``q (1, 1, 2, 2)``, ``k (1, 1, Lk, 2)``, ``v (1, 1, Lk, 1)``; DNAS row 1 is
    ``softmax_j(-3 t_j)`` (its ``b_j = -c_j`` differ per key), far from the uniform average of ``v``.
    """
    t = torch.linspace(0, 1, Lk, dtype=torch.float64)
    k = torch.stack([torch.ones(Lk, dtype=torch.float64), t], -1)[None, None]  # (1, 1, Lk, 2)
    q = torch.tensor([[100.0, 3.0], [-100.0, 0.0]], dtype=torch.float64)[None, None]  # (1, 1, 2, 2)
    v = torch.arange(Lk, dtype=torch.float64).view(1, 1, Lk, 1)  # (1, 1, Lk, 1)
    return q, k, v


def _efficient_vs_reference(q, k, v, mechanism, **masks):
    """``(float32 efficient output, float64 reference output)``, after checking the route is blockwise."""
    f = [t.float() for t in (q, k, v)]
    fm = {name: (m.float() if m.is_floating_point() else m) for name, m in masks.items()}
    route = ak.explain_dispatch(*f, mechanism, backend="efficient", **fm).route
    assert route == "blockwise", route
    got = ak.attention(*f, mechanism, backend="efficient", scale=1.0, **fm)
    want = ak.attention(q, k, v, mechanism, backend="reference", scale=1.0, **masks)
    return got.double(), want


def test_recomputed_row_keeps_the_column_potentials_under_a_boolean_mask():
    """An underflowed float32 DNAS row was recomputed as plain softmax (without ``b``): query 1's output
    read 2.50000 (the mean of v) instead of 1.04782."""
    q, k, v = _dominated_row()
    Lk = k.shape[2]
    k7 = torch.cat([k, torch.tensor([1.0, 0.5], dtype=torch.float64).view(1, 1, 1, 2)], 2)  # (1, 1, Lk+1, 2)
    v7 = torch.cat([v, torch.zeros(1, 1, 1, 1, dtype=torch.float64)], 2)  # (1, 1, Lk+1, 1)
    mask = torch.ones(2, Lk + 1, dtype=torch.bool)
    mask[1, Lk] = False  # the 7th key is seen by query 0 only
    got, want = _efficient_vs_reference(q, k7, v7, "dnas", attn_mask=mask)
    assert want[0, 0, 1, 0].item() == pytest.approx(1.04782, abs=1e-5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_underflowed_rows_are_recomputed_without_boolean_validity():
    """With a float attn_mask and no -inf (no boolean validity), underflowed float32 DNAS rows were not
    recomputed: query 1's output read 0.00000 instead of 1.05576."""
    q, k, v = _dominated_row()
    bias = 0.01 * torch.randn(2, k.shape[2], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    got, want = _efficient_vs_reference(q, k, v, "dnas", attn_mask=bias)
    assert want[0, 0, 1, 0].item() == pytest.approx(1.05576, abs=1e-5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("iters", [1, 3])
def test_a_row_whose_valid_keys_lie_in_an_earlier_block_is_recomputed(iters):
    """Row validity taken from the last key block only (``nonempty = hit``) skipped the recompute of a
    row whose valid keys all lie in the first block of 2: its float32 DNAS output read 0 instead of the
    float64 values (about 0.5 off)."""
    Lk, D = 8, 4
    k = torch.zeros(1, 1, Lk, D, dtype=torch.float64)
    k[..., 0] = 1.0
    k[..., 1] = torch.linspace(0, 1, Lk, dtype=torch.float64)
    q = torch.zeros(1, 1, 2, D, dtype=torch.float64)
    q[0, 0, 0, 0] = 100.0  # dominates every column
    q[0, 0, 1, 0] = -100.0  # its weights underflow to 0 in float32
    v = torch.randn(1, 1, Lk, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    mask = torch.ones(2, Lk, dtype=torch.bool)
    mask[1, 2:] = False  # query 1 sees keys 0..1 only: the first block

    def run(dtype):
        m = build_mask(1, 1, 2, Lk, attn_mask=mask, device=CPU)
        out = potential_attention(q.to(dtype), k.to(dtype), v.to(dtype), m, scale=1.0, iters=iters, block=2)
        return out.double()  # (1, 1, 2, 3)

    want = run(torch.float64)
    mechanism = "dnas" if iters == 1 else ak.Sinkhorn(iters=iters)
    reference = ak.attention(q, k, v, mechanism, attn_mask=mask, backend="reference", scale=1.0)
    torch.testing.assert_close(want, reference, atol=1e-12, rtol=1e-10)
    assert want[0, 0, 1].abs().max().item() > 0.1
    torch.testing.assert_close(run(torch.float32), want, atol=1e-5, rtol=1e-5)


def test_rows_with_denormal_weights_are_recomputed():
    """Row sums below ``sqrt(tiny)`` are recomputed. With a threshold of ``tiny`` (or float64's tiny for
    float32 inputs) a row whose weights are 2e-38 on key 0 (v = 0) and 6e-46 (rounded to 0 in float32)
    on 10000 others (v = 1) kept the rounded weights: its output read 0 instead of 3.0e-4."""
    N = 10_000
    Lk = N + 1
    k = torch.zeros(1, 1, Lk, 2, dtype=torch.float64)
    k[..., 0] = 1.0
    k[0, 0, 0, 1] = 1.0
    q = torch.zeros(1, 1, 2, 2, dtype=torch.float64)
    q[0, 0, 0, 0] = 100.0  # dominates every column
    q[0, 0, 1, 0] = 100.0 + math.log(6e-46)  # column weight 6e-46 on keys j >= 1
    q[0, 0, 1, 1] = math.log(2e-38) - math.log(6e-46)  # column weight 2e-38 on key 0
    v = torch.ones(1, 1, Lk, 1, dtype=torch.float64)
    v[0, 0, 0, 0] = 0.0
    m = build_mask(1, 1, 2, Lk, device=CPU)
    exact = N * 6e-46 / (2e-38 + N * 6e-46)  # 3.0e-4
    want = potential_attention(q, k, v, m, scale=1.0, iters=1)[0, 0, 1, 0].item()
    assert want == pytest.approx(exact, rel=1e-6)
    got = potential_attention(q.float(), k.float(), v.float(), m, scale=1.0, iters=1)[0, 0, 1, 0].item()
    assert got == pytest.approx(exact, rel=1e-4)


@pytest.mark.parametrize("heads", [1, 3], ids=["per_example", "per_example_and_head"])
def test_per_example_learnable_bias_gradient_matches_reference(heads):
    """The bias gradient of a group of batch elements was added into the whole ``(B, ...)`` gradient
    (the slice ``[b0:b1]`` dropped): d(bias) of a (B, 1, Lq, Lk) bias was 2.908 off the float64
    reference. The existing gradcheck used a (B, 1, 1, 1) bias, whose gradient is exactly 0."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(2, heads, 5, 5, generator=g, dtype=torch.float64, requires_grad=True)
    for mechanism in ("dnas", ak.Sinkhorn(iters=3)):
        plan = ak.explain_dispatch(q, k, v, mechanism, backend="efficient", attn_mask=bias)
        assert plan.route == "blockwise", plan
        grads = []
        for backend in ("efficient", "reference"):
            out = ak.attention(q, k, v, mechanism, attn_mask=bias, backend=backend)
            grads.append(torch.autograd.grad(out.square().sum(), bias)[0])
        assert grads[1].abs().max().item() > 0.1
        torch.testing.assert_close(grads[0], grads[1], atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("mechanism", ["dnas", ak.Sinkhorn(iters=3)], ids=["dnas", "sinkhorn3"])
def test_bfloat16_is_computed_in_float32_and_cast_once(mechanism):
    """bfloat16 inputs on the blockwise route are computed in float32 and the result cast back, so the
    output and gradients equal the float32 call's, cast to bfloat16. Computed in bfloat16 instead, the
    error against float64 grew from 1.79e-3 to 6.08e-3 (DNAS) and 1.65e-3 to 8.49e-3 (Sinkhorn-3)."""
    g = torch.Generator().manual_seed(0)
    q, k, v, d_out = (torch.randn(2, 2, 32, 16, generator=g).bfloat16() for _ in range(4))
    mask = torch.rand(32, 32, generator=g) > 0.2
    outs, grads = [], []
    for dtype in (torch.bfloat16, torch.float32):
        qkv = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        assert ak.explain_dispatch(*qkv, mechanism, backend="efficient", attn_mask=mask).route == "blockwise"
        out = ak.attention(*qkv, mechanism, attn_mask=mask, backend="efficient")
        outs.append(out.bfloat16())
        grads.append([t.bfloat16() for t in torch.autograd.grad(out, qkv, d_out.to(dtype))])
    assert outs[0].dtype == torch.bfloat16
    assert torch.equal(outs[0], outs[1])
    for got, want in zip(*grads):
        assert torch.equal(got, want)
