"""Second derivatives (``create_graph=True``): Hessian-vector products, gradient penalties and second-order
meta-learning differentiate the gradient itself. The materialized path (``backend="reference"``) is
differentiable twice for every mechanism; the efficient kernels' backward passes are not, so a backward
through them under ``create_graph=True`` is a clear error instead of a gradient without a graph (whose
second-order terms would silently be zero)."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak

MECHANISMS = [*ak.MECHANISMS, ak.Sinkhorn(iters=2)]


def _inputs(seed=0, B=2, H=2, L=6, D=3):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, L, D, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[1, 4:] = False
    return q, k, v, mask


@pytest.mark.parametrize("mechanism", MECHANISMS, ids=str)
def test_the_reference_backend_passes_gradgradcheck(mechanism):
    """CoDA too: its L1 distance kernel's backward is differentiable under create_graph."""
    q, k, v, mask = _inputs()

    def f(q, k, v):
        return ak.attention(q, k, v, mechanism, key_mask=mask, query_mask=mask, backend="reference")

    assert torch.autograd.gradgradcheck(f, tuple(t.requires_grad_() for t in (q, k, v)))


def test_the_hybrid_weight_gets_second_derivatives_on_the_reference_backend():
    q, k, v, mask = _inputs(seed=1)
    u = torch.tensor([0.3, 0.8], dtype=torch.float64, requires_grad=True)

    def f(q, u):
        return ak.attention(q, k, v, "hnas", key_mask=mask, hybrid_weight=u, backend="reference")

    assert torch.autograd.gradgradcheck(f, (q.requires_grad_(), u))


@pytest.mark.parametrize("mechanism", ak.MECHANISMS)
@pytest.mark.parametrize("padded", [True, False])
def test_create_graph_through_the_efficient_kernels_is_a_clear_error(mechanism, padded):
    q, k, v, mask = _inputs(seed=2, L=40, D=8)
    mask = mask if padded else None
    q.requires_grad_()
    out = ak.attention(q, k, v, mechanism, key_mask=mask, query_mask=mask, backend="efficient")
    with pytest.raises(ValueError, match="create_graph=True.*backend='reference'"):
        torch.autograd.grad(out.pow(2).sum(), q, create_graph=True)
    out = ak.attention(q, k, v, mechanism, key_mask=mask, query_mask=mask, backend="efficient")
    (g,) = torch.autograd.grad(out.pow(2).sum(), q)  # first order is unaffected
    assert torch.isfinite(g).all()


@pytest.mark.parametrize("mechanism", ak.MECHANISMS)
def test_a_hessian_vector_product_on_the_reference_backend_is_not_zero(mechanism):
    q, k, v, mask = _inputs(seed=3, L=20, D=4)
    vec = torch.randn(q.shape, generator=torch.Generator().manual_seed(4), dtype=q.dtype)

    def loss(q):
        out = ak.attention(q, k, v, mechanism, key_mask=mask, query_mask=mask, backend="reference")
        return out.pow(2).sum()

    _, hvp = torch.autograd.functional.hvp(loss, q, vec)
    eps = 1e-6
    grad_at = lambda x: torch.autograd.grad(loss(x.requires_grad_()), x)[0]  # noqa: E731
    expected = (grad_at(q + eps * vec) - grad_at(q - eps * vec)) / (2 * eps)
    torch.testing.assert_close(hvp, expected, rtol=1e-5, atol=1e-7)
    assert hvp.abs().sum() > 0


def test_a_converted_hugging_face_model_takes_the_reference_backend_for_second_derivatives():
    import attnkit.hf as akhf
    from tests.hf._models import tiny_model

    model = akhf.convert(tiny_model("bert"), "dnas")
    ids = torch.randint(5, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 4:] = 0
    emb = model.embeddings(ids).detach().requires_grad_()

    def penalty():  # a gradient penalty: differentiates the gradient
        h = model(inputs_embeds=emb, attention_mask=mask).last_hidden_state
        (g,) = torch.autograd.grad(h.pow(2).sum(), emb, create_graph=True)
        return g.pow(2).sum()

    with pytest.raises(ValueError, match=r"attnkit\.hf\.set_backend\(model, 'reference'\)"):
        penalty()
    akhf.set_backend(model, "reference")
    penalty().backward()
    assert emb.grad is not None and emb.grad.abs().sum() > 0
    akhf.set_backend(model, "auto")
    with pytest.raises(ValueError, match="create_graph=True"):
        penalty()
    with pytest.raises(ValueError, match="backend='fast'; expected one of"):
        akhf.set_backend(model, "fast")


@pytest.mark.parametrize("mechanism", ak.MECHANISMS)
def test_batched_cotangents_are_named_on_the_kernels_and_work_on_the_reference_backend(mechanism):
    """jacobian(vectorize=True) vmaps the backward; the kernels have no batching rule."""
    q, k, v, mask = _inputs(seed=5, H=1, L=20, D=4)

    def f(backend):
        return lambda q: ak.attention(q, k, v, mechanism, key_mask=mask, query_mask=mask, backend=backend)

    with pytest.raises(ValueError, match="vectorize=False, or backend='reference'"):
        torch.autograd.functional.jacobian(f("efficient"), q, vectorize=True)
    vectorized = torch.autograd.functional.jacobian(f("reference"), q, vectorize=True)
    looped = torch.autograd.functional.jacobian(f("efficient"), q)
    torch.testing.assert_close(vectorized, looped, rtol=1e-10, atol=1e-12)
