"""Second derivatives through the efficient backend (``create_graph=True``): Hessian-vector products, gradient
penalties and second-order meta-learning differentiate the gradient itself. The kernels' backward passes are
not differentiable, so ``ak.attention`` recomputes such a backward on the materialized path; a first-order
backward stays the kernels' own."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit import functional
from attnkit.kernels import run_route

MECHANISMS = [*ak.MECHANISMS, ak.Sinkhorn(iters=2)]


def _inputs(seed=0, B=2, H=2, L=6, D=3):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, L, D, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[1, 4:] = False  # padding: the C++ kernels compact it
    return q, k, v, mask


@pytest.mark.parametrize("mechanism", MECHANISMS, ids=str)
def test_second_derivatives_of_the_efficient_backend_pass_gradgradcheck(mechanism):
    q, k, v, mask = _inputs()
    inputs = tuple(t.requires_grad_() for t in (q, k, v))

    def f(q, k, v):
        return ak.attention(q, k, v, mechanism, key_mask=mask, query_mask=mask, backend="efficient")

    assert torch.autograd.gradgradcheck(f, inputs)


def test_the_hybrid_weight_gets_second_derivatives_too():
    q, k, v, mask = _inputs(seed=1)
    u = torch.tensor([0.3, 0.8], dtype=torch.float64, requires_grad=True)

    def f(q, u):
        return ak.attention(q, k, v, "hnas", key_mask=mask, hybrid_weight=u, backend="efficient")

    assert torch.autograd.gradgradcheck(f, (q.requires_grad_(), u))


@pytest.mark.parametrize("mechanism", ak.MECHANISMS)
def test_a_hessian_vector_product_matches_the_reference_backend(mechanism):
    q, k, v, mask = _inputs(seed=2, L=40, D=8)
    vec = torch.randn(q.shape, generator=torch.Generator().manual_seed(3), dtype=q.dtype)
    results = []
    for backend in ("efficient", "reference"):

        def loss(q):
            out = ak.attention(q, k, v, mechanism, key_mask=mask, query_mask=mask, backend=backend)
            return out.pow(2).sum()

        results.append(torch.autograd.functional.hvp(loss, q, vec))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    assert results[0][1].abs().sum() > 0  # a second-order term that is not silently zero


@pytest.mark.parametrize("mechanism", ak.MECHANISMS)
def test_first_order_gradients_are_the_kernels_own_bits(mechanism, monkeypatch):
    q, k, v, mask = _inputs(seed=4, L=50, D=8)
    grads = []
    for wrap in (True, False):
        if not wrap:  # the route called directly, as before the wrapper
            monkeypatch.setattr(
                functional._TwiceDifferentiable, "apply",
                lambda route, config, m, scale, p, q, k, v, u: run_route(
                    route, q, k, v, config, m, scale=scale, dropout_p=p, u=u
                ),
            )
        qs, ks, vs = (t.clone().float().requires_grad_() for t in (q, k, v))
        out = ak.attention(qs, ks, vs, mechanism, key_mask=mask, query_mask=mask, backend="efficient")
        out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
        grads.append((out.detach(), qs.grad, ks.grad, vs.grad))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_second_derivatives_with_kernel_dropout_are_a_clear_error():
    q, k, v, mask = _inputs(L=40)
    q.requires_grad_()
    out = ak.attention(q, k, v, "dnas", key_mask=mask, dropout_p=0.1, backend="efficient")
    with pytest.raises(ValueError, match="backend='reference'"):
        torch.autograd.grad(out.sum(), q, create_graph=True)
    out = ak.attention(q, k, v, "dnas", key_mask=mask, dropout_p=0.1, backend="efficient")
    (g,) = torch.autograd.grad(out.sum(), q)  # first order with dropout is the kernels' own
    assert torch.isfinite(g).all()


def test_retain_graph_allows_a_second_backward_and_the_graph_is_freed_after():
    q, k, v, mask = _inputs(L=40)
    q.requires_grad_()
    out = ak.attention(q, k, v, "sinkhorn", key_mask=mask, backend="efficient")
    out.sum().backward(retain_graph=True)
    first = q.grad.clone()
    out.sum().backward()
    torch.testing.assert_close(q.grad, 2 * first)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        out.grad_fn.saved_tensors  # the route's graph went with the saved tensors
