"""Attention dropout in the C++ CPU kernels (kernels/cpp_potentials.py): the dropped weights are the reference
weights times a {0, 1/(1-p)} mask, the backward pass replays that mask exactly (gradcheck with a fixed seed),
and backend='auto' takes the kernels for DNAS/HNAS/Sinkhorn under dropout."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.kernels import cpu_ext
from attnkit.kernels.cpp_potentials import fused_cpu_attention

pytestmark = pytest.mark.skipif(not cpu_ext.load(warn=False), reason="C++ CPU kernels not built")

MECHS = {"dnas": ("dnas", 1, {}), "hnas": ("hnas", 1, {"hybrid_weight": 0.3}),
         "sinkhorn3": (ak.Sinkhorn(iters=3), 3, {})}


def _qk(B, H, Lq, Lk, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, Lq, D, generator=g, dtype=torch.float64), torch.randn(
        B, H, Lk, D, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("name", list(MECHS))
def test_dropped_weights_are_reference_weights_times_a_keep_mask(name):
    """With ``v = I`` the output rows are the (dropped) weight rows themselves."""
    mech, iters, kw = MECHS[name]
    B, H, Lq, Lk, p = 2, 3, 40, 48, 0.25
    q, k = _qk(B, H, Lq, Lk, 8)
    v = torch.eye(Lk, dtype=torch.float64).expand(B, H, Lk, Lk)
    km = torch.arange(Lk)[None, :] < torch.tensor([[Lk], [30]])
    qm = torch.arange(Lq)[None, :] < torch.tensor([[35], [Lq]])
    _, w = ak.attention(q, k, v, mech, key_mask=km, query_mask=qm, return_weights=True, **kw)
    u = torch.tensor(0.3, dtype=torch.float64) if name == "hnas" else None
    out = fused_cpu_attention(
        q, k, v, key_mask=km, query_mask=qm, scale=8**-0.5, iters=iters, u=u, dropout_p=p
    )
    positive = w > 1e-12
    ratio = out[positive] / w[positive]
    keep = 1 / (1 - round(p * 65536) / 65536)
    assert torch.all((ratio.abs() < 1e-9) | ((ratio - keep).abs() < 1e-9))
    assert torch.all(out[~positive].abs() < 1e-12)
    dropped = (ratio.abs() < 1e-9).double().mean().item()
    assert abs(dropped - p) < 0.03, dropped  # 2 * 3 * ~1500 pairs: the dropped share is close to p
    torch.manual_seed(0)
    again = fused_cpu_attention(
        q, k, v, key_mask=km, query_mask=qm, scale=8**-0.5, iters=iters, u=u, dropout_p=p
    )
    assert not torch.equal(out, again)  # a new mask per call


@pytest.mark.parametrize("name", list(MECHS))
def test_gradients_replay_the_forward_mask(name):
    mech, iters, kw = MECHS[name]
    q, k = _qk(2, 2, 9, 11, 4, seed=3)
    v = torch.randn(2, 2, 11, 5, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    km = torch.ones(2, 11, dtype=torch.bool)
    km[1, 7:] = False
    qm = torch.ones(2, 9, dtype=torch.bool)
    qm[0, 6:] = False
    u = (
        torch.tensor([0.2, 0.7], dtype=torch.float64).view(1, 2, 1, 1).requires_grad_()
        if name == "hnas" else None
    )

    def f(q_, k_, v_, *rest):
        torch.manual_seed(11)  # the same mask in every evaluation
        return fused_cpu_attention(q_, k_, v_, key_mask=km, query_mask=qm, scale=0.5, iters=iters,
                                   u=rest[0] if rest else None, dropout_p=0.3)

    inputs = [t.clone().requires_grad_() for t in (q, k, v)] + ([u] if u is not None else [])
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["dnas", "hnas"])
def test_auto_backend_takes_the_kernels_under_dropout(name, monkeypatch):
    from attnkit.kernels import dispatch

    calls = []
    real = dispatch.fused_cpu_attention
    monkeypatch.setattr(
        dispatch, "fused_cpu_attention", lambda *a, **kw: calls.append(kw["dropout_p"]) or real(*a, **kw)
    )
    q, k = _qk(2, 2, 6, 6, 4)
    v = torch.randn(2, 2, 6, 4, dtype=torch.float64)
    km = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    out = ak.attention(q, k, v, MECHS[name][0], key_mask=km, dropout_p=0.1, **MECHS[name][2])
    assert calls == [0.1] and torch.isfinite(out).all()
    calls.clear()
    ak.attention(q, k, v, MECHS[name][0], key_mask=km, causal=False, dropout_p=0.0, **MECHS[name][2])
    assert calls == [0.0]


# Softmax with attention dropout on the CPU (dispatch route ``cpp_softmax``): SDPA's fused CPU kernel has no
# dropout (it falls back to its materializing math path), so the C++ kernels' replayed dropout serves it.
@pytest.mark.parametrize("mech", ["softmax", ak.Sinkhorn(iters=0)])
def test_softmax_with_dropout_takes_the_cpp_route_and_matches_the_masked_reference(mech):
    """With ``v = I`` the output rows are the dropped weight rows: softmax's weights times a keep mask, rows
    of padded queries and of elements without keys zero; gradients replay the mask (gradcheck)."""
    B, H, Lq, Lk, p = 2, 3, 40, 48, 0.25
    q, k = _qk(B, H, Lq, Lk, 8, seed=5)
    v = torch.eye(Lk, dtype=torch.float64).expand(B, H, Lk, Lk)
    km = torch.arange(Lk)[None, :] < torch.tensor([[Lk], [30]])
    qm = torch.arange(Lq)[None, :] < torch.tensor([[35], [Lq]])
    plan = ak.explain_dispatch(q, k, v, mech, key_mask=km, query_mask=qm, dropout_p=p)
    assert plan.route == "cpp_softmax", plan
    _, w = ak.attention(q, k, v, "softmax", key_mask=km, query_mask=qm, return_weights=True)
    out = ak.attention(q, k, v, mech, key_mask=km, query_mask=qm, dropout_p=p)
    positive = w > 1e-12
    ratio = out[positive] / w[positive]
    keep = 1 / (1 - round(p * 65536) / 65536)
    assert torch.all((ratio.abs() < 1e-9) | ((ratio - keep).abs() < 1e-9))
    assert torch.all(out[~positive].abs() < 1e-12)
    assert abs((ratio.abs() < 1e-9).double().mean().item() - p) < 0.03

    v = torch.randn(B, H, Lk, 5, generator=torch.Generator().manual_seed(4), dtype=torch.float64)

    km_small = km[:, :20].clone()
    km_small[1, 14:] = False

    def f(q_, k_, v_):
        torch.manual_seed(11)  # the same mask in every evaluation
        return ak.attention(q_, k_, v_, mech, key_mask=km_small, query_mask=qm[:, :9], dropout_p=0.3,
                            backend="efficient")

    small = [t.clone().requires_grad_() for t in (q[:, :2, :9], k[:, :2, :20], v[:, :2, :20])]
    assert torch.autograd.gradcheck(f, small, eps=1e-6, atol=1e-7)


def test_softmax_route_keeps_sdpa_without_dropout_and_for_other_masks():
    q, k = _qk(2, 2, 16, 16, 8)
    v = torch.randn(2, 2, 16, 8, dtype=torch.float64)
    km = torch.ones(2, 16, dtype=torch.bool)
    assert ak.explain_dispatch(q, k, v, "softmax", key_mask=km, backend="efficient").route == "sdpa"
    plan = ak.explain_dispatch(q, k, v, "softmax", causal=True, dropout_p=0.1, backend="efficient")
    assert plan.route == "sdpa" and "padding masks only" in plan.reason


def _splitmix(x: int) -> int:
    m = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


@pytest.mark.parametrize("iters", [0, 1, 3])
def test_keep_mask_is_the_documented_hash(iters):
    """Pair (i, j) of head bh is kept iff the 16-bit lane j % 4 of splitmix64(seed ^ splitmix64(bh << 32 ^ i)
    + j // 4) is >= round(p * 2**16) (csrc/cpu_common.h): 301 keys (three strips, a partial group of four at
    the end), queries in chunks of 16, three heads; with ``v = I`` the output rows are the dropped weights."""
    BH, Lq, Lk, p, seed = 3, 37, 301, 0.3, 123456789
    g = torch.Generator().manual_seed(0)
    q = torch.randn(BH, Lq, 8, generator=g, dtype=torch.float64)
    k = torch.randn(BH, Lk, 8, generator=g, dtype=torch.float64)
    v = torch.eye(Lk, dtype=torch.float64).expand(BH, Lk, Lk).contiguous()
    out, *_ = torch.ops.attnkit_cpu.potentials_forward(
        q, k, v, None, None, BH, 0.3, iters, False, p, seed, 0, 16)  # chunks of 16 queries
    thr = round(p * 65536)
    want = torch.zeros(BH, Lq, Lk, dtype=torch.bool)
    for bh in range(BH):
        for i in range(Lq):
            base = seed ^ _splitmix((bh << 32) ^ i)
            hashes = [_splitmix(base + group) for group in range((Lk + 3) // 4)]
            lanes = [(hashes[j // 4] >> (16 * (j % 4))) & 0xFFFF for j in range(Lk)]
            want[bh, i] = torch.tensor([lane >= thr for lane in lanes])
    assert torch.equal(out > 0, want)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_softmax_with_padding_takes_the_cpp_route_and_matches_the_reference(dtype):
    """Without dropout too, a padded CPU batch takes the C++ kernels (they compute the valid tokens only):
    outputs and gradients equal the materialized reference, padded queries zero; unpadded masks keep SDPA."""
    B, H, Lq, Lk = 3, 2, 150, 140  # two key strips
    q, k = _qk(B, H, Lq, Lk, 16, seed=6)
    v = torch.randn(B, H, Lk, 8, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    km = torch.arange(Lk)[None, :] < torch.tensor([[Lk], [100], [0]])  # the last element has no key
    qm = torch.arange(Lq)[None, :] < torch.tensor([[120], [Lq], [Lq]])
    q, k, v = (t.to(dtype).requires_grad_() for t in (q, k, v))
    assert ak.explain_dispatch(q, k, v, "softmax", key_mask=km, query_mask=qm).route == "cpp_softmax"
    full = torch.ones(B, Lk, dtype=torch.bool)
    assert ak.explain_dispatch(q, k, v, "softmax", key_mask=full).route == "sdpa"
    out = ak.attention(q, k, v, "softmax", key_mask=km, query_mask=qm)
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = ak.attention(*exact, "softmax", key_mask=km, query_mask=qm, backend="reference")
    tol = {"atol": 1e-12, "rtol": 1e-10} if dtype == torch.float64 else {"atol": 2e-6, "rtol": 1e-5}
    torch.testing.assert_close(out.double(), ref, **tol)
    assert torch.equal(out[0, :, 120:], torch.zeros_like(out[0, :, 120:])) and not out[2].any()
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), g.to(dtype))
    want = torch.autograd.grad(ref, exact, g)
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a.double(), b, **tol, msg=lambda m, n=name: f"d{n}: {m}")
