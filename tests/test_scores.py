"""Score functions (docs/design.md section 1) against plain formulas, each fed through ``ak.normalize``."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit as ak
from tests._reference import (
    random_qkv,
    ref_coda_from_scores,
    ref_dnas,
    ref_hybrid,
    ref_sinkhorn,
    ref_softmax,
)

F64 = dict(atol=1e-12, rtol=1e-10)


def _loop_scores(q, k, pair):
    """``s[b, h, i, j] = pair(q[b, h, i], k[b, h, j], h)`` with explicit loops."""
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    s = torch.empty(B, H, Lq, Lk, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for i in range(Lq):
                for j in range(Lk):
                    s[b, h, i, j] = pair(q[b, h, i], k[b, h, j], h)
    return s


def test_dot_is_the_inner_product():
    q, k, _ = random_qkv(2, 2, 3, 4, D=5, seed=1)
    torch.testing.assert_close(ak.scores.dot(q, k), _loop_scores(q, k, lambda a, c, h: (a * c).sum()), **F64)


def test_scaled_dot_divides_by_sqrt_d_or_uses_the_given_scale():
    q, k, _ = random_qkv(2, 2, 3, 4, D=9, seed=2)
    plain = _loop_scores(q, k, lambda a, c, h: (a * c).sum())
    torch.testing.assert_close(ak.scores.scaled_dot(q, k), plain / 3.0, **F64)
    torch.testing.assert_close(ak.scores.scaled_dot(q, k, 0.25), plain * 0.25, **F64)


@pytest.mark.parametrize("per_head", [False, True])
def test_bilinear_is_q_w_k(per_head):
    q, k, _ = random_qkv(2, 2, 3, 4, D=5, seed=3)
    k = k[..., :4].contiguous()  # Dq = 5, Dk = 4
    g = torch.Generator().manual_seed(0)
    W = torch.randn((2, 5, 4) if per_head else (5, 4), generator=g, dtype=torch.float64)
    expected = _loop_scores(q, k, lambda a, c, h: a @ (W[h] if per_head else W) @ c)
    torch.testing.assert_close(ak.scores.bilinear(q, k, W), expected, **F64)
    module = ak.scores.BilinearScore(5, 4, num_heads=2 if per_head else None).double()
    with torch.no_grad():
        module.weight.copy_(W)
    torch.testing.assert_close(module(q, k), expected, **F64)


@pytest.mark.parametrize("with_bias", [False, True])
def test_additive_is_w_tanh_wq_q_plus_wk_k(with_bias):
    q, k, _ = random_qkv(2, 2, 3, 4, D=5, seed=4)
    g = torch.Generator().manual_seed(0)
    A = 6
    Wq, Wk = (
        torch.randn(A, 5, generator=g, dtype=torch.float64),
        torch.randn(A, 5, generator=g, dtype=torch.float64),
    )
    w, b = torch.randn(A, generator=g, dtype=torch.float64), torch.randn(A, generator=g, dtype=torch.float64)
    bias = b if with_bias else torch.zeros(A, dtype=torch.float64)
    expected = _loop_scores(q, k, lambda a, c, h: w @ torch.tanh(Wq @ a + Wk @ c + bias))
    got = ak.scores.additive(q, k, Wq, Wk, w, b if with_bias else None)
    torch.testing.assert_close(got, expected, **F64)
    module = ak.scores.AdditiveScore(5, 5, A).double()
    with torch.no_grad():
        module.w_q.copy_(Wq), module.w_k.copy_(Wk), module.w.copy_(w), module.bias.copy_(bias)
    torch.testing.assert_close(module(q, k), expected, **F64)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_neg_l1_distance_is_minus_scaled_l1(dtype):
    q, k, _ = random_qkv(2, 2, 3, 4, D=4, seed=5)
    expected = _loop_scores(q, k, lambda a, c, h: -(a - c).abs().sum() / 2.0)
    got = ak.scores.neg_l1_distance(q.to(dtype), k.to(dtype))
    assert got.dtype == dtype
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 5e-2}[dtype]
    torch.testing.assert_close(got.double(), expected, atol=tol, rtol=tol)
    torch.testing.assert_close(ak.scores.neg_l1_distance(q, k, 0.1), expected * 2.0 * 0.1, **F64)


def test_module_parameters_get_gradients():
    q, k, _ = random_qkv(1, 2, 3, 4, D=5, seed=6)
    for module in (ak.scores.BilinearScore(5, 5), ak.scores.AdditiveScore(5, 5, 7)):
        module = module.double()
        module(q, k).sum().backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in module.parameters())
        assert "query_dim=5" in repr(module)


def test_bad_score_weights_raise_value_error():
    q, k, _ = random_qkv(1, 2, 3, 4, D=5, seed=7)
    with pytest.raises(ValueError, match=r"bilinear weight has shape \(4, 5\); expected \(5, 5\)"):
        ak.scores.bilinear(q, k, torch.randn(4, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="additive weights have shapes"):
        ak.scores.additive(q, k, torch.randn(6, 4), torch.randn(6, 5), torch.randn(6))


def _score_functions():
    g = torch.Generator().manual_seed(42)
    W = torch.randn(5, 5, generator=g, dtype=torch.float64) / math.sqrt(5)
    Wq, Wk = (
        torch.randn(6, 5, generator=g, dtype=torch.float64),
        torch.randn(6, 5, generator=g, dtype=torch.float64),
    )
    w = torch.randn(6, generator=g, dtype=torch.float64)
    return {
        "dot": lambda q, k: ak.scores.dot(q, k),
        "scaled_dot": lambda q, k: ak.scores.scaled_dot(q, k),
        "bilinear": lambda q, k: ak.scores.bilinear(q, k, W),
        "additive": lambda q, k: ak.scores.additive(q, k, Wq, Wk, w),
    }


SCORE_FUNCTIONS = _score_functions()
MECHANISM_REFS = {
    "softmax": ({}, lambda s, valid, q, k: ref_softmax(s, valid)),
    "dnas": ({}, lambda s, valid, q, k: ref_dnas(s, valid)),
    "hnas": ({"hybrid_weight": 0.3}, lambda s, valid, q, k: ref_hybrid(s, valid, 0.3)),
    "sinkhorn": ({"sinkhorn_iters": 4}, lambda s, valid, q, k: ref_sinkhorn(s, valid, 4)),
    "coda": (
        {},
        lambda s, valid, q, k: ref_coda_from_scores(
            s, -(q.unsqueeze(-2) - k.unsqueeze(-3)).abs().sum(-1) / math.sqrt(q.shape[-1]), valid
        ),
    ),
}


@pytest.mark.parametrize("mechanism", list(MECHANISM_REFS))
@pytest.mark.parametrize("score", list(SCORE_FUNCTIONS))
def test_every_score_function_feeds_every_mechanism(score, mechanism):
    q, k, _ = random_qkv(2, 2, 4, 5, D=5, seed=8)
    key_mask = torch.tensor([[True] * 5, [True, True, True, False, False]])
    query_mask = torch.tensor([[True] * 4, [True, True, False, False]])
    s = SCORE_FUNCTIONS[score](q, k)
    options, ref = MECHANISM_REFS[mechanism]
    gate = ak.scores.neg_l1_distance(q, k) if mechanism == "coda" else None
    w = ak.normalize(s, mechanism, key_mask=key_mask, query_mask=query_mask, gate_scores=gate, **options)
    valid = (key_mask[:, None, None, :] & query_mask[:, None, :, None]).expand(2, 2, 4, 5)
    torch.testing.assert_close(w, ref(s, valid, q, k), **F64)
    assert torch.all(w[~valid] == 0)
