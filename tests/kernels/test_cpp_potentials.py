"""The C++ CPU kernels for DNAS, HNAS and Sinkhorn (kernels/cpp_potentials.py, csrc/potentials_cpu.cpp)
against the
float64 reference: outputs, gradients, padding, empty rows, large logits, low precision and dispatch."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.kernels import cpu_ext
from attnkit.kernels import cpp_potentials
from attnkit.kernels.cpp_potentials import fused_cpu_attention


pytestmark = pytest.mark.skipif(not cpu_ext.load(warn=False), reason="C++ CPU kernels not built")


def _inputs(B, H, Lq, Lk, D, Dv=None, dtype=torch.float64, seed=0, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, H, Lq, D), (B, H, Lk, D), (B, H, Lk, Dv or D))
    return [
        (spread * torch.randn(s, generator=g, dtype=torch.float64)).to(dtype).requires_grad_() for s in shapes
    ]


def _masks(B, Lq, Lk, seed=1):
    g = torch.Generator().manual_seed(seed)
    km = torch.rand(B, Lk, generator=g) > 0.3
    qm = torch.rand(B, Lq, generator=g) > 0.3
    km[0], qm[0] = True, True
    km[-1, : Lk // 2] = False  # left padding on the last element
    return km, qm


def _mechanism(name):
    return {"softmax": ("softmax", 0), "dnas": ("dnas", 1), "hnas": ("hnas", 1),
            "sinkhorn1": (ak.Sinkhorn(iters=1), 1), "sinkhorn2": (ak.Sinkhorn(iters=2), 2),
            "sinkhorn4": (ak.Sinkhorn(iters=4), 4)}[name]


def _check(name, B, H, Lq, Lk, D, Dv, key_mask, query_mask, seed=0, spread=1.0, atol=1e-11):
    mech, iters = _mechanism(name)
    q, k, v = _inputs(B, H, Lq, Lk, D, Dv, seed=seed, spread=spread)
    u = torch.linspace(0.1, 0.9, H, dtype=torch.float64, requires_grad=True) if name == "hnas" else None
    kw = {"hybrid_weight": u} if u is not None else {}
    ref = ak.attention(q, k, v, mech, key_mask=key_mask, query_mask=query_mask, backend="reference", **kw)
    out = fused_cpu_attention(q, k, v, key_mask=key_mask, query_mask=query_mask, scale=D**-0.5, iters=iters,
                              u=None if u is None else u.view(1, H, 1, 1))
    torch.testing.assert_close(out, ref, atol=atol, rtol=1e-9)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 7), dtype=out.dtype)
    wrt = (q, k, v) if u is None else (q, k, v, u)
    for name_, a, b in zip("qkvu", torch.autograd.grad(out, wrt, g), torch.autograd.grad(ref, wrt, g)):
        torch.testing.assert_close(a, b, atol=atol, rtol=1e-9, msg=lambda m, n=name_: f"d{n}: {m}")
    return out


@pytest.mark.parametrize("name", ["softmax", "dnas", "hnas", "sinkhorn1", "sinkhorn2", "sinkhorn4"])
@pytest.mark.parametrize("shape", [(2, 3, 5, 7, 4, 3), (3, 2, 9, 6, 8, 8), (1, 1, 1, 3, 2, 5)])
@pytest.mark.parametrize("masked", ["none", "keys", "queries", "both"])
def test_matches_reference_outputs_and_gradients(name, shape, masked):
    B, H, Lq, Lk, D, Dv = shape
    km, qm = _masks(B, Lq, Lk)
    _check(name, B, H, Lq, Lk, D, Dv, km if masked in ("keys", "both") else None,
           qm if masked in ("queries", "both") else None)


@pytest.mark.parametrize("name", ["softmax", "dnas", "hnas", "sinkhorn2"])
def test_several_strips_and_chunks_match_reference(name, query_chunks_of_256):
    """Lk = 300 keys span three strips of 128, Lq = 600 queries three chunks of 256 (rectangular, padded)."""
    km, qm = _masks(2, 600, 300)
    _check(name, 2, 2, 600, 300, 8, 5, km, qm)


@pytest.mark.parametrize("name", ["softmax", "dnas", "hnas", "sinkhorn2"])
def test_default_query_chunks_match_reference(name):
    """Lq = 1100 unpadded queries: a chunk of the default 1024 rows and one of 76."""
    _check(name, 1, 2, 1100, 130, 8, 5, None, None)


@pytest.mark.parametrize("name", ["softmax", "dnas", "hnas", "sinkhorn4"])
def test_large_logits_match_reference(name):
    """Scores of magnitude ~1e3: whole rows of column-normalized weights underflow and are recomputed."""
    km, qm = _masks(2, 40, 70)
    _check(name, 2, 2, 40, 70, 8, 4, km, qm, spread=30.0, atol=1e-9)


def test_large_logits_float32_stay_finite():
    q, k, v = _inputs(2, 2, 64, 64, 8, dtype=torch.float32, spread=40.0)  # scores of magnitude ~1e4
    out = fused_cpu_attention(q, k, v, key_mask=None, query_mask=None, scale=8**-0.5, iters=3)
    ref = ak.attention(q.double(), k.double(), v.double(), ak.Sinkhorn(iters=3), backend="reference")
    assert torch.isfinite(out).all()
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert (out.double() - ref).abs().max() < 1e-3 * (1 + ref.abs().max())


@pytest.mark.parametrize("iters", [1, 3])
def test_gradcheck_float64_with_padding(iters):
    q, k, v = _inputs(2, 2, 4, 5, 3, 2)
    km = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]], dtype=torch.bool)
    qm = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 1]], dtype=torch.bool)
    u = torch.tensor([0.3, 0.8], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda a, b, c, w: fused_cpu_attention(a, b, c, key_mask=km, query_mask=qm, scale=0.5, iters=iters,
                                               u=w.view(1, 2, 1, 1)),
        (q, k, v, u),
    )


def test_gradcheck_float64_with_padding_softmax_alone():
    q, k, v = _inputs(2, 2, 4, 5, 3, 2)
    km = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]], dtype=torch.bool)
    qm = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 1]], dtype=torch.bool)
    assert torch.autograd.gradcheck(
        lambda a, b, c: fused_cpu_attention(a, b, c, key_mask=km, query_mask=qm, scale=0.5, iters=0),
        (q, k, v),
    )


def test_padding_equals_truncation():
    """A padded batch gives, on its real tokens, what each sequence gives alone."""
    q, k, v = _inputs(2, 2, 12, 10, 4, seed=3)
    km = torch.ones(2, 10, dtype=torch.bool)
    qm = torch.ones(2, 12, dtype=torch.bool)
    km[1, 6:], qm[1, 9:] = False, False
    out = fused_cpu_attention(q, k, v, key_mask=km, query_mask=qm, scale=0.5, iters=2)
    alone = fused_cpu_attention(q[1:, :, :9], k[1:, :, :6], v[1:, :, :6], key_mask=None, query_mask=None,
                                scale=0.5, iters=2)
    torch.testing.assert_close(out[1:, :, :9], alone, atol=1e-12, rtol=1e-10)
    assert torch.equal(out[1, :, 9:], torch.zeros_like(out[1, :, 9:]))


def test_batch_element_without_keys_or_queries_gives_zeros_and_zero_gradients():
    q, k, v = _inputs(3, 2, 4, 5, 3)
    km = torch.ones(3, 5, dtype=torch.bool)
    qm = torch.ones(3, 4, dtype=torch.bool)
    km[1] = False  # element 1: no key
    qm[2] = False  # element 2: no query
    u = torch.full((1, 2, 1, 1), 0.4, dtype=torch.float64, requires_grad=True)
    out = fused_cpu_attention(q, k, v, key_mask=km, query_mask=qm, scale=0.5, iters=1, u=u)
    assert torch.equal(out[1:], torch.zeros_like(out[1:]))
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
        assert torch.equal(t.grad[1:], torch.zeros_like(t.grad[1:]))
    ref = ak.attention(q[:1], k[:1], v[:1], "hnas", scale=0.5, hybrid_weight=u.view(2), backend="reference")
    torch.testing.assert_close(out[:1], ref)


@pytest.mark.parametrize("name", ["softmax", "hnas", "sinkhorn2"])
def test_outputs_and_gradients_are_written_in_full_over_recycled_memory(name):
    """The kernels allocate their outputs uninitialised and write every row: padded queries and keys, and
    batch elements without keys or queries, get zeros even where the allocator hands back memory full of NaN
    (freed blocks of the outputs' sizes just before each call)."""
    mech, iters = _mechanism(name)
    B, H, Lq, Lk, D = 3, 2, 6, 5, 3
    q, k, v = _inputs(B, H, Lq, Lk, D)
    km = torch.ones(B, Lk, dtype=torch.bool)
    qm = torch.ones(B, Lq, dtype=torch.bool)
    km[1], qm[2] = False, False  # element 1: no key, element 2: no query
    qm[0, 4:], km[0, 1] = False, False
    u = torch.tensor(0.4, dtype=torch.float64) if name == "hnas" else None
    ref = ak.attention(q, k, v, mech, key_mask=km, query_mask=qm, scale=0.5, backend="reference",
                       **({"hybrid_weight": u} if u is not None else {}))
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    want = torch.autograd.grad(ref, (q, k, v), g)
    sizes = [(B * H, Lq, D), (B * H, Lk, D), (B * H, Lk, D), (iters + 1, B * H, Lq),
             (max(iters, 1), B * H, Lk)]
    for _ in range(5):
        junk = [torch.full(size, float("nan"), dtype=torch.float64) for size in sizes]
        del junk
        out = fused_cpu_attention(q, k, v, key_mask=km, query_mask=qm, scale=0.5, iters=iters,
                                  u=None if u is None else u.view(1, 1, 1, 1))
        junk = [torch.full(size, float("nan"), dtype=torch.float64) for size in sizes[:3]]
        del junk
        got = torch.autograd.grad(out, (q, k, v), g)
        torch.testing.assert_close(out, ref * qm[:, None, :, None], atol=1e-12, rtol=1e-10)
        for name_, a, b in zip("qkv", got, want):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10, msg=lambda m, n=name_: f"d{n}: {m}")


def test_broadcast_batch_and_heads_sum_gradients():
    q, _, _ = _inputs(2, 3, 6, 5, 4)
    k, v = (t.detach()[:1, :1].clone().requires_grad_() for t in _inputs(2, 3, 6, 5, 4, seed=1)[1:])
    out = fused_cpu_attention(q, k, v, key_mask=None, query_mask=None, scale=0.5, iters=1)
    ref = ak.attention(q, k.expand(2, 3, 5, 4), v.expand(2, 3, 5, 4), "dnas", scale=0.5, backend="reference")
    torch.testing.assert_close(out, ref)
    (gk,) = torch.autograd.grad(out.sum(), k)
    (gk_ref,) = torch.autograd.grad(ref.sum(), k)
    assert gk.shape == k.shape
    torch.testing.assert_close(gk, gk_ref)


@pytest.mark.parametrize("name", ["dnas", "hnas", "sinkhorn"])
@pytest.mark.parametrize("dtype,factor", [(torch.float32, 10.0), (torch.bfloat16, 1.1)])
def test_error_at_most_a_multiple_of_the_reference_error(name, dtype, factor):
    """FlexAttention's rule: error against float64 <= factor x the reference backend's at the same
    precision."""
    mech = ak.Sinkhorn(iters=3) if name == "sinkhorn" else name
    q64, k64, v64 = _inputs(2, 4, 128, 96, 32, seed=5)
    km, qm = _masks(2, 128, 96)
    kw = dict(key_mask=km, query_mask=qm)
    exact = ak.attention(q64, k64, v64, mech, backend="reference", **kw)
    g = torch.randn(exact.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    exact_grads = torch.autograd.grad(exact, (q64, k64, v64), g)
    errors = {}
    for backend in ("reference", "efficient"):
        q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q64, k64, v64))
        out = ak.attention(q, k, v, mech, backend=backend, **kw)
        grads = torch.autograd.grad(out, (q, k, v), g.to(dtype))
        errors[backend] = [(a.double() - b).abs().mean().item()
                           for a, b in zip((out,) + grads, (exact,) + exact_grads)]
    for what, eff, ref in zip(("out", "dq", "dk", "dv"), errors["efficient"], errors["reference"]):
        assert eff <= factor * ref + 1e-7, f"{what}: efficient {eff:.3e} vs reference {ref:.3e}"


def test_efficient_backend_uses_the_cpp_kernels_for_padding_masks(monkeypatch):
    calls = []
    real = cpp_potentials.fused_cpu_attention

    def spy(*args, **kwargs):
        calls.append((kwargs["iters"], kwargs["key_mask"] is not None))
        return real(*args, **kwargs)

    monkeypatch.setattr("attnkit.kernels.dispatch.fused_cpu_attention", spy)
    q, k, v = _inputs(1, 2, 8, 8, 4)
    km = torch.ones(1, 8, dtype=torch.bool)
    ak.attention(q, k, v, "dnas", key_mask=km, backend="efficient")
    ak.attention(q, k, v, ak.Sinkhorn(iters=3), backend="efficient")
    general = torch.ones(8, 8, dtype=torch.bool)
    general[0, 7] = False  # an all-True attn_mask counts as none
    ak.attention(q, k, v, "dnas", attn_mask=general, backend="efficient")  # block kernel
    assert calls == [(1, True), (3, False)]


def test_negative_iters_and_a_hybrid_weight_without_rounds_are_refused():
    q, k, v = _inputs(1, 1, 3, 3, 2)
    with pytest.raises(ValueError, match="iters=-1"):
        fused_cpu_attention(q, k, v, key_mask=None, query_mask=None, scale=1.0, iters=-1)
    with pytest.raises(ValueError, match="iters=0 is softmax alone"):
        fused_cpu_attention(q, k, v, key_mask=None, query_mask=None, scale=1.0, iters=0, u=torch.tensor(0.5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("where", ["first", "last"])
def test_softmax_rows_whose_maximum_rises_across_strips_match_reference(dtype, where, query_chunks_of_256):
    """Softmax alone sweeps the key strips with a running maximum per row: scores ~300 above the rest in the
    row's last strip (every earlier sum and numerator is rescaled to ~0) or in its first (the later strips'
    exponentials underflow), 300 keys in three strips, padded."""
    q, k, v = _inputs(2, 2, 300, 300, 8, 5)
    with torch.no_grad():
        hot = slice(290, 300) if where == "last" else slice(0, 10)
        k[:, :, hot] *= 0.0
        k[:, :, hot, 0] = 40.0
        q[:, :, ::2, 0] = 20.0  # even queries: s ~ 40 * 20 / sqrt(8) ~ 283 on the hot keys
    km, qm = _masks(2, 300, 300)
    km[:, hot] = True
    ref = ak.attention(q, k, v, "softmax", key_mask=km, query_mask=qm, backend="reference")
    qx, kx, vx = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    out = fused_cpu_attention(qx, kx, vx, key_mask=km, query_mask=qm, scale=8**-0.5, iters=0)
    tol = {"atol": 1e-11, "rtol": 1e-9} if dtype == torch.float64 else {"atol": 1e-4, "rtol": 1e-4}
    torch.testing.assert_close(out.double(), ref, **tol)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    got = torch.autograd.grad(out, (qx, kx, vx), g.to(dtype))
    want = torch.autograd.grad(ref, (q, k, v), g)
    for name, a, b in zip("qkv", got, want):
        scale = b.abs().max().item() + 1.0
        torch.testing.assert_close(a.double(), b, atol=tol["atol"] * scale, rtol=tol["rtol"],
                                   msg=lambda m, n=name: f"d{n}: {m}")


@pytest.mark.parametrize("name", ["softmax", "dnas", "hnas", "sinkhorn2"])
def test_fewer_heads_than_threads_spreads_query_chunks_and_matches_reference(name):
    """B * H = 1 < threads: the kernel splits each strip's query chunks over the threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(threads, 3))
    try:
        km, qm = _masks(1, 1040, 150, seed=4)
        _check(name, 1, 1, 1040, 150, 8, 5, km, qm)  # ~730 valid queries: chunks of 256, one per thread
        _check(name, 1, 2, 300, 200, 8, 8, None, None)  # H = 2 < 3 threads, unpadded
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name", ["softmax", "dnas", "hnas", "sinkhorn2"])
def test_heads_the_threads_do_not_divide_match_reference(name):
    """3 heads on 2 threads: two are dealt to the threads, the third then has its query chunks spread over
    both (it has the rows for it); with padding, the cheapest problem is the one left for last."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _check(name, 1, 3, 300, 170, 8, 5, None, None)
        lengths = torch.tensor([300, 290, 270])  # B * H = 3: the 270-query problem goes last, split
        qm = torch.arange(300)[None, :] < lengths[:, None]
        _check(name, 3, 1, 300, 300, 8, 5, qm, qm)
        _check(name, 3, 1, 300, 300, 8, 5, qm, None)
        short = torch.arange(300)[None, :] < torch.tensor([300, 290, 100])[:, None]  # too short to split
        _check(name, 3, 1, 300, 300, 8, 5, short, short)
    finally:
        torch.set_num_threads(threads)
