"""``ak.attention`` / ``ak.normalize`` for every mechanism against the float64 references of
``tests/_reference.py``: padding, masks, causal, shapes, dtypes, large logits and bad input."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit as ak
from tests._reference import (
    CASES,
    full_valid,
    random_lengths_masks,
    random_qkv,
    ref_attention,
    ref_coda_from_scores,
    ref_weights,
)

CASE_PARAMS = [pytest.param(c, id=c.id) for c in CASES]

CAUSAL_OK = [pytest.param(c, id=c.id) for c in CASES if c.causal_ok]
CAUSAL_LEAKY = [pytest.param(c, id=c.id) for c in CASES if not c.causal_ok]
NOT_CODA = [pytest.param(c, id=c.id) for c in CASES if c.ref_mechanism != "coda"]
ONE_PER_MECHANISM = [
    pytest.param(c, id=c.id)
    for c in CASES
    if c.id in ("softmax", "dnas", "hnas-per-head", "sinkhorn-2", "coda-default", "coda-center_e-centered")
]

F64 = dict(atol=1e-10, rtol=1e-8)  # float64 against float64: only summation order differs


def attend(case, q, k, v, backend="reference", **kwargs):
    return ak.attention(q, k, v, case.attnkit_mechanism(ak), backend=backend, **case.call, **kwargs)


def reference(case, q, k, v, **kwargs):
    return ref_attention(q, k, v, case.ref_mechanism, **case.ref, **kwargs)[0]


def grads(out, inputs, seed=1):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(
        out.dtype
    )
    return torch.autograd.grad((out * g).sum(), inputs, allow_unused=True)


# ------------------------------------------------------------------------------ padding

@pytest.mark.parametrize("case", CASE_PARAMS)
@pytest.mark.parametrize(
    "q_lengths,k_lengths", [([5, 3, 1], [5, 3, 1]), ([4, 2, 4], [6, 1, 3])], ids=["self", "cross"]
)
def test_padding_equals_truncation(case, backend, q_lengths, k_lengths):
    Lq, Lk = max(q_lengths), max(k_lengths)
    q, k, v = random_qkv(B=3, H=2, Lq=Lq, Lk=Lk, D=4, Dv=3, seed=11)
    qm, km = random_lengths_masks(q_lengths, Lq), random_lengths_masks(k_lengths, Lk)
    padded = attend(case, q, k, v, backend, key_mask=km, query_mask=qm)
    for b, (nq, nk) in enumerate(zip(q_lengths, k_lengths)):
        alone = attend(case, q[b : b + 1, :, :nq], k[b : b + 1, :, :nk], v[b : b + 1, :, :nk], backend)
        torch.testing.assert_close(padded[b : b + 1, :, :nq], alone, **F64)
        assert torch.equal(padded[b, :, nq:], torch.zeros_like(padded[b, :, nq:])), (
            "padded queries must output 0"
        )


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_padding_equals_truncation_for_gradients(case, backend):
    lengths = [5, 2]
    q, k, v = random_qkv(B=2, H=2, Lq=5, Lk=5, D=3, Dv=2, seed=12, requires_grad=True)
    m = random_lengths_masks(lengths, 5)
    out = attend(case, q, k, v, backend, key_mask=m, query_mask=m)
    dq, dk, dv = grads(out, (q, k, v))
    for b, n in enumerate(lengths):
        qs, ks, vs = (t.detach()[b : b + 1, :, :n].clone().requires_grad_() for t in (q, k, v))
        alone = attend(case, qs, ks, vs, backend)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)[
            b : b + 1, :, :n
        ]
        sq, sk, sv = torch.autograd.grad((alone * g).sum(), (qs, ks, vs))
        torch.testing.assert_close(dq[b : b + 1, :, :n], sq, **F64)
        torch.testing.assert_close(dk[b : b + 1, :, :n], sk, **F64)
        torch.testing.assert_close(dv[b : b + 1, :, :n], sv, **F64)
        assert torch.all(dq[b, :, n:] == 0) and torch.all(dk[b, :, n:] == 0) and torch.all(dv[b, :, n:] == 0)


# ------------------------------------------------------------------------ masked rows/columns


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_fully_masked_query_rows_are_zero_with_finite_gradients(case, backend):
    B, H, Lq, Lk = 2, 2, 4, 5
    q, k, v = random_qkv(B, H, Lq, Lk, seed=3, requires_grad=True)
    attn_mask = torch.ones(B, 1, Lq, Lk, dtype=torch.bool)
    attn_mask[0, :, 1] = False  # row 1 of batch 0 has no valid key
    km = torch.ones(B, Lk, dtype=torch.bool)
    km[1] = False  # batch 1 has no valid key at all
    km[1, 0] = True
    attn_mask[1, :, :, 0] = False
    out = attend(case, q, k, v, backend, attn_mask=attn_mask, key_mask=km)
    assert torch.isfinite(out).all()
    assert torch.equal(out[0, :, 1], torch.zeros_like(out[0, :, 1]))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(out, reference(case, q, k, v, attn_mask=attn_mask, key_mask=km), **F64)
    for g in grads(out, (q, k, v)):
        assert torch.isfinite(g).all()


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_fully_masked_key_columns_get_no_weight(case, backend):
    B, H, Lq, Lk = 2, 2, 4, 5
    q, k, v = random_qkv(B, H, Lq, Lk, seed=4, requires_grad=True)
    km = torch.ones(B, Lk, dtype=torch.bool)
    km[0, 2] = False
    attn_mask = torch.ones(1, 1, Lq, Lk, dtype=torch.bool)
    attn_mask[..., 4] = False  # key 4: no query may attend to it (a column with no valid query)
    out = attend(case, q, k, v, backend, key_mask=km, attn_mask=attn_mask)
    torch.testing.assert_close(out, reference(case, q, k, v, key_mask=km, attn_mask=attn_mask), **F64)
    _, dk, dv = grads(out, (q, k, v))
    for b, j in ((0, 2), (0, 4), (1, 4)):
        assert torch.all(dk[b, :, j] == 0) and torch.all(dv[b, :, j] == 0), (
            f"masked key ({b}, {j}) got a gradient"
        )
    v2 = v.detach().clone()
    v2[0, :, 2] += 100.0
    v2[:, :, 4] -= 100.0
    torch.testing.assert_close(attend(case, q, k, v2, backend, key_mask=km, attn_mask=attn_mask), out, **F64)


# ------------------------------------------------------------------------------- shapes


SHAPES = {
    "rectangular-wide": (2, 3, 7),
    "rectangular-tall": (2, 7, 3),
    "batch1": (1, 4, 4),
    "length1": (2, 1, 1),
    "one-query": (2, 1, 5),
    "one-key": (2, 5, 1),
}


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
@pytest.mark.parametrize("case", CASE_PARAMS)
def test_matches_reference_for_shape(case, backend, shape):
    B, Lq, Lk = shape
    q, k, v = random_qkv(B, 2, Lq, Lk, D=4, Dv=3, seed=5, requires_grad=True)
    km = torch.ones(B, Lk, dtype=torch.bool)
    if Lk > 2:
        km[-1, -1] = False
    out = attend(case, q, k, v, backend, key_mask=km)
    ref = reference(case, q, k, v, key_mask=km)
    assert out.shape == (B, 2, Lq, 3)
    torch.testing.assert_close(out, ref, **F64)
    for mine, theirs in zip(grads(out, (q, k, v)), grads(ref, (q, k, v))):
        torch.testing.assert_close(mine, theirs, **F64)


@pytest.mark.parametrize("case", ONE_PER_MECHANISM)
def test_value_dim_may_differ_from_head_dim(case, backend):
    q, k, v = random_qkv(2, 2, 3, 4, D=4, Dv=7, seed=6)
    torch.testing.assert_close(attend(case, q, k, v, backend), reference(case, q, k, v), **F64)


@pytest.mark.parametrize("case", ONE_PER_MECHANISM)
def test_custom_scale_matches_reference(case, backend):
    q, k, v = random_qkv(2, 2, 4, 5, seed=7)
    out = attend(case, q, k, v, backend, scale=0.37)
    torch.testing.assert_close(out, reference(case, q, k, v, scale=0.37), **F64)
    assert not torch.allclose(out, attend(case, q, k, v, backend)), "scale had no effect"


# ------------------------------------------------------------------------------- dtypes

# Stated tolerances: max |out - out_float64| <= TOL * (1 + max |out_float64|) (CoDA outputs are sums, not
# averages, so the bound scales with the output). Gradients use the same rule with GRAD_TOL.
TOL = {torch.float32: 2e-5, torch.bfloat16: 2.5e-2}
GRAD_TOL = {torch.float32: 5e-5, torch.bfloat16: 6e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("case", CASE_PARAMS)
def test_low_precision_error_within_stated_tolerance(case, backend, dtype):
    B, H, L, D = 2, 2, 12, 8
    q, k, v = random_qkv(B, H, L, L, D=D, Dv=D, seed=8)
    m = random_lengths_masks([12, 7], L)
    ref = attend(
        case, *(t.clone().requires_grad_() for t in (q, k, v)), "reference", key_mask=m, query_mask=m
    )
    ql, kl, vl = (t.to(dtype).requires_grad_() for t in (q, k, v))
    out = attend(case, ql, kl, vl, backend, key_mask=m, query_mask=m)
    assert out.dtype == dtype
    err = (out.double() - ref).abs().max().item()
    assert err <= TOL[dtype] * (1 + ref.abs().max().item()), f"{dtype} output error {err:.3g}"
    q64, k64, v64 = (t.clone().requires_grad_() for t in (q, k, v))
    ref = attend(case, q64, k64, v64, "reference", key_mask=m, query_mask=m)
    for mine, theirs in zip(grads(out, (ql, kl, vl)), grads(ref, (q64, k64, v64))):
        gerr = (mine.double() - theirs).abs().max().item()
        assert gerr <= GRAD_TOL[dtype] * (1 + theirs.abs().max().item()), f"{dtype} gradient error {gerr:.3g}"


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_large_logits_stay_finite(case, backend):
    q, k, v = random_qkv(2, 2, 5, 6, D=4, seed=9, dtype=torch.float32, scale=100.0, requires_grad=True)
    assert ak.scores.scaled_dot(q, k).abs().max() > 1e3
    m = random_lengths_masks([6, 3], 6)
    out = attend(case, q, k, v, backend, key_mask=m, query_mask=m[:, :5])
    assert torch.isfinite(out).all()
    for g in grads(out, (q, k, v)):
        assert torch.isfinite(g).all()
    if case.ref_mechanism != "coda":  # convex combinations of the values
        assert out.abs().max() <= v.abs().max() * (1 + 1e-5)


# -------------------------------------------------------------------------------- masks


@pytest.mark.parametrize("case", NOT_CODA)
def test_float_attn_mask_with_neg_inf_matches_reference(case, backend):
    B, H, Lq, Lk = 2, 2, 4, 5
    q, k, v = random_qkv(B, H, Lq, Lk, seed=10, requires_grad=True)
    g = torch.Generator().manual_seed(0)
    bias = torch.randn(B, 1, Lq, Lk, generator=g, dtype=torch.float64)
    bias[torch.rand(B, 1, Lq, Lk, generator=g) < 0.3] = float("-inf")
    bias[0, 0, 2] = float("-inf")  # a row with no valid key
    out = attend(case, q, k, v, backend, attn_mask=bias)
    ref = reference(case, q, k, v, attn_mask=bias)
    assert torch.isfinite(out).all() and torch.all(out[0, :, 2] == 0)
    torch.testing.assert_close(out, ref, **F64)
    for mine, theirs in zip(grads(out, (q, k, v)), grads(ref, (q, k, v))):
        torch.testing.assert_close(mine, theirs, **F64)


@pytest.mark.parametrize(
    "blocked", [-1e9, torch.finfo(torch.float64).min, -1e4], ids=["-1e9", "finfo.min", "-1e4"]
)
@pytest.mark.parametrize("case", NOT_CODA)
def test_a_very_negative_float_key_bias_masks_the_key_like_key_mask(case, backend, blocked):
    # Column normalizations cancel a constant per-key bias: only as a mask does it keep padded keys out.
    q, k, v = random_qkv(2, 2, 5, 5, seed=11)
    km = random_lengths_masks([5, 3], 5)
    bias = torch.zeros(2, 1, 1, 5, dtype=torch.float64).masked_fill(~km[:, None, None, :], blocked)
    out = attend(case, q, k, v, backend, attn_mask=bias, query_mask=km)
    torch.testing.assert_close(out, attend(case, q, k, v, backend, key_mask=km, query_mask=km), **F64)
    torch.testing.assert_close(out, reference(case, q, k, v, key_mask=km, query_mask=km), **F64)


@pytest.mark.parametrize("case", [c for c in CASE_PARAMS if c.values[0].ref_mechanism == "coda"][:2])
def test_coda_rejects_float_attn_mask(case):
    q, k, v = random_qkv(1, 2, 3, 3)
    with pytest.raises(ValueError, match="multiplicative"):
        attend(case, q, k, v, attn_mask=torch.zeros(3, 3, dtype=torch.float64))


ATTN_MASK_SHAPES = {
    "Lq,Lk": (4, 5),
    "1,Lq,Lk": (1, 4, 5),
    "H,Lq,Lk": (2, 4, 5),
    "B,1,Lq,Lk": (3, 1, 4, 5),
    "1,H,Lq,Lk": (1, 2, 4, 5),
    "B,H,Lq,Lk": (3, 2, 4, 5),
    "B,1,1,Lk": (3, 1, 1, 5),
    "Lq,1": (4, 1),
}


@pytest.mark.parametrize("shape", list(ATTN_MASK_SHAPES.values()), ids=list(ATTN_MASK_SHAPES))
@pytest.mark.parametrize("case", ONE_PER_MECHANISM)
def test_attn_mask_broadcasting_equals_expanded_mask(case, backend, shape):
    q, k, v = random_qkv(3, 2, 4, 5, seed=13)
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(1)) < 0.7
    out = attend(case, q, k, v, backend, attn_mask=mask)
    expanded = attend(case, q, k, v, backend, attn_mask=mask.expand(3, 2, 4, 5).clone())
    torch.testing.assert_close(out, expanded, **F64)
    torch.testing.assert_close(out, reference(case, q, k, v, attn_mask=mask), **F64)


# -------------------------------------------------------------------------------- causal


@pytest.mark.parametrize("case", CAUSAL_OK)
@pytest.mark.parametrize("t", [1, 3, 5])
def test_causal_does_not_leak(case, backend, t):
    L = 6
    q, k, v = random_qkv(2, 2, L, L, seed=14)
    km = random_lengths_masks([6, 5], L)
    out = attend(case, q, k, v, backend, causal=True, key_mask=km)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for tensor in (q2, k2, v2):
        tensor[:, :, t:] += torch.randn(tensor[:, :, t:].shape, dtype=tensor.dtype) * 3
    out2 = attend(case, q2, k2, v2, backend, causal=True, key_mask=km)
    torch.testing.assert_close(out2[:, :, :t], out[:, :, :t], atol=1e-12, rtol=0)
    assert not torch.allclose(out2[:, :, t:], out[:, :, t:]), "the perturbation should change later outputs"


@pytest.mark.parametrize("case", CAUSAL_OK)
@pytest.mark.parametrize("Lq,Lk", [(5, 5), (3, 6), (6, 3)])
def test_causal_matches_reference(case, backend, Lq, Lk):
    q, k, v = random_qkv(2, 2, Lq, Lk, seed=15, requires_grad=True)
    out = attend(case, q, k, v, backend, causal=True)
    ref = reference(case, q, k, v, causal=True)
    torch.testing.assert_close(out, ref, **F64)
    for mine, theirs in zip(grads(out, (q, k, v)), grads(ref, (q, k, v))):
        torch.testing.assert_close(mine, theirs, **F64)


@pytest.mark.parametrize("case", CAUSAL_LEAKY)
def test_causal_raises_for_mechanisms_that_would_leak(case):
    q, k, v = random_qkv(1, 2, 4, 4)
    with pytest.raises(ValueError, match="leak"):
        attend(case, q, k, v, causal=True)
    with pytest.raises(ValueError, match="leak"):
        ak.normalize(
            ak.scores.scaled_dot(q, k), case.attnkit_mechanism(ak), causal=True,
            gate_scores=ak.scores.neg_l1_distance(q, k) if case.ref_mechanism == "coda" else None,
            **case.call,
        )


def _causal_masks(L: int) -> dict:
    tril = torch.ones(L, L, dtype=torch.bool).tril()
    return {
        "bool": tril,
        "float -inf": torch.zeros(L, L, dtype=torch.float64).masked_fill(~tril, float("-inf")),
        "with padding": tril & random_lengths_masks([L, L - 1], L)[:, None, None, :],
    }


@pytest.mark.parametrize("case", CAUSAL_LEAKY)
@pytest.mark.parametrize("kind", ["bool", "float -inf", "with padding"])
def test_a_causal_attn_mask_raises_for_mechanisms_that_would_leak(case, kind):
    q, k, v = random_qkv(2, 2, 4, 4)
    mask = _causal_masks(4)[kind]
    if case.ref_mechanism == "coda" and mask.dtype != torch.bool:
        mask = mask == 0  # CoDA takes boolean masks only
    with pytest.raises(ValueError, match="causal pattern.*leak"):
        attend(case, q, k, v, attn_mask=mask)
    with pytest.raises(ValueError, match="causal pattern.*leak"):
        ak.normalize(
            ak.scores.scaled_dot(q, k), case.attnkit_mechanism(ak), attn_mask=mask,
            gate_scores=ak.scores.neg_l1_distance(q, k) if case.ref_mechanism == "coda" else None,
            **case.call,
        )


@pytest.mark.parametrize("case", CAUSAL_OK)
def test_a_causal_attn_mask_equals_causal_true_where_nothing_leaks(case, backend):
    q, k, v = random_qkv(2, 2, 5, 5, seed=18)
    out = attend(case, q, k, v, backend, attn_mask=_causal_masks(5)["bool"])
    torch.testing.assert_close(out, attend(case, q, k, v, backend, causal=True), **F64)


# ------------------------------------------------------------------------ weights, dropout


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_return_weights_equal_reference_weights(case):
    q, k, v = random_qkv(2, 2, 4, 5, seed=16)
    km = random_lengths_masks([5, 3], 5)
    qm = random_lengths_masks([4, 2], 4)
    out, w = attend(case, q, k, v, return_weights=True, key_mask=km, query_mask=qm)
    ref_out, ref_w = ref_attention(q, k, v, case.ref_mechanism, key_mask=km, query_mask=qm, **case.ref)
    assert w.shape == (2, 2, 4, 5)
    torch.testing.assert_close(w, ref_w, **F64)
    torch.testing.assert_close(out, w @ v, **F64)
    valid = full_valid(2, 2, 4, 5, key_mask=km, query_mask=qm)
    assert torch.all(w[~valid] == 0), "invalid pairs must weigh exactly 0"


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_normalize_matches_reference(case):
    q, k, _ = random_qkv(2, 2, 4, 5, seed=17)
    km = random_lengths_masks([5, 2], 5)
    s = ak.scores.scaled_dot(q, k)
    gate = ak.scores.neg_l1_distance(q, k) if case.ref_mechanism == "coda" else None
    w = ak.normalize(s, case.attnkit_mechanism(ak), key_mask=km, gate_scores=gate, **case.call)
    torch.testing.assert_close(w, ref_weights(q, k, case.ref_mechanism, key_mask=km, **case.ref), **F64)


@pytest.mark.parametrize("case", CAUSAL_LEAKY)
def test_a_causal_pattern_of_neg_inf_scores_raises_in_normalize_for_mechanisms_that_would_leak(case):
    # -inf scores hide pairs as a mask does: a causal pattern given that way leaks as attn_mask=tril would
    q, k, _ = random_qkv(2, 2, 4, 4, seed=23)
    future = torch.ones(4, 4, dtype=torch.bool).triu(1)
    gate = ak.scores.neg_l1_distance(q, k) if case.ref_mechanism == "coda" else None
    with pytest.raises(ValueError, match="masked scores is a causal pattern.*leak"):
        ak.normalize(
            ak.scores.scaled_dot(q, k).masked_fill(future, float("-inf")), case.attnkit_mechanism(ak),
            gate_scores=gate, **case.call,
        )


@pytest.mark.parametrize("fill", [torch.finfo(torch.float64).min, -1e9], ids=["finfo-min", "-1e9"])
@pytest.mark.parametrize("mechanism", ["dnas", "sinkhorn"])
def test_normalize_reads_scores_with_a_mask_added_as_masked_pairs(mechanism, fill):
    """Scores with Hugging Face's eager mask added (``scores + finfo.min``) gave the padded keys 0.81 of each
    dnas row: the column normalization cancels a per-key constant."""
    q, k, _ = random_qkv(2, 2, 4, 5, seed=29)
    s = ak.scores.scaled_dot(q, k)
    keys = torch.tensor([[True] * 5, [True, True, True, False, False]])
    w = ak.normalize(s + torch.zeros(2, 1, 1, 5, dtype=s.dtype).masked_fill(~keys[:, None, None], fill),
                     mechanism)
    torch.testing.assert_close(w, ak.normalize(s, mechanism, key_mask=keys), **F64)
    future = torch.ones(4, 4, dtype=torch.bool).triu(1)
    with pytest.raises(ValueError, match="causal pattern"):
        ak.normalize(s[..., :4].masked_fill(future, fill), mechanism)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_normalize_keeps_very_negative_scores_that_are_no_mask(dtype):
    """The first version of the rule above took every score <= -1e4 for a mask: a softmax row of
    [-9999.5, -10000.5, -10000.2, -10003] gave [1, 0, 0, 0], a row wholly below -1e4 gave zeros."""
    s = torch.tensor([-9999.5, -10000.5, -10000.2, -10003.0, -20000.0, -20000.5, -20001.0, -20000.2],
                     dtype=torch.float64).view(1, 1, 2, 4).to(dtype)
    torch.testing.assert_close(ak.normalize(s, "softmax"), s.softmax(-1))


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_normalize_treats_neg_inf_scores_as_masked_pairs(case):
    q, k, _ = random_qkv(2, 2, 4, 5, seed=19)
    s = ak.scores.scaled_dot(q, k)
    allowed = torch.ones(2, 2, 4, 5, dtype=torch.bool)
    allowed[0, 0, :, 2] = False  # a key column of -inf
    allowed[0, 1, 3, :] = False  # a query row of -inf
    allowed[1, :, 1, 0] = False
    gate = ak.scores.neg_l1_distance(q, k) if case.ref_mechanism == "coda" else None
    mech = case.attnkit_mechanism(ak)
    w = ak.normalize(s.masked_fill(~allowed, float("-inf")), mech, gate_scores=gate, **case.call)
    assert torch.isfinite(w).all() and torch.all(w[~allowed] == 0)
    masked = ak.normalize(s, mech, attn_mask=allowed, gate_scores=gate, **case.call)
    torch.testing.assert_close(w, masked, **F64)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "+inf"])
def test_normalize_rejects_nan_or_positive_infinite_scores(bad):
    s = torch.zeros(1, 1, 3, 3)
    s[0, 0, 1, 2] = bad
    with pytest.raises(ValueError, match="NaN or \\+inf"):
        ak.normalize(s, "dnas")


def test_normalize_coda_uses_the_given_gate_scores():
    g = torch.Generator().manual_seed(0)
    e = torch.randn(2, 2, 3, 4, generator=g, dtype=torch.float64)
    n = -torch.rand(2, 2, 3, 4, generator=g, dtype=torch.float64) * 3
    valid = torch.ones(2, 2, 3, 4, dtype=torch.bool)
    w = ak.normalize(e, ak.CoDA(gate="centered", alpha=2.0), gate_scores=n)
    torch.testing.assert_close(w, ref_coda_from_scores(e, n, valid, gate="centered", alpha=2.0), **F64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_normalize_keeps_the_scores_dtype(dtype):
    s = torch.randn(1, 2, 3, 4).to(dtype)
    assert ak.normalize(s, "dnas").dtype == dtype


@pytest.mark.parametrize("case", ONE_PER_MECHANISM)
def test_dropout_zeroes_or_rescales_weights(case):
    q, k, v = random_qkv(2, 2, 6, 7, seed=18)
    _, w = attend(case, q, k, v, return_weights=True)
    torch.manual_seed(0)
    out, wd = attend(case, q, k, v, return_weights=True, dropout_p=0.4)
    kept = wd != 0
    assert (~kept & (w != 0)).any(), "dropout 0.4 on 84 weights dropped none"
    torch.testing.assert_close(wd[kept], w[kept] / 0.6, **F64)
    torch.testing.assert_close(out, wd @ v, **F64)
    torch.testing.assert_close(attend(case, q, k, v, dropout_p=0.0), attend(case, q, k, v), **F64)


def test_config_objects_equal_names_and_options():
    q, k, v = random_qkv(2, 2, 4, 5, seed=19)
    pairs = [
        (("dnas", {}), (ak.DNAS(), {})),
        (("softmax", {}), (ak.Softmax(), {})),
        (("sinkhorn", {"sinkhorn_iters": 4}), (ak.Sinkhorn(iters=4), {})),
        (("sinkhorn", {}), (ak.Sinkhorn(iters=3), {})),
        (("hnas", {"hybrid_weight": 0.1}), (ak.Hybrid(u0=0.1), {})),
        (("coda", {}), (ak.CoDA(gate="scaled"), {})),
        (("lnas", {}), ("softmax", {})),
    ]
    for (m1, kw1), (m2, kw2) in pairs:
        torch.testing.assert_close(ak.attention(q, k, v, m1, **kw1), ak.attention(q, k, v, m2, **kw2), **F64)
    assert not torch.allclose(
        ak.attention(q, k, v, "sinkhorn", sinkhorn_iters=1), ak.attention(q, k, v, "sinkhorn")
    )


def test_efficient_backend_refuses_return_weights():
    q, k, v = random_qkv(1, 2, 3, 3)
    with pytest.raises(ValueError, match="return_weights"):
        ak.attention(q, k, v, "dnas", backend="efficient", return_weights=True)


# ---------------------------------------------------------------------------- bad input


def _qkv(B=2, H=2, Lq=3, Lk=4, D=5, Dv=5, dtype=torch.float32):
    return (torch.randn(B, H, Lq, D, dtype=dtype), torch.randn(B, H, Lk, D, dtype=dtype),
            torch.randn(B, H, Lk, Dv, dtype=dtype))


def _bad(name, fn, match):
    return pytest.param(fn, match, id=name)


Q, K, V = _qkv()
META = torch.device("meta")

BAD_ATTENTION_CALLS = [
    _bad("q-rank-3", lambda: ak.attention(Q[0], K, V), r"q has shape \(2, 3, 5\).*4-D"),
    _bad("k-rank-5", lambda: ak.attention(Q, K[None], V), r"k has shape.*4-D"),
    _bad("v-rank-2", lambda: ak.attention(Q, K, V[0, 0]), r"v has shape.*4-D"),
    _bad("q-not-tensor", lambda: ak.attention(Q.tolist(), K, V), "q must be a torch.Tensor"),
    _bad("integer-dtype", lambda: ak.attention(Q.long(), K.long(), V.long()), "floating dtype"),
    _bad("batch-mismatch", lambda: ak.attention(Q, K[:1], V[:1]), r"batch sizes differ.*B=2.*B=1"),
    _bad("head-mismatch", lambda: ak.attention(Q, K[:, :1], V[:, :1]), r"head counts differ.*H=2.*H=1"),
    _bad(
        "grouped-query-heads",
        lambda: ak.attention(Q, K[:, :1], V[:, :1]),
        r"grouped-query attention .* k\.repeat_interleave\(2, dim=1\)",
    ),
    _bad(
        "nested-q",
        lambda: ak.attention(torch.nested.nested_tensor([Q[0], Q[1, :, :3]]), K, V),
        r"q is a nested tensor; pad it \(torch\.nested\.to_padded_tensor\(q, 0\.0\)\)",
    ),
    _bad(
        "sparse-k",
        lambda: ak.attention(Q, K.to_sparse(), V),
        r"k has layout torch\.sparse_coo.*k\.to_dense\(\)",
    ),
    _bad("head-dim-mismatch", lambda: ak.attention(Q, K[..., :3], V), r"head dims differ.*D=5.*D=3"),
    _bad("key-value-length-mismatch", lambda: ak.attention(Q, K, V[:, :, :2]), r"lengths differ.*Lk=4.*2"),
    _bad("empty-sequence", lambda: ak.attention(Q[:, :, :0], K, V), "empty sequence"),
    _bad("mixed-dtypes", lambda: ak.attention(Q, K.double(), V), "share one dtype"),
    _bad("return-weights-string", lambda: ak.attention(Q, K, V, return_weights="no"), "return_weights='no'"),
    _bad("explain-return-weights-string", lambda: ak.explain_dispatch(Q, K, V, return_weights="no"),
         "return_weights='no'"),
    _bad(
        "key-mask-shape",
        lambda: ak.attention(Q, K, V, key_mask=torch.ones(2, 5, dtype=torch.bool)),
        r"key_mask has shape \(2, 5\), expected \(B, Lk\) = \(2, 4\)",
    ),
    _bad(
        "key-mask-dtype",
        lambda: ak.attention(Q, K, V, key_mask=torch.ones(2, 4)),
        r"key_mask has dtype torch.float32",
    ),
    _bad(
        "key-mask-device",
        lambda: ak.attention(Q, K, V, key_mask=torch.ones(2, 4, dtype=torch.bool, device=META)),
        "key_mask is on meta",
    ),
    _bad("key-mask-not-tensor", lambda: ak.attention(Q, K, V, key_mask=[[True] * 4] * 2), "key_mask must be"),
    _bad(
        "query-mask-shape",
        lambda: ak.attention(Q, K, V, query_mask=torch.ones(2, 4, dtype=torch.bool)),
        r"query_mask has shape \(2, 4\), expected \(B, Lq\) = \(2, 3\)",
    ),
    _bad(
        "query-mask-dtype",
        lambda: ak.attention(Q, K, V, query_mask=torch.ones(2, 3, dtype=torch.int64)),
        "query_mask has dtype torch.int64",
    ),
    _bad(
        "attn-mask-shape",
        lambda: ak.attention(Q, K, V, attn_mask=torch.ones(3, 3, dtype=torch.bool)),
        r"attn_mask has shape \(3, 3\).*broadcastable to \(B, H, Lq, Lk\) = \(2, 2, 3, 4\)",
    ),
    _bad(
        "attn-mask-rank-1",
        lambda: ak.attention(Q, K, V, attn_mask=torch.ones(4, dtype=torch.bool)),
        # (4,) broadcasts to (2, 2, 3, 4) by torch's rules: the message says 2 to 4 dimensions and the way on
        r"attn_mask has shape \(4,\); expected 2 to 4 dimensions .*per-key mask pass key_mask \(B, Lk\)",
    ),
    _bad(
        "attn-mask-batch",
        lambda: ak.attention(Q, K, V, attn_mask=torch.ones(3, 1, 3, 4, dtype=torch.bool)),
        r"attn_mask has shape \(3, 1, 3, 4\)",
    ),
    _bad(
        "attn-mask-int-dtype",
        lambda: ak.attention(Q, K, V, attn_mask=torch.ones(3, 4, dtype=torch.int32)),
        "attn_mask has dtype torch.int32",
    ),
    _bad(
        "attn-mask-device",
        lambda: ak.attention(Q, K, V, attn_mask=torch.ones(3, 4, dtype=torch.bool, device=META)),
        "attn_mask is on meta",
    ),
    _bad(
        "attn-mask-nan",
        lambda: ak.attention(Q, K, V, attn_mask=torch.full((3, 4), float("nan"))),
        r"NaN or \+inf",
    ),
    _bad(
        "attn-mask-pos-inf",
        lambda: ak.attention(Q, K, V, attn_mask=torch.full((3, 4), float("inf"))),
        r"\+inf",
    ),
    _bad("causal-not-bool", lambda: ak.attention(Q, K, V, causal=1), "causal must be True or False"),
    # checked before the mechanism's causal refusal: "False" read as causal, a tensor of two flags crashed
    _bad("causal-string-dnas", lambda: ak.attention(Q, K, V, "dnas", causal="False"),
         "causal must be True or False"),
    _bad("causal-tensor-dnas", lambda: ak.attention(Q, K, V, "dnas", causal=torch.tensor([True, False])),
         "causal must be True or False"),
    _bad("causal-string-normalize", lambda: ak.normalize(torch.zeros(1, 1, 3, 4), "sinkhorn", causal="False"),
         "causal must be True or False"),
    _bad(
        "hybrid-weight-above-1",
        lambda: ak.attention(Q, K, V, "hnas", hybrid_weight=1.5),
        r"1.5 is outside \[0, 1\]",
    ),
    _bad(
        "hybrid-weight-negative",
        lambda: ak.attention(Q, K, V, "hnas", hybrid_weight=-0.1),
        r"outside \[0, 1\]",
    ),
    _bad(
        "hybrid-weight-nan",
        lambda: ak.attention(Q, K, V, "hnas", hybrid_weight=float("nan")),
        r"outside \[0, 1\]",
    ),
    _bad(
        "hybrid-weight-tensor-outside",
        lambda: ak.attention(Q, K, V, "hnas", hybrid_weight=torch.tensor([0.5, 1.2])),
        r"outside \[0, 1\].*max 1.2",
    ),
    _bad(
        "hybrid-weight-tensor-shape",
        lambda: ak.attention(Q, K, V, "hnas", hybrid_weight=torch.full((3,), 0.5)),
        r"hybrid_weight has shape \(3,\).*\(H,\) = \(2,\)",
    ),
    _bad(
        "hybrid-weight-tensor-4d-shape",
        lambda: ak.attention(Q, K, V, "hnas", hybrid_weight=torch.full((1, 2, 3, 1), 0.5)),
        r"hybrid_weight has shape \(1, 2, 3, 1\)",
    ),
    _bad(
        "hybrid-weight-int-tensor",
        lambda: ak.attention(Q, K, V, "hnas", hybrid_weight=torch.tensor(1)),
        "hybrid_weight has dtype torch.int64",
    ),
    _bad("hybrid-weight-bool", lambda: ak.attention(Q, K, V, "hnas", hybrid_weight=True), "got bool"),
    _bad("hybrid-weight-string", lambda: ak.attention(Q, K, V, "hnas", hybrid_weight="0.5"), "got str"),
    _bad(
        "sinkhorn-negative",
        lambda: ak.attention(Q, K, V, "sinkhorn", sinkhorn_iters=-1),
        r"iters=-1.*integer in \[0, 1000\]",
    ),
    _bad(
        "sinkhorn-float",
        lambda: ak.attention(Q, K, V, "sinkhorn", sinkhorn_iters=2.5),
        r"iters=2.5.*integer in \[0, 1000\]",
    ),
    _bad("sinkhorn-bool", lambda: ak.attention(Q, K, V, "sinkhorn", sinkhorn_iters=True), r"iters=True"),
    _bad(
        "sinkhorn-contradicts-config",
        lambda: ak.attention(Q, K, V, ak.Sinkhorn(iters=2), sinkhorn_iters=5),
        r"sinkhorn_iters=5 contradicts.*iters=2",
    ),
    _bad(
        "unknown-mechanism",
        lambda: ak.attention(Q, K, V, "flash"),
        r"unknown attention mechanism 'flash'.*'softmax', 'dnas', 'hnas', 'sinkhorn', 'coda'",
    ),
    _bad("mechanism-wrong-type", lambda: ak.attention(Q, K, V, 3), "mechanism must be a name"),
    _bad(
        "unknown-backend",
        lambda: ak.attention(Q, K, V, backend="cuda"),
        r"unknown backend 'cuda'.*'reference'",
    ),
    _bad(
        "hybrid-weight-for-dnas",
        lambda: ak.attention(Q, K, V, "dnas", hybrid_weight=0.5),
        r"hybrid_weight is only used by mechanism 'hnas', got mechanism 'dnas'",
    ),
    _bad(
        "hybrid-weight-for-coda",
        lambda: ak.attention(Q, K, V, ak.CoDA(), hybrid_weight=0.5),
        r"hybrid_weight is only used.*'coda'",
    ),
    _bad(
        "sinkhorn-iters-for-softmax",
        lambda: ak.attention(Q, K, V, "softmax", sinkhorn_iters=2),
        r"sinkhorn_iters is only used by mechanism 'sinkhorn', got mechanism 'softmax'",
    ),
    _bad(
        "sinkhorn-iters-for-hnas",
        lambda: ak.attention(Q, K, V, "hnas", sinkhorn_iters=2),
        "sinkhorn_iters is only",
    ),
    _bad("scale-zero", lambda: ak.attention(Q, K, V, scale=0.0), r"scale=0.0; expected a finite number > 0"),
    _bad("scale-negative", lambda: ak.attention(Q, K, V, scale=-1.0), r"scale=-1.0"),
    _bad("scale-nan", lambda: ak.attention(Q, K, V, scale=float("nan")), r"scale=nan"),
    _bad("scale-string", lambda: ak.attention(Q, K, V, scale="0.1"), r"scale='0.1'"),
    _bad(
        "dropout-one",
        lambda: ak.attention(Q, K, V, dropout_p=1.0),
        r"dropout_p=1.0; expected a number in \[0, 1\)",
    ),
    _bad("dropout-negative", lambda: ak.attention(Q, K, V, dropout_p=-0.1), r"dropout_p=-0.1"),
    _bad("dropout-string", lambda: ak.attention(Q, K, V, dropout_p="0.1"), r"dropout_p='0.1'"),
    _bad("coda-float-attn-mask", lambda: ak.attention(Q, K, V, "coda", attn_mask=torch.zeros(3, 4)), "CoDA"),
    _bad("causal-dnas", lambda: ak.attention(Q, K, V, "dnas", causal=True), r"'dnas'.*leak"),
    _bad("causal-hnas", lambda: ak.attention(Q, K, V, "hnas", causal=True), r"'hnas'.*leak"),
    _bad("causal-sinkhorn", lambda: ak.attention(Q, K, V, "sinkhorn", causal=True), r"'sinkhorn'.*leak"),
    _bad(
        "causal-coda-centered", lambda: ak.attention(Q, K, V, ak.CoDA(gate="centered"), causal=True), "leak"
    ),
    _bad("causal-coda-center-e", lambda: ak.attention(Q, K, V, ak.CoDA(center_e=True), causal=True), "leak"),
]

S = torch.randn(2, 2, 3, 4)

BAD_NORMALIZE_CALLS = [
    _bad("coda-without-gate-scores", lambda: ak.normalize(S, "coda"), "needs gate_scores"),
    _bad(
        "coda-gate-scores-shape",
        lambda: ak.normalize(S, "coda", gate_scores=S[..., :3]),
        r"gate_scores has shape \(2, 2, 3, 3\), expected the shape of scores \(2, 2, 3, 4\)",
    ),
    _bad(
        "coda-gate-scores-not-tensor",
        lambda: ak.normalize(S, "coda", gate_scores=1.0),
        "gate_scores has shape float",
    ),
    _bad(
        "coda-gate-scores-int", lambda: ak.normalize(S, "coda", gate_scores=S.long()), "gate_scores has dtype"
    ),
    _bad(
        "coda-gate-scores-device",
        lambda: ak.normalize(S, "coda", gate_scores=S.to(META)),
        "gate_scores is on meta",
    ),
    _bad(
        "gate-scores-for-softmax",
        lambda: ak.normalize(S, "softmax", gate_scores=S),
        "gate_scores is only used by mechanism 'coda'",
    ),
    _bad(
        "scores-rank-3",
        lambda: ak.normalize(S[0], "dnas"),
        r"scores must be a floating tensor of shape \(B, H, Lq, Lk\)",
    ),
    _bad("scores-int", lambda: ak.normalize(S.long(), "dnas"), "scores must be a floating tensor"),
    _bad("scores-not-tensor", lambda: ak.normalize([[1.0]], "dnas"), "got list"),
    _bad(
        "key-mask-shape",
        lambda: ak.normalize(S, "dnas", key_mask=torch.ones(2, 3, dtype=torch.bool)),
        r"key_mask has shape \(2, 3\), expected \(B, Lk\) = \(2, 4\)",
    ),
    _bad("hybrid-weight-outside", lambda: ak.normalize(S, "hnas", hybrid_weight=2.0), r"outside \[0, 1\]"),
    _bad("sinkhorn-negative", lambda: ak.normalize(S, "sinkhorn", sinkhorn_iters=-3), r"in \[0, 1000\]"),
    _bad("causal-dnas", lambda: ak.normalize(S, "dnas", causal=True), "leak"),
    _bad("unknown-mechanism", lambda: ak.normalize(S, "entmax"), "unknown attention mechanism 'entmax'"),
]


@pytest.mark.parametrize("call,match", BAD_ATTENTION_CALLS)
def test_bad_attention_input_raises_value_error_naming_the_problem(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("call,match", BAD_NORMALIZE_CALLS)
def test_bad_normalize_input_raises_value_error_naming_the_problem(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_default_scale_is_inverse_sqrt_head_dim():
    q, k, v = random_qkv(1, 2, 3, 4, D=9, seed=20)
    torch.testing.assert_close(ak.attention(q, k, v), ak.attention(q, k, v, scale=1 / math.sqrt(9)), **F64)


def test_numpy_scalars_are_numbers_for_scale_iterations_and_hybrid_weight():
    np = pytest.importorskip("numpy")
    q, k, v = random_qkv(1, 2, 3, 4, seed=20)
    for mechanism, options in (
        ("softmax", dict(scale=np.float32(0.5))),
        ("sinkhorn", dict(sinkhorn_iters=np.int64(2), scale=np.float64(0.5))),
        ("hnas", dict(hybrid_weight=np.float32(0.25), scale=0.5)),
    ):
        plain = {key: np.asarray(value).item() for key, value in options.items()}
        torch.testing.assert_close(
            ak.attention(q, k, v, mechanism, **options), ak.attention(q, k, v, mechanism, **plain), **F64
        )


@pytest.mark.parametrize("mechanism", ["softmax", "dnas", "hnas", "sinkhorn", "coda"])
@pytest.mark.parametrize("backend", ["reference", "efficient"])
def test_every_route_computes_in_the_autocast_dtype(mechanism, backend):
    # the C++ kernels, which autocast does not see, returned float32 where SDPA and the reference returned
    # bfloat16 (errors 3e4 times apart for one call)
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 16, 8) for _ in range(3))
    key_mask = torch.ones(2, 16, dtype=torch.bool)
    key_mask[1, -5:] = False
    bias = None if mechanism == "coda" else torch.zeros(16, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ak.attention(q, k, v, mechanism, key_mask=key_mask, attn_mask=bias, backend=backend)
    assert out.dtype == torch.bfloat16
    expected = ak.attention(q.double(), k.double(), v.double(), mechanism, key_mask=key_mask,
                            backend="reference")
    assert (out.double() - expected).abs().max() < 0.05
    with torch.autocast("cpu", dtype=torch.bfloat16):  # float64 stays float64, as autocast leaves it
        out = ak.attention(q.double(), k.double(), v.double(), mechanism, backend=backend)
    assert out.dtype == torch.float64


def test_autocast_casts_half_inputs_as_it_does_for_sdpa():
    q = torch.randn(1, 2, 8, 4)
    k, v = torch.randn(1, 2, 8, 4, dtype=torch.float16), torch.randn(1, 2, 8, 4, dtype=torch.float16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.nn.functional.scaled_dot_product_attention(q, k, v).dtype == torch.bfloat16
        assert ak.attention(q, k, v, "dnas").dtype == torch.bfloat16  # "must share one dtype" before


@pytest.mark.parametrize("mechanism", ["softmax", "dnas", "hnas", "sinkhorn", "coda"])
@pytest.mark.parametrize("route", ["reference", "efficient", "blockwise"])
def test_a_nan_gradient_at_a_padded_query_does_not_reach_the_real_tokens(mechanism, route):
    # a padded query's output is the constant 0, and o / o.norm() there is NaN: 0 * NaN in P^T dO made dv
    # (reference) or every gradient of the batch element (blockwise, the Triton kernels) NaN
    if route == "blockwise" and mechanism == "coda":
        pytest.skip("CoDA takes no float attn_mask; its bool one goes to its own kernels")
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 2, 6, 4, requires_grad=True) for _ in range(3))
    query_mask = torch.ones(2, 6, dtype=torch.bool)
    query_mask[0, -2:] = False
    key_mask = torch.ones(2, 6, dtype=torch.bool)
    key_mask[1, -3:] = False
    general = torch.ones(6, 6, dtype=torch.bool)
    general[0, 5] = False  # an all-True attn_mask counts as none: one hidden pair keeps the blockwise route
    extra = {"attn_mask": general} if route == "blockwise" else {}
    backend = "efficient" if route == "blockwise" else route
    out = ak.attention(q, k, v, mechanism, key_mask=key_mask, query_mask=query_mask, backend=backend, **extra)
    grad = torch.randn_like(out)
    grad[0, :, -1] = float("nan")  # only where the query is padding
    for g in torch.autograd.grad(out, (q, k, v), grad):
        assert torch.isfinite(g).all()


@pytest.mark.parametrize("case", ["attn_mask_row", "causal_left_padding", "vmap"])
def test_a_nan_gradient_at_a_row_without_keys_does_not_reach_the_real_tokens(case):
    # rows emptied by attn_mask or by causal with left padding were not stopped, and under vmap (where
    # out.requires_grad is False) the stop was skipped altogether
    torch.manual_seed(2)
    q, k, v = (torch.randn(2, 2, 6, 4, requires_grad=True) for _ in range(3))
    grad = torch.randn(2, 2, 6, 4)
    if case == "attn_mask_row":
        pair = torch.ones(6, 6, dtype=torch.bool)
        pair[3] = False  # query 3 sees no key
        call = lambda q, k, v: ak.attention(q, k, v, "dnas", attn_mask=pair)  # noqa: E731
        grad[:, :, 3] = float("nan")
    elif case == "causal_left_padding":
        key_mask = torch.ones(2, 6, dtype=torch.bool)
        key_mask[0, :2] = False  # left padding: queries 0 and 1 of example 0 see no key under causal
        call = lambda q, k, v: ak.attention(q, k, v, "softmax", key_mask=key_mask, causal=True)  # noqa: E731
        grad[0, :, :2] = float("nan")
    else:
        query_mask = torch.ones(2, 6, dtype=torch.bool)
        query_mask[0, -2:] = False

        def one(q, k, v, m):
            return ak.attention(q[None], k[None], v[None], "dnas", key_mask=m[None], query_mask=m[None])[0]

        call = lambda q, k, v: torch.vmap(one)(q, k, v, query_mask)  # noqa: E731
        grad[0, :, -2:] = float("nan")
    out = call(q, k, v)
    assert all(torch.isfinite(g).all() for g in torch.autograd.grad(out, (q, k, v), grad))


QUERY_NORMALIZED = ["dnas", "hnas", "sinkhorn"]


@pytest.mark.parametrize("fill", [-1e4, -1e6])
@pytest.mark.parametrize("mechanism", QUERY_NORMALIZED)
def test_normalize_refuses_a_causal_mask_added_to_the_scores_with_a_finite_fill(mechanism, fill):
    # scores.masked_fill(future, -1e4) leaked the last query into rows 0..4 (by 0.115) where
    # attention(attn_mask=the same mask) refused: a score 5000 or more below its row's largest is hidden
    q, k, _ = random_qkv(1, 1, 6, 6, seed=31)
    s = ak.scores.scaled_dot(q, k)
    future = torch.ones(6, 6, dtype=torch.bool).triu(1)
    with pytest.raises(ValueError, match="causal pattern"):
        ak.normalize(s.masked_fill(future, fill), mechanism)
    with pytest.raises(ValueError, match="causal pattern"):
        ak.attention(q, k, k, mechanism, attn_mask=torch.zeros(6, 6, dtype=s.dtype).masked_fill(future, fill))
    with pytest.raises(ValueError, match="causal pattern"):  # bottom-right aligned (Lq < Lk)
        ak.normalize(s[..., 2:, :].masked_fill(future[2:], fill), mechanism)


def _dnas_reference(s: torch.Tensor) -> torch.Tensor:
    """float64 DNAS by hand: a softmax over queries, then each row normalized to sum to 1."""
    w = torch.softmax(s, dim=-2)  # (B, H, Lq, Lk)
    return w / w.sum(-1, keepdim=True)


@pytest.mark.parametrize("mechanism", ["dnas", "sinkhorn"])
def test_normalize_keeps_the_weight_of_a_real_key_far_below_every_query(mechanism):
    # a key 6000 below the others is a score, not a mask: the float64 reference and attention give its column
    # [7.6e-5, 0.49, 1.5e-9] under dnas; normalize gave it 0
    s = torch.tensor([[0.0, 1.0, 2.0, -6000.0],
                      [1.0, 0.0, 3.0, -5990.0],
                      [2.0, 2.0, 0.0, -6010.0]], dtype=torch.float64)[None, None]  # (1, 1, Lq, Lk)
    w = ak.normalize(s, mechanism)
    q, eye = s * 2.0, torch.eye(4, dtype=torch.float64)[None, None]  # scaled_dot(q, eye) == s for D = 4
    _, w_att = ak.attention(q, eye, eye, mechanism, return_weights=True)
    torch.testing.assert_close(w, w_att, **F64)
    if mechanism == "dnas":
        torch.testing.assert_close(w, _dnas_reference(s), **F64)
        torch.testing.assert_close(w[0, 0, :, 3], torch.tensor([7.6389e-5, 0.490150, 1.50927e-9],
                                                                dtype=torch.float64), rtol=1e-4, atol=0)


@pytest.mark.parametrize("mechanism", QUERY_NORMALIZED)
def test_normalize_of_bidirectional_alibi_over_a_long_span_equals_attention_with_it_as_attn_mask(mechanism):
    # ALiBi over more than 5000 of bias within a row: normalize dropped the far keys (0.167 of each row)
    torch.manual_seed(35)
    Lq, Lk, D = 3, 3000, 4
    q, k, v = (torch.randn(1, 1, n, D, dtype=torch.float64) for n in (Lq, Lk, Lk))
    i = torch.arange(Lq, dtype=torch.float64)[:, None] + (Lk - Lq)  # the last Lq positions (bottom-right)
    alibi = -2.0 * (i - torch.arange(Lk, dtype=torch.float64)[None]).abs()  # (Lq, Lk), spans ~6000
    s = ak.scores.scaled_dot(q, k)  # (1, 1, Lq, Lk)
    _, w_att = ak.attention(q, k, v, mechanism, attn_mask=alibi, return_weights=True)
    w = ak.normalize(s + alibi, mechanism)
    torch.testing.assert_close(w, w_att, **F64)
    assert float(w[..., :Lk // 2].sum()) > 0.1  # the far keys keep their weight


@pytest.mark.parametrize("mechanism", QUERY_NORMALIZED)
def test_normalize_accepts_sharp_mask_free_scores_as_attention_does(mechanism):
    # a sharp look-back head (later keys ~150 lower, no mask anywhere) was refused as a causal pattern
    torch.manual_seed(36)
    L = 6
    s = (torch.randn(L, L, dtype=torch.float64) * 3 - 150 * torch.ones(L, L).triu(1).double())[None, None]
    q, eye = s * L ** 0.5, torch.eye(L, dtype=torch.float64)[None, None]  # scaled_dot(q, eye) == s
    _, w_att = ak.attention(q, eye, eye, mechanism, return_weights=True)
    torch.testing.assert_close(ak.normalize(s, mechanism), w_att, **F64)


@pytest.mark.parametrize("fill", [-1000.0, -1e4])
def test_normalize_of_softmax_stays_torch_softmax_with_a_finite_mask_in_the_scores(fill):
    q, k, _ = random_qkv(1, 2, 6, 6, seed=33)
    s = ak.scores.scaled_dot(q, k).masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), fill)
    assert torch.equal(ak.normalize(s, "softmax"), s.softmax(-1))
    assert torch.equal(ak.normalize(s, ak.Sinkhorn(iters=0)), s.softmax(-1))


def test_sinkhorn_with_zero_iterations_runs_causally_as_softmax():
    # Sinkhorn(iters=0) is softmax (no column normalization), so it cannot leak: causal=True was refused
    q, k, v = random_qkv(2, 2, 5, 5, seed=34)
    for mechanism in (ak.Sinkhorn(iters=0), "sinkhorn"):
        kwargs = {} if not isinstance(mechanism, str) else {"sinkhorn_iters": 0}
        torch.testing.assert_close(ak.attention(q, k, v, mechanism, causal=True, **kwargs),
                                   ak.attention(q, k, v, "softmax", causal=True), **F64)
        torch.testing.assert_close(ak.normalize(ak.scores.scaled_dot(q, k), mechanism, causal=True, **kwargs),
                                   ak.normalize(ak.scores.scaled_dot(q, k), "softmax", causal=True), **F64)
    with pytest.raises(ValueError, match="leak"):
        ak.attention(q, k, v, ak.Sinkhorn(iters=1), causal=True)


@pytest.mark.parametrize("mechanism", ["softmax", "dnas", "hnas", "sinkhorn"])
@pytest.mark.parametrize("backend", ["reference", "efficient"])
def test_under_autocast_every_route_computes_as_for_inputs_given_in_its_dtype(mechanism, backend):
    """Autocast recast the reference's and the block sweeps' float32 score products to bfloat16: softmax's
    output was 0.175 off a float64 reference under autocast, 0.012 for the same inputs given in bfloat16."""
    torch.manual_seed(0)
    q, k = (torch.randn(2, 2, 16, 64) * 3 for _ in range(2))
    v = torch.randn(2, 2, 16, 64)
    mask = torch.rand(16, 16) > 0.2
    explicit = ak.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mechanism, attn_mask=mask,
                            backend=backend)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = ak.attention(q, k, v, mechanism, attn_mask=mask, backend=backend)
        weights = ak.attention(q, k, v, mechanism, attn_mask=mask, return_weights=True)[1]
    assert under.dtype == torch.bfloat16
    torch.testing.assert_close(under, explicit, rtol=0, atol=0)
    expected = ak.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mechanism, attn_mask=mask,
                            return_weights=True)[1]
    torch.testing.assert_close(weights, expected, rtol=0, atol=0)
