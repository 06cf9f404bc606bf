"""The Triton kernels for DNAS, HNAS and Sinkhorn (kernels/triton_potentials.py) in Triton's interpreter
against the float64 reference: outputs, gradients, padding masks, empty rows, odd sizes, low precision,
the inference path and the CUDA route of the efficient backend."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU

import pytest
import torch

import attnkit as ak

triton = pytest.importorskip("triton")

from attnkit.kernels import dispatch  # noqa: E402
from attnkit.kernels import _triton_kernels, triton_potentials  # noqa: E402
from attnkit.kernels.triton_potentials import triton_attention  # noqa: E402

pytestmark = pytest.mark.skipif(
    not _triton_kernels.INTERPRETED, reason="triton was imported before TRITON_INTERPRET=1 was set"
)

MECHANISMS = {
    "dnas": ("dnas", 1, {}), "hnas": ("hnas", 1, {}), "sinkhorn1": ("sinkhorn", 1, {"sinkhorn_iters": 1}),
    "sinkhorn2": ("sinkhorn", 2, {"sinkhorn_iters": 2}), "sinkhorn3": ("sinkhorn", 3, {"sinkhorn_iters": 3}),
}


def _inputs(B, H, Lq, Lk, D, Dv, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, H, Lq, D), (B, H, Lk, D), (B, H, Lk, Dv))
    return [torch.randn(s, generator=g, dtype=torch.float64).requires_grad_() for s in shapes]


def _masks(B, Lq, Lk, which, seed=1):
    g = torch.Generator().manual_seed(seed)
    km = torch.rand(B, Lk, generator=g) > 0.3
    qm = torch.rand(B, Lq, generator=g) > 0.3
    km[0], qm[0] = True, True
    km[-1, : Lk // 2] = False  # left padding on the last element
    return (km if which in ("keys", "both") else None), (qm if which in ("queries", "both") else None)


def _run(name, q, k, v, km, qm, *, dtype=torch.float32, block=None):
    """``(out, ref, grads, ref_grads)`` of the Triton kernel (inputs cast to ``dtype``) and the reference."""
    mech, iters, kw = MECHANISMS[name]
    H, D = q.shape[1], q.shape[3]
    u = torch.linspace(0.2, 0.8, H, dtype=torch.float64, requires_grad=True) if name == "hnas" else None
    if u is not None:
        kw = {"hybrid_weight": u}
    ref = ak.attention(q, k, v, mech, key_mask=km, query_mask=qm, backend="reference", **kw)
    out = triton_attention(q.to(dtype), k.to(dtype), v.to(dtype), key_mask=km, query_mask=qm, scale=D**-0.5,
                           iters=iters, u=None if u is None else u.view(1, H, 1, 1), block=block)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    wrt = (q, k, v) if u is None else (q, k, v, u)
    grads = torch.autograd.grad(out, wrt, g.to(out.dtype))
    ref_grads = torch.autograd.grad(ref, wrt, g)
    return out, ref, grads, ref_grads


def _close(out, ref, grads, ref_grads, atol, rtol=1e-4):
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)
    for n, a, b in zip("qkvu", grads, ref_grads):
        torch.testing.assert_close(a.double(), b, atol=atol, rtol=rtol, msg=lambda m, n=n: f"d{n}: {m}")


@pytest.mark.parametrize("name", list(MECHANISMS))
def test_matches_reference_with_padding_on_both_sides(name):
    q, k, v = _inputs(2, 2, 19, 23, 8, 5)  # two 16-wide tiles each way, the last one partial
    km, qm = _masks(2, 19, 23, "both")
    _close(*_run(name, q, k, v, km, qm), atol=2e-5)


@pytest.mark.parametrize("which", ["none", "keys", "queries"])
@pytest.mark.parametrize("name", ["dnas", "sinkhorn3"])
def test_matches_reference_for_each_mask(name, which):
    q, k, v = _inputs(2, 1, 17, 9, 6, 3, seed=3)  # D, Dv not powers of two
    km, qm = _masks(2, 17, 9, which)
    _close(*_run(name, q, k, v, km, qm), atol=2e-5)


@pytest.mark.parametrize("name", ["hnas", "sinkhorn2"])
def test_single_query_and_single_tile(name):
    q, k, v = _inputs(1, 3, 1, 5, 4, 7, seed=2)
    _close(*_run(name, q, k, v, None, None, block=32), atol=2e-5)


@pytest.mark.parametrize("name", ["dnas", "hnas", "sinkhorn3"])
def test_empty_rows_and_columns_are_zero_with_finite_gradients(name):
    q, k, v = _inputs(3, 2, 10, 12, 4, 4, seed=5)
    km = torch.ones(3, 12, dtype=torch.bool)
    qm = torch.ones(3, 10, dtype=torch.bool)
    km[1] = False  # no valid key at all: every query of element 1 returns zeros
    qm[2, 3:] = False  # most queries padded: the remaining ones fill every column normalization
    out, ref, grads, ref_grads = _run(name, q, k, v, km, qm)
    assert torch.all(out[1] == 0) and torch.all(out[2, :, 3:] == 0)
    assert all(torch.isfinite(g).all() for g in grads)
    _close(out, ref, grads, ref_grads, atol=2e-5)


def test_large_logits_stay_finite():
    q, k, v = _inputs(1, 2, 20, 20, 8, 8, seed=4)
    with torch.no_grad():
        q.mul_(12.0)
        k.mul_(12.0)  # scores of order 100: every exp needs its running maximum
    out, ref, grads, ref_grads = _run("sinkhorn3", q, k, v, None, None)
    assert torch.isfinite(out).all()
    _close(out, ref, grads, ref_grads, atol=5e-4, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["dnas", "hnas", "sinkhorn3"])
def test_low_precision_error_is_a_small_multiple_of_eager(name, dtype):
    """FlexAttention's rule: error against float64 at most a few times that of the eager path in ``dtype``."""
    q, k, v = _inputs(2, 2, 19, 21, 16, 16, seed=6)
    km, qm = _masks(2, 19, 21, "both")
    mech, _, kw = MECHANISMS[name]
    out, ref, grads, ref_grads = _run(name, q, k, v, km, qm, dtype=dtype)
    assert out.dtype == dtype
    ql, kl, vl = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    kw = {"hybrid_weight": torch.linspace(0.2, 0.8, 2, dtype=torch.float64)} if name == "hnas" else kw
    eager = ak.attention(ql, kl, vl, mech, key_mask=km, query_mask=qm, backend="reference", **kw)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    eager_grads = torch.autograd.grad(eager, (ql, kl, vl), g.to(dtype))
    for fast, slow, exact in zip((out, *grads[:3]), (eager, *eager_grads), (ref, *ref_grads[:3])):
        err_fast = (fast.double() - exact).abs().max().item()
        err_eager = (slow.double() - exact).abs().max().item()
        assert err_fast <= 5 * err_eager + 1e-3, (err_fast, err_eager)


@pytest.mark.parametrize("name", ["dnas", "hnas", "sinkhorn3"])
def test_inference_saves_nothing_and_matches_training_bitwise(name):
    q, k, v = _inputs(2, 2, 13, 11, 8, 8, seed=8)
    km, qm = _masks(2, 13, 11, "both")
    _, iters, _ = MECHANISMS[name]
    u = torch.tensor([0.3, 0.7]).view(1, 2, 1, 1) if name == "hnas" else None
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    train = triton_attention(qf, kf, vf, key_mask=km, query_mask=qm, scale=0.3, iters=iters, u=u)
    with torch.no_grad():
        infer = triton_attention(qf, kf, vf, key_mask=km, query_mask=qm, scale=0.3, iters=iters, u=u)
    assert train.grad_fn is not None and infer.grad_fn is None
    assert torch.equal(train, infer)


def test_efficient_backend_routes_cuda_tensors_to_triton(monkeypatch):
    """``dispatch._triton_module`` is the CUDA switch; on the CPU the interpreter stands in for the GPU."""
    calls = []

    def route(q):
        calls.append(q.shape)
        return triton_potentials

    monkeypatch.setattr(dispatch, "_triton_module", route)
    q, k, v = (t.detach().float().requires_grad_() for t in _inputs(2, 2, 9, 10, 8, 8, seed=9))
    km, qm = _masks(2, 9, 10, "both")
    out = ak.attention(q, k, v, "sinkhorn", key_mask=km, query_mask=qm, sinkhorn_iters=2, backend="auto")
    assert calls, "backend='auto' did not take the Triton route"
    ref = ak.attention(q.double(), k.double(), v.double(), "sinkhorn", key_mask=km, query_mask=qm,
                       sinkhorn_iters=2, backend="reference")
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-4)
    calls.clear()
    ak.attention(q, k, v, "dnas", attn_mask=torch.ones(9, 10, dtype=torch.bool), backend="efficient")
    assert not calls, "attn_mask calls must keep the block-wise PyTorch path"


def test_rejects_float64_and_cpu_route_is_off():
    q, k, v = (t.detach() for t in _inputs(1, 1, 4, 4, 4, 4))
    with pytest.raises(ValueError, match="float64|backend='reference'"):
        triton_attention(q, k, v, key_mask=None, query_mask=None, scale=0.5, iters=1)
    assert dispatch._triton_module(q.float()) is None  # CPU tensors never take Triton outside the tests
