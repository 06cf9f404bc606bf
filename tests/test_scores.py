"""Score functions (docs/design.md section 1) against plain formulas, each fed through ``ak.normalize``."""

from __future__ import annotations

import math
import re

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
F64D = dict(dtype=torch.float64)


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


def _all_scores(Dq=5, Dk=5, dtype=torch.float64, device="cpu"):
    """Every score function, with weights of ``dtype`` on ``device`` for query size Dq and key size Dk."""
    f = dict(dtype=dtype, device=device)
    return {
        "dot": lambda q, k: ak.scores.dot(q, k),
        "scaled_dot": lambda q, k: ak.scores.scaled_dot(q, k),
        "neg_l1_distance": lambda q, k: ak.scores.neg_l1_distance(q, k),
        "bilinear": lambda q, k: ak.scores.bilinear(q, k, torch.ones(Dq, Dk, **f)),
        "additive": lambda q, k: ak.scores.additive(
            q, k, torch.ones(3, Dq, **f), torch.ones(3, Dk, **f), torch.ones(3, **f), torch.zeros(3, **f)
        ),
    }


ALL_SCORES = list(_all_scores())


@pytest.mark.parametrize("score", ["dot", "scaled_dot", "neg_l1_distance"])
def test_unequal_feature_dims_raise_value_error(score):
    q, k = torch.randn(2, 2, 3, 5), torch.randn(2, 2, 4, 6)
    msg = rf"{score}: q has shape \(2, 2, 3, 5\) and k has shape \(2, 2, 4, 6\); their feature dims"
    with pytest.raises(ValueError, match=msg):
        _all_scores()[score](q, k)


@pytest.mark.parametrize("score", ALL_SCORES)
def test_zero_feature_dim_raises_value_error(score):
    q, k = torch.randn(2, 2, 3, 0), torch.randn(2, 2, 4, 0)
    with pytest.raises(ValueError, match=rf"{score}: .*need feature dims D >= 1"):
        _all_scores(0, 0)[score](q, k)


@pytest.mark.parametrize("score", ALL_SCORES)
def test_mixed_dtypes_raise_value_error(score):
    q, k = torch.randn(2, 2, 3, 5), torch.randn(2, 2, 4, 5, dtype=torch.float64)
    msg = rf"{score}: q has dtype torch.float32 but k has dtype torch.float64; cast one"
    with pytest.raises(ValueError, match=msg):
        _all_scores(dtype=torch.float32)[score](q, k)


@pytest.mark.parametrize("score", ["bilinear", "additive"])
def test_weights_of_another_dtype_or_device_raise_value_error(score):
    q, k = torch.randn(2, 2, 3, 5), torch.randn(2, 2, 4, 5)
    msg = rf"{score}: \w+ has dtype torch.float64 but q has dtype torch.float32; cast one"
    with pytest.raises(ValueError, match=msg):
        _all_scores(dtype=torch.float64)[score](q, k)
    with pytest.raises(ValueError, match=rf"{score}: \w+ is on meta but q is on cpu; move one"):
        _all_scores(device="meta")[score](q, k)


@pytest.mark.parametrize("score", ALL_SCORES)
def test_inputs_on_two_devices_raise_value_error(score):
    q, k = torch.randn(2, 2, 3, 5), torch.randn(2, 2, 4, 5, device="meta")
    msg = rf"{score}: q is on cpu but k is on meta; move one with .to\(device\)"
    with pytest.raises(ValueError, match=msg):
        _all_scores()[score](q, k)


@pytest.mark.parametrize("score", ALL_SCORES)
def test_non_floating_or_one_dimensional_inputs_raise_value_error(score):
    fn = _all_scores(dtype=torch.float32)[score]
    with pytest.raises(ValueError, match=rf"{score}: k has dtype torch.int64; expected a floating dtype"):
        fn(torch.randn(2, 2, 3, 5), torch.ones(2, 2, 4, 5, dtype=torch.long))
    with pytest.raises(ValueError, match=rf"{score}: q must be a floating torch.Tensor, got list"):
        fn([[1.0] * 5], torch.randn(2, 2, 4, 5))
    with pytest.raises(ValueError, match=rf"{score}: q has shape \(5,\); expected at least 2-D"):
        fn(torch.randn(5), torch.randn(2, 2, 4, 5))


@pytest.mark.parametrize("score", ALL_SCORES)
def test_batch_dims_that_do_not_broadcast_raise_value_error(score):
    q, k = torch.randn(2, 2, 3, 5), torch.randn(3, 2, 4, 5)
    with pytest.raises(ValueError, match=rf"{score}: .*batch dims \(2, 2\) and \(3, 2\) do not broadcast"):
        _all_scores(dtype=torch.float32)[score](q, k)


@pytest.mark.parametrize("score", ALL_SCORES)
def test_broadcast_batch_dims_equal_the_expanded_inputs(score):
    q, k, _ = random_qkv(2, 3, 4, 5, D=5, seed=9)
    q1 = q[:, :1]  # (B, 1, Lq, D): one query set shared by the heads
    fn = _all_scores()[score]
    expected = fn(q1.expand_as(q).contiguous(), k)
    torch.testing.assert_close(fn(q1, k), expected, **F64)
    torch.testing.assert_close(fn(k, q1), fn(k, q1.expand_as(q).contiguous()), **F64)


@pytest.mark.parametrize("scale", [0, -0.5, float("nan"), float("inf"), True, "0.5"])
@pytest.mark.parametrize("score", ["scaled_dot", "neg_l1_distance"])
def test_bad_scale_raises_value_error(score, scale):
    q, k, _ = random_qkv(1, 1, 2, 3, D=4, seed=10)
    msg = r"scale=.*; expected a finite number > 0 \(default 1/sqrt\(D\) = 0.5\)"
    with pytest.raises(ValueError, match=msg):
        getattr(ak.scores, score)(q, k, scale)


def test_additive_needs_a_hidden_size_and_a_matching_bias():
    q, k, _ = random_qkv(1, 1, 2, 3, D=4, seed=11)
    with pytest.raises(ValueError, match="hidden size A=0"):
        ak.scores.additive(q, k, torch.ones(0, 4, **F64D), torch.ones(0, 4, **F64D), torch.ones(0, **F64D))
    with pytest.raises(ValueError, match=r"bias=\(7,\); expected \(6, 4\), \(6, 4\), \(6,\), \(6,\)"):
        ak.scores.additive(
            q, k, torch.ones(6, 4, **F64D), torch.ones(6, 4, **F64D), torch.ones(6, **F64D),
            torch.ones(7, **F64D),
        )


def test_per_head_bilinear_weight_must_match_the_head_count():
    q, k, _ = random_qkv(2, 2, 3, 4, D=5, seed=12)
    with pytest.raises(ValueError, match=r"bilinear weight has shape \(3, 5, 5\) \(3 heads\).*H = 2"):
        ak.scores.bilinear(q, k, torch.ones(3, 5, 5, **F64D))


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda: ak.scores.AdditiveScore(0, 5, 3), "AdditiveScore(query_dim=0)"),
        (lambda: ak.scores.AdditiveScore(5, -1, 3), "AdditiveScore(key_dim=-1)"),
        (lambda: ak.scores.AdditiveScore(5, 5, 2.5), "AdditiveScore(hidden_dim=2.5)"),
        (lambda: ak.scores.BilinearScore(True, 5), "BilinearScore(query_dim=True)"),
        (lambda: ak.scores.BilinearScore(5, 5, num_heads=0), "BilinearScore(num_heads=0)"),
    ],
)
def test_score_module_sizes_must_be_positive_integers(make, needle):
    with pytest.raises(ValueError, match=re.escape(needle) + ": expected a positive integer"):
        make()


@pytest.mark.parametrize("score", ALL_SCORES)
def test_autocast_allows_mixed_floating_dtypes(score):
    q, k = torch.randn(2, 2, 3, 5), torch.randn(2, 2, 4, 5, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        s = _all_scores(dtype=torch.float32)[score](q, k)
    assert s.shape == (2, 2, 3, 4) and torch.isfinite(s).all()


def test_a_per_head_bilinear_weight_keeps_the_rank_of_three_dimensional_inputs():
    # q (H, Lq, Dq) with W (H, Dq, Dk) gave (1, H, Lq, Lk); dot gives (H, Lq, Lk)
    from attnkit.scores import bilinear

    q, k, w = torch.randn(3, 4, 6), torch.randn(3, 5, 6), torch.randn(3, 6, 6)
    out = bilinear(q, k, w)
    assert out.shape == (3, 4, 5)
    torch.testing.assert_close(out, torch.einsum("hqd,hde,hke->hqk", q, w, k))
    assert bilinear(q[None], k[None], w).shape == (1, 3, 4, 5)
