"""An in-place op on the output of attention (``out.mul_(2)``, ``out += residual``) on every route: allowed,
as on PyTorch's SDPA, and a backward after it either gives the gradient of the modified output or is
autograd's in-place error (where the route saved the output for its backward), never a silently wrong
gradient."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: run the kernels on the CPU

import pytest
import torch

import attnkit as ak

ROUTES = [
    (mechanism, backend, dtype)
    for mechanism in ("softmax", "dnas", "hnas", "sinkhorn", "coda")
    for backend in ("efficient", "reference")
    for dtype in (torch.float32, torch.float64)
]


def _inputs(dtype, B=2, H=2, L=24, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, D, generator=g, dtype=dtype).requires_grad_() for _ in range(3)]


def _weights(out):
    return torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)


def _check_in_place_is_exact_or_refused(attend, q, k, v):
    out = attend(q, k, v)
    expected = [2 * g for g in torch.autograd.grad((_weights(out) * out).sum(), (q, k, v))]
    out = attend(q * 1, k * 1, v * 1)  # non-leaf inputs, as inside a model
    out.mul_(2)  # allowed, as on SDPA's output (autograd refuses it on a custom Function's view output)
    try:
        grads = torch.autograd.grad((_weights(out) * out).sum(), (q, k, v))
    except RuntimeError as exc:
        assert "inplace" in str(exc).replace("in-place", "inplace"), exc  # autograd's version-counter check
        return
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("padded", [False, True], ids=["no_mask", "padding"])
@pytest.mark.parametrize("mechanism,backend,dtype", ROUTES)
def test_output_modified_in_place_gives_exact_gradient_or_autograd_error(mechanism, backend, dtype, padded):
    q, k, v = _inputs(dtype)
    mask = None
    if padded:
        mask = torch.ones(2, 24, dtype=torch.bool)
        mask[1, 17:] = False

    def attend(q, k, v):
        return ak.attention(q, k, v, mechanism, key_mask=mask, backend=backend)

    _check_in_place_is_exact_or_refused(attend, q, k, v)


@pytest.mark.parametrize("mechanism", ["softmax", "dnas", "hnas", "sinkhorn", "coda"])
def test_output_of_inference_call_can_be_modified_in_place(mechanism):
    q, k, v = _inputs(torch.float32)
    with torch.no_grad():
        out = ak.attention(q, k, v, mechanism)
        expected = out.clone()
        out += 1
    torch.testing.assert_close(out, expected + 1)


@pytest.mark.parametrize("iters", [1, 3])
def test_triton_potentials_output_modified_in_place_exact_or_refused(iters):
    pytest.importorskip("triton")
    from attnkit.kernels import _triton_kernels
    from attnkit.kernels.triton_potentials import triton_attention

    if not _triton_kernels.INTERPRETED:
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set")
    q, k, v = _inputs(torch.float32, L=19)
    km = torch.ones(2, 19, dtype=torch.bool)
    km[0, 11:] = False

    def attend(q, k, v):
        return triton_attention(q, k, v, key_mask=km, query_mask=None, scale=8**-0.5, iters=iters)

    _check_in_place_is_exact_or_refused(attend, q, k, v)


def test_triton_coda_output_modified_in_place_exact_or_refused():
    pytest.importorskip("triton")
    from attnkit.kernels import _triton_kernels
    from attnkit.kernels.triton_coda import triton_coda_attention
    from attnkit.masks import build_mask

    if not _triton_kernels.INTERPRETED:
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set")
    q, k, v = _inputs(torch.float32, L=19)
    info = build_mask(2, 2, 19, 19, device=q.device, allow_bias=False)

    def attend(q, k, v):
        return triton_coda_attention(q, k, v, info, ak.CoDA(), scale=8**-0.5)

    _check_in_place_is_exact_or_refused(attend, q, k, v)
