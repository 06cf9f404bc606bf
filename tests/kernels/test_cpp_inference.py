"""The forward-only entry of the C++ kernels (``potentials_inference``, taken when no input needs a gradient):
bit-identical to the training forward, equal to the float64 reference with masks, and the HNAS forward's
shared exponentials (kernels/cpp_potentials.py, csrc/potentials_cpu.cpp) with rows far below their chunk."""

from __future__ import annotations

import pytest
import torch

from attnkit.kernels import cpu_ext
from attnkit.kernels import cpp_potentials
from attnkit.kernels.cpp_potentials import fused_cpu_attention
from tests._reference import ref_attention

pytestmark = [
    pytest.mark.skipif(not cpu_ext.load(warn=False), reason="C++ CPU kernels not built"),
    pytest.mark.usefixtures("query_chunks_of_256"),  # inputs of a few hundred queries span several chunks
]

ITERS = {"softmax": 0, "dnas": 1, "hnas": 1, "sinkhorn3": 3}
REF = {"softmax": ("softmax", {}), "dnas": ("dnas", {}), "hnas": ("hnas", {"u": 0.3}),
       "sinkhorn3": ("sinkhorn", {"iters": 3})}


def _inputs(B, H, Lq, Lk, D, Dv, dtype, seed=0, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, H, Lq, D), (B, H, Lk, D), (B, H, Lk, Dv))
    return [(spread * torch.randn(s, generator=g, dtype=torch.float64)).to(dtype) for s in shapes]


def _masks(kind, B, Lq, Lk):
    """padding (left and right), a batch element whose queries are all masked, or none."""
    if kind == "none":
        return None, None
    g = torch.Generator().manual_seed(3)
    km = torch.rand(B, Lk, generator=g) > 0.3
    qm = torch.rand(B, Lq, generator=g) > 0.2
    km[0], qm[0] = True, True
    km[-1, : Lk // 2] = False
    if kind == "empty_rows":
        qm[-1] = False  # every query of the last element masked: zero output
    return km, qm


def _call(name, q, k, v, km, qm, dropout_p=0.0):
    u = torch.tensor(0.3, dtype=q.dtype) if name == "hnas" else None
    return fused_cpu_attention(q, k, v, key_mask=km, query_mask=qm, scale=q.shape[-1] ** -0.5,
                               iters=ITERS[name], u=u, dropout_p=dropout_p)


@pytest.mark.parametrize("name", list(ITERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("masks", ["none", "padding", "empty_rows"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_inference_output_is_bit_identical_to_the_training_forward(name, dtype, masks, dropout_p):
    """600 queries (three chunks of 256) x 300 keys (three strips of 128), rectangular; same dropout seed."""
    q, k, v = _inputs(2, 2, 600, 300, 16, 8, dtype)
    km, qm = _masks(masks, 2, 600, 300)
    torch.manual_seed(11)
    with torch.no_grad():
        inference = _call(name, q, k, v, km, qm, dropout_p)
    torch.manual_seed(11)
    training = _call(name, q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), km, qm, dropout_p)
    assert training.requires_grad and not inference.requires_grad
    assert torch.equal(inference, training.detach())


def test_no_grad_calls_take_the_forward_only_entry(monkeypatch):
    """Under no_grad (or with inputs that need no gradient) the autograd function is not entered."""

    def refuse(*args):
        raise AssertionError("the training path was taken")

    monkeypatch.setattr(cpp_potentials._Potentials, "apply", refuse)
    q, k, v = _inputs(1, 2, 20, 30, 8, 8, torch.float32)
    _call("hnas", q, k, v, None, None)
    with torch.no_grad():
        _call("dnas", q.requires_grad_(), k, v, None, None)
    with pytest.raises(AssertionError, match="training path"):
        _call("dnas", q, k, v, None, None)


@pytest.mark.parametrize("name", list(ITERS))
@pytest.mark.parametrize("masks", ["none", "padding", "empty_rows"])
def test_inference_matches_float64_reference_with_masks(name, masks):
    q, k, v = _inputs(2, 3, 600, 300, 8, 5, torch.float64, seed=5)  # several chunks and strips
    km, qm = _masks(masks, 2, 600, 300)
    with torch.no_grad():
        out = _call(name, q, k, v, km, qm)
    mech, kw = REF[name]
    ref, _ = ref_attention(q, k, v, mech, key_mask=km, query_mask=qm, **kw)
    if qm is not None:  # padded queries return zeros in the kernel
        ref = ref * qm[:, None, :, None]
    torch.testing.assert_close(out, ref, atol=1e-11, rtol=1e-9)


def _far_rows(dtype):
    """Query chunk whose first rows score ~200 above the others: the shared softmax exponentials
    exp(s - R_chunk) of the other rows underflow, and those rows are recomputed with their own maximum."""
    q, k, v = _inputs(1, 2, 150, 100, 8, 8, torch.float64, seed=9)
    q[:, :, :3] = 0.0
    k[:, :, :5] = 0.0
    q[:, :, :3, 0] = 50.0
    k[:, :, :5, 0] = 12.0  # s = 50 * 12 / sqrt(8) ~ 212 for the first rows on the first keys
    return [t.to(dtype) for t in (q, k, v)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_hnas_rows_far_below_their_chunk_match_reference_outputs_and_gradients(dtype):
    q, k, v = (t.requires_grad_() for t in _far_rows(dtype))
    km, qm = _masks("padding", 1, 150, 100)
    out = _call("hnas", q, k, v, km, qm)
    ref, _ = ref_attention(q.double(), k.double(), v.double(), "hnas", key_mask=km, query_mask=qm, u=0.3)
    ref = ref * qm[:, None, :, None]
    tol = {"atol": 1e-10, "rtol": 1e-9} if dtype == torch.float64 else {"atol": 2e-4, "rtol": 1e-4}
    torch.testing.assert_close(out.double(), ref, **tol)
    assert torch.isfinite(out).all()
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), g.to(dtype))
    want = torch.autograd.grad(ref, (q, k, v), g)
    for name, a, b in zip("qkv", got, want):
        scale = b.abs().max().item() + 1.0
        torch.testing.assert_close(a.double(), b.double(), atol=tol["atol"] * scale, rtol=tol["rtol"] * 10,
                                   msg=lambda m, n=name: f"d{n}: {m}")
    with torch.no_grad():
        assert torch.equal(_call("hnas", q, k, v, km, qm), out.detach())
