"""The fused CoDA CPU kernel (kernels/coda_cpp.py, csrc/coda_cpu.cpp): outputs and gradients of q, k, v
against the float64 reference of tests/_reference.py for every variant and mask, gradcheck, the replayed
dropout mask, the forward-only path and the route the dispatcher reports."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.kernels import cpu_ext, dispatch
from tests._reference import ref_attention

pytestmark = pytest.mark.skipif(not cpu_ext.load(warn=False), reason="C++ CPU kernels not built")

VARIANTS = {
    "default": {},
    "sigmoid-gate": dict(gate="sigmoid"),
    "centered": dict(gate="centered"),
    "center_e-alpha-beta": dict(center_e=True, alpha=1.5, beta=0.7),
    "sigmoid-tanh": dict(e_activation="sigmoid", n_activation="tanh"),
    "arctan": dict(e_activation="arctan", n_activation="arctan"),
    "algebraic-centered-both": dict(e_activation="algebraic", n_activation="algebraic", gate="centered",
                                    center_e=True),
}


def _inputs(B, H, Lq, Lk, D, Dv, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, H, Lq, D), (B, H, Lk, D), (B, H, Lk, Dv))
    return [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]


def _masks(kind, B, H, Lq, Lk):
    """key_mask, query_mask, attn_mask, causal for one mask kind (True = real / may attend)."""
    g = torch.Generator().manual_seed(5)
    km = qm = am = None
    causal = False
    if kind in ("key", "key+query", "empty_rows"):
        km = torch.rand(B, Lk, generator=g) > 0.3
        km[0] = True
    if kind in ("query", "key+query", "empty_rows"):
        qm = torch.rand(B, Lq, generator=g) > 0.3
    if kind == "empty_rows":
        km[-1] = False  # every key of the last element masked: its rows give 0
    if kind in ("causal", "causal+key+attn"):
        causal = True
    if kind in ("attn", "causal+key+attn"):
        am = torch.rand(B, 1, Lq, Lk, generator=g) > 0.4  # broadcast over heads
        am[0, 0, 1] = False  # one fully masked row
    if kind == "causal+key+attn":
        km = torch.rand(B, Lk, generator=g) > 0.2
    return km, qm, am, causal


def _compare(config, coda_kwargs, shape, kind, dtype=torch.float64, atol=1e-10):
    B, H, Lq, Lk, D, Dv = shape
    q, k, v = _inputs(B, H, Lq, Lk, D, Dv)
    km, qm, am, causal = _masks(kind, B, H, Lq, Lk)
    masks = dict(key_mask=km, query_mask=qm, attn_mask=am, causal=causal)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref, _ = ref_attention(*ref_in, "coda", coda=coda_kwargs, **masks)
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    ref.backward(grad)
    x = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    assert ak.explain_dispatch(*x, config, backend="efficient", **masks).route == "coda_cpp"
    out = ak.attention(*x, config, backend="efficient", **masks)
    out.backward(grad.to(dtype))
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=0)
    for name, a, b in zip("qkv", x, ref_in):
        torch.testing.assert_close(a.grad.double(), b.grad, atol=atol, rtol=0, msg=lambda m: f"d{name}: {m}")


# 70 queries x 150 keys: two query chunks and two key strips, neither a multiple of the tiles
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_reference_every_variant(variant):
    kwargs = VARIANTS[variant]
    _compare(ak.CoDA(**kwargs), kwargs, (2, 2, 70, 150, 12, 5), "key+query")


@pytest.mark.parametrize("variant", ["default", "centered", "algebraic-centered-both"])
def test_matches_reference_float32(variant):
    kwargs = VARIANTS[variant]
    _compare(ak.CoDA(**kwargs), kwargs, (2, 2, 70, 150, 12, 5), "key+query", dtype=torch.float32, atol=5e-5)


@pytest.mark.parametrize(
    "kind", ["none", "key", "query", "key+query", "empty_rows", "causal", "attn", "causal+key+attn"]
)
@pytest.mark.parametrize("shape", [(2, 2, 70, 150, 12, 5), (1, 3, 137, 33, 7, 9)], ids=["wide", "tall"])
def test_masks_match_reference(kind, shape):
    _compare(ak.CoDA(), {}, shape, kind)


def test_centered_with_attn_mask_matches_reference():
    kwargs = VARIANTS["algebraic-centered-both"]
    _compare(ak.CoDA(**kwargs), kwargs, (2, 2, 70, 150, 12, 5), "attn")


def test_gradcheck_float64():
    q, k, v = (t.requires_grad_() for t in _inputs(1, 2, 9, 11, 5, 3))
    km = torch.tensor([[True] * 8 + [False] * 3])
    for config in (ak.CoDA(), ak.CoDA(gate="centered", center_e=True, n_activation="arctan")):
        def fn(q, k, v, config=config):
            return ak.attention(q, k, v, config, key_mask=km, backend="efficient")

        assert torch.autograd.gradcheck(fn, (q, k, v))


def test_self_attention_with_shared_q_and_k_matches_reference():
    """q is k (exact ties q_id == k_jd on the diagonal): the gradient of the shared tensor is exact."""
    x, _, v = _inputs(1, 2, 40, 40, 8, 4)
    x1, v1 = x.clone().requires_grad_(), v.clone().requires_grad_()
    out = ak.attention(x1, x1, v1, "coda", backend="efficient")
    x2, v2 = x.clone().requires_grad_(), v.clone().requires_grad_()
    ref, _ = ref_attention(x2, x2, v2, "coda")
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, atol=1e-10, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_computed_in_float32(dtype):
    q, k, v = _inputs(2, 2, 33, 47, 8, 4)
    out = ak.attention(q.to(dtype), k.to(dtype), v.to(dtype), "coda", backend="efficient")
    ref, _ = ref_attention(q.to(dtype), k.to(dtype), v.to(dtype), "coda")
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kind", ["none", "key+query", "causal+key+attn"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_inference_output_is_bit_identical_to_the_training_forward(kind, dropout_p):
    q, k, v = (t.float() for t in _inputs(2, 2, 70, 150, 12, 5))
    km, qm, am, causal = _masks(kind, 2, 2, 70, 150)
    masks = dict(key_mask=km, query_mask=qm, attn_mask=am, causal=causal, dropout_p=dropout_p)
    torch.manual_seed(3)
    with torch.no_grad():
        inference = ak.attention(q, k, v, "coda", backend="efficient", **masks)
    torch.manual_seed(3)
    training = ak.attention(q.requires_grad_(), k.requires_grad_(), v, "coda", backend="efficient", **masks)
    assert training.requires_grad and not inference.requires_grad
    assert torch.equal(training.detach(), inference)


def _dropped_weights(p, seed, **masks):
    """With v = I (Dv = Lk) the output is the dropped weight matrix itself."""
    q, k, _ = _inputs(1, 2, 50, 140, 6, 1)
    v = torch.eye(140, dtype=torch.float64).expand(1, 2, 140, 140)
    torch.manual_seed(seed)
    return ak.attention(q, k, v, "coda", backend="efficient", dropout_p=p, **masks)


def test_dropout_keeps_a_fraction_1_minus_p_scaled_by_1_over_1_minus_p():
    p = 0.25
    full = _dropped_weights(0.0, 0)
    dropped = _dropped_weights(p, 0)
    kept = dropped != 0
    assert abs(kept.double().mean().item() - (1 - p)) < 0.02
    torch.testing.assert_close(dropped[kept], full[kept] / (1 - p), atol=1e-12, rtol=0)
    assert torch.equal(_dropped_weights(p, 0), dropped)  # same seed, same mask
    assert not torch.equal(_dropped_weights(p, 1), dropped)


def test_dropout_backward_replays_the_mask():
    """gradcheck under a fixed seed: the backward pass must use the forward's keep mask."""
    q, k, v = (t.requires_grad_() for t in _inputs(1, 2, 9, 20, 5, 3))
    km = torch.tensor([[True] * 17 + [False] * 3])

    def fn(q, k, v):
        torch.manual_seed(4)
        config = ak.CoDA(gate="centered")
        return ak.attention(q, k, v, config, key_mask=km, dropout_p=0.4, backend="efficient")

    assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_auto_takes_the_fused_kernel_at_every_size(dropout_p):
    for L in (4, 128):
        q, k, v = (t.float() for t in _inputs(2, 2, L, L, 8, 8))
        plan = ak.explain_dispatch(q, k, v, "coda", dropout_p=dropout_p, causal=True)
        assert plan.route == "coda_cpp", plan


def test_plan_falls_back_to_blockwise_when_the_kernel_is_unavailable(monkeypatch):
    monkeypatch.setattr(dispatch, "coda_cpp_available", lambda q: False)
    q, k, v = _inputs(1, 1, 8, 8, 4, 4)
    plan = ak.explain_dispatch(q, k, v, "coda", backend="efficient")
    assert plan.route == "coda_blockwise"
    assert "not coda_cpp" in plan.reason
    with pytest.raises(ValueError, match="dropout_p"):
        ak.explain_dispatch(q, k, v, "coda", backend="efficient", dropout_p=0.1)


@pytest.mark.parametrize("offset", [0.0, 300.0])
def test_float32_error_is_at_most_a_small_multiple_of_the_eager_error(offset):
    """q and k sharing a large offset (the L1 pass works on vectors shifted by the mean key, so its sums do
    not grow with the offset): error against float64 within 4x that of the materialized float32 path."""
    q, k, v = _inputs(1, 2, 64, 96, 32, 8)
    q, k = q + offset, k + offset
    ref = ak.attention(q, k, v, "coda", backend="reference")  # float64 (the plain one overflows its tanh)
    x = [t.float() for t in (q, k, v)]
    fused = ak.attention(*x, "coda", backend="efficient")
    eager = ak.attention(*x, "coda", backend="reference")
    eager_err = (eager.double() - ref).abs().max().item()
    assert (fused.double() - ref).abs().max().item() <= 4 * eager_err + 1e-7


@pytest.mark.parametrize("gap", [5e-6, 2e-5])
def test_gradient_sign_of_close_coordinates_survives_far_keys(gap):
    """Far keys move the mean key to about -750: coordinates 5e-6 apart (float32 resolves 1e-10 at 1e-3)
    rounded to one value after the shift, and the backward took the tie's +1 where sign(q - k) = -1, which
    reversed the sign of dq and dk (+0.278 -> -0.278)."""
    q = torch.tensor([0.001, 1.0]).view(1, 1, 1, 2)
    k = torch.tensor([[0.001 + gap, 2.0]] + [[-1000.0, -1000.0]] * 3).view(1, 1, 4, 2)
    v = torch.ones(1, 1, 4, 1)
    grads = {}
    for dtype, backend in ((torch.float64, "reference"), (torch.float32, "efficient")):
        qq, kk, vv = (t.to(dtype).requires_grad_(True) for t in (q, k, v))
        ak.attention(qq, kk, vv, "coda", backend=backend).sum().backward()
        grads[dtype] = (qq.grad.double(), kk.grad.double())
    for fused, exact in zip(grads[torch.float32], grads[torch.float64]):
        torch.testing.assert_close(fused, exact, rtol=1e-5, atol=1e-6)


# One head of 300 queries: three query chunks (128 + 128 + 44 rows) that the threads share, so the head is cut
# between threads and its dK, dV and mean gradients are the sum of the threads' parts.
# (The centred variants reject causal masks, so they take a pair mask instead.)
@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize(
    "variant, kind",
    [("default", "none"), ("default", "key+query"), ("default", "causal+key+attn"),
     ("algebraic-centered-both", "key+query"), ("algebraic-centered-both", "attn")],
)
def test_one_head_cut_between_threads_matches_reference(variant, kind, threads, num_threads):
    num_threads(threads)
    kwargs = VARIANTS[variant]
    _compare(ak.CoDA(**kwargs), kwargs, (1, 1, 300, 170, 12, 5), kind)


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_results_agree_over_thread_counts_and_repeat_bit_for_bit(dropout_p, num_threads):
    """However the chunks are cut, the outputs and gradients agree to rounding (the BLAS may round differently
    under another thread count), and a thread count repeats its own bits."""
    q, k, v = (t.float() for t in _inputs(2, 3, 300, 170, 12, 5))
    km, qm, am, causal = _masks("key+query", 2, 3, 300, 170)
    config = ak.CoDA(gate="centered", center_e=True)

    def run(threads):
        num_threads(threads)
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        torch.manual_seed(11)
        out = ak.attention(*x, config, key_mask=km, query_mask=qm, dropout_p=dropout_p, backend="efficient")
        out.backward(torch.ones_like(out))
        return [out.detach()] + [t.grad for t in x]

    one = run(1)
    for threads in (2, 3, 4, 5):
        results = run(threads)
        for a, b in zip(results, one):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        for a, b in zip(run(threads), results):
            assert torch.equal(a, b), threads
