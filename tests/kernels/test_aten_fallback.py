"""PyTorch's fused CPU attention op for DNAS/HNAS (kernels/aten_fallback.py), the path used where the C++
kernels
cannot be built, against the float64 reference."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.kernels import aten_fallback
from attnkit.kernels.aten_fallback import fused_available, fused_dnas_attention
from tests._reference import random_padding

pytestmark = pytest.mark.skipif(
    not fused_available(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2)),
    reason="no fused CPU attention kernel",
)


def _inputs(B, H, Lq, Lk, D, dtype=torch.float64, seed=0, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    return [
        (spread * torch.randn(B, H, L, D, generator=g, dtype=torch.float64)).to(dtype).requires_grad_()
        for L in (Lq, Lk, Lk)
    ]


def _masks(B, Lq, Lk, seed=1):
    return random_padding(B, Lq, Lk, seed)


@pytest.mark.parametrize("mechanism", ["dnas", "hnas"])
@pytest.mark.parametrize("shape", [(2, 3, 5, 7, 4), (3, 2, 9, 6, 8), (1, 1, 1, 3, 2)])
@pytest.mark.parametrize("masked", ["none", "keys", "queries", "both"])
def test_matches_reference_outputs_and_gradients(mechanism, shape, masked):
    B, H, Lq, Lk, D = shape
    q, k, v = _inputs(B, H, Lq, Lk, D)
    km, qm = _masks(B, Lq, Lk)
    key_mask = km if masked in ("keys", "both") else None
    query_mask = qm if masked in ("queries", "both") else None
    u = torch.linspace(0.1, 0.9, H, dtype=torch.float64, requires_grad=True) if mechanism == "hnas" else None
    kw = {"hybrid_weight": u} if u is not None else {}
    ref = ak.attention(
        q, k, v, mechanism, key_mask=key_mask, query_mask=query_mask, backend="reference", **kw
    )
    out = fused_dnas_attention(
        q,
        k,
        v,
        key_mask=key_mask,
        query_mask=query_mask,
        scale=D**-0.5,
        u=None if u is None else u.view(1, H, 1, 1),
    )
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    g = torch.randn_like(out)
    wrt = (q, k, v) if u is None else (q, k, v, u)
    for a, b in zip(torch.autograd.grad(out, wrt, g), torch.autograd.grad(ref, wrt, g)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_gradcheck_float64_with_padding():
    q, k, v = _inputs(2, 2, 4, 5, 3)
    km = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    qm = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert torch.autograd.gradcheck(
        lambda a, b, c: fused_dnas_attention(a, b, c, key_mask=km, query_mask=qm, scale=0.5), (q, k, v)
    )


def test_batch_element_without_keys_or_queries_gives_zeros_and_finite_gradients():
    q, k, v = _inputs(3, 2, 4, 5, 3)
    km = torch.ones(3, 5, dtype=torch.bool)
    qm = torch.ones(3, 4, dtype=torch.bool)
    km[1] = False  # element 1: no key
    qm[2] = False  # element 2: no query
    out = fused_dnas_attention(q, k, v, key_mask=km, query_mask=qm, scale=0.5)
    assert torch.equal(out[1:], torch.zeros_like(out[1:]))
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    ref = ak.attention(q[:1], k[:1], v[:1], "dnas", scale=0.5, backend="reference")
    torch.testing.assert_close(out[:1], ref)


def test_large_logits_stay_finite():
    q, k, v = _inputs(2, 2, 16, 16, 8, dtype=torch.float32, spread=40.0)  # scores of magnitude ~1e4
    out = fused_dnas_attention(q, k, v, key_mask=None, query_mask=None, scale=8**-0.5)
    ref = ak.attention(q.double(), k.double(), v.double(), "dnas", backend="reference")
    assert torch.isfinite(out).all()
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert (out.double() - ref).abs().max() < 1e-3 * (1 + ref.abs().max())


@pytest.mark.parametrize("dtype,factor", [(torch.float32, 10.0), (torch.bfloat16, 1.1)])
def test_error_at_most_a_multiple_of_the_reference_error(dtype, factor):
    q64, k64, v64 = _inputs(2, 4, 64, 64, 32)
    km, qm = _masks(2, 64, 64)
    exact = ak.attention(q64, k64, v64, "dnas", key_mask=km, query_mask=qm, backend="reference")
    q, k, v = (t.detach().to(dtype) for t in (q64, k64, v64))
    ref = ak.attention(q, k, v, "dnas", key_mask=km, query_mask=qm, backend="reference")
    fused = fused_dnas_attention(q, k, v, key_mask=km, query_mask=qm, scale=32**-0.5)

    def mean_abs_error(x):  # the measure of PyTorch's FlexAttention tests
        return (x.double() - exact).abs().mean().item()

    assert mean_abs_error(fused) <= factor * mean_abs_error(ref) + 1e-7


def test_without_the_cpp_kernels_padding_masks_go_to_the_fused_op(monkeypatch):
    monkeypatch.setattr("attnkit.kernels.dispatch.fused_cpu_available", lambda q: False)
    calls = []
    real = aten_fallback.fused_dnas_attention

    def spy(*args, **kwargs):
        calls.append(kwargs["key_mask"] is not None)
        return real(*args, **kwargs)

    monkeypatch.setattr("attnkit.kernels.dispatch.fused_dnas_attention", spy)
    q, k, v = _inputs(1, 2, 8, 8, 4)
    km = torch.ones(1, 8, dtype=torch.bool)
    ak.attention(q, k, v, "dnas", key_mask=km, backend="efficient")
    general = torch.ones(8, 8, dtype=torch.bool)
    general[0, 7] = False  # an all-True attn_mask counts as none
    ak.attention(q, k, v, "dnas", attn_mask=general, backend="efficient")  # block kernel
    assert calls == [True]


@pytest.mark.parametrize("mechanism", ["dnas", "hnas"])
def test_padded_keys_under_large_scores_give_finite_gradients(mechanism):
    # scores of several hundred: a padded key's exp(lse_t - c_j) overflows, and its zero weight times inf
    # made every dq of that batch element NaN
    B, H, L, D = 2, 2, 64, 16
    q, k, v = _inputs(B, H, L, L, D, dtype=torch.float32, spread=12.0)
    km = torch.ones(B, L, dtype=torch.bool)
    km[1, -10:] = False
    qm = torch.ones(B, L, dtype=torch.bool)
    qm[0, -7:] = False
    u = torch.full((1, H, 1, 1), 0.3) if mechanism == "hnas" else None
    out = fused_dnas_attention(q, k, v, key_mask=km, query_mask=qm, scale=D**-0.5, u=u)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    kw = {"hybrid_weight": torch.full((H,), 0.3, dtype=torch.float64)} if u is not None else {}
    ref = ak.attention(q64, k64, v64, mechanism, key_mask=km, query_mask=qm, backend="reference", **kw)
    ref_grads = torch.autograd.grad(ref.sum(), (q64, k64, v64))
    assert (q @ k.transpose(-1, -2)).abs().max() * D**-0.5 > 300
    for a, b in zip(grads, ref_grads):
        assert torch.isfinite(a).all()
        assert (a.double() - b).abs().max() <= 1e-3 * b.abs().max() + 1e-3
