"""torch.func transforms (grad, vmap, jacrev, jvp) and forward-mode AD: inside them ``ak.attention`` takes
the materialized path, whose PyTorch operations they support (the efficient kernels' autograd functions do
not)."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call, grad, jacrev, vmap

import attnkit as ak


def _inputs():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 1, 2, 40, 8, generator=g, dtype=torch.float64).unbind(0)
    mask = torch.ones(1, 40, dtype=torch.bool)
    mask[0, 30:] = False
    return q, k, v, mask


@pytest.mark.parametrize("mechanism", ak.MECHANISMS)
def test_func_grad_and_per_sample_vmap_grad_match_autograd(mechanism):
    q, k, v, mask = _inputs()

    def loss(q):
        return ak.attention(q, k, v, mechanism, key_mask=mask, query_mask=mask).pow(2).sum()

    qr = q.clone().requires_grad_()
    loss(qr).backward()  # the efficient kernels' own backward
    torch.testing.assert_close(grad(loss)(q), qr.grad, rtol=1e-10, atol=1e-12)
    batch = torch.randn((3, *q.shape), generator=torch.Generator().manual_seed(1), dtype=q.dtype)
    expected = torch.stack([torch.autograd.grad(loss(x.requires_grad_()), x)[0] for x in batch.clone()])
    torch.testing.assert_close(vmap(grad(loss))(batch), expected, rtol=1e-10, atol=1e-12)


def test_jacrev_through_a_module_with_functional_call():
    torch.manual_seed(0)
    mha = ak.nn.MultiheadAttention(8, 2, mechanism="sinkhorn", batch_first=True).double()
    x = torch.randn(1, 5, 8, dtype=torch.float64)
    pad = torch.tensor([[False, False, False, False, True]])  # padding: the C++ route outside the transform
    params = dict(mha.named_parameters())

    def out(x):
        return functional_call(mha, params, (x, x, x), {"key_padding_mask": pad, "need_weights": False})[0]

    jac = jacrev(out)(x)  # (1, 5, 8, 1, 5, 8)
    xr = x.clone().requires_grad_()
    row = torch.autograd.grad(mha(xr, xr, xr, key_padding_mask=pad, need_weights=False)[0][0, 2, 3], xr)[0]
    torch.testing.assert_close(jac[0, 2, 3], row, rtol=1e-10, atol=1e-12)


def _dual_tangent(f, x, t, dispatch):
    """The tangent of ``f`` at ``x`` along ``t`` through a dual tensor (whose call ``dispatch`` must plan on
    the materialized path), and the central difference it should equal."""
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        dual = fwAD.make_dual(x, t)
        assert dispatch(dual).route == "reference"
        tangent = fwAD.unpack_dual(f(dual)).tangent
    eps = 1e-6
    return tangent, (f(x + eps * t) - f(x - eps * t)) / (2 * eps)


@pytest.mark.parametrize("mechanism", ak.MECHANISMS)
def test_forward_mode_tangents_match_finite_differences(mechanism):
    """A dual tensor's tangent is carried through (the kernels' autograd functions have no jvp and dropped it:
    the output's tangent was None)."""
    from torch.func import jvp

    q, k, v, mask = _inputs()
    t = torch.randn(q.shape, generator=torch.Generator().manual_seed(2), dtype=q.dtype)

    def f(q):
        return ak.attention(q, k, v, mechanism, key_mask=mask, query_mask=mask)

    tangent, expected = _dual_tangent(f, q, t, lambda dual: ak.explain_dispatch(dual, k, v, mechanism,
                                                                                key_mask=mask))
    assert tangent is not None
    torch.testing.assert_close(tangent, expected, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(jvp(f, (q,), (t,))[1], expected, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("mechanism", ["softmax", "dnas", "hnas", "sinkhorn"])
def test_a_dual_float_attn_mask_takes_the_materialized_path(mechanism):
    """Only q, k and v were checked for tangents: a learned bias given as a dual tensor reached SDPA or the
    blockwise kernel and raised NotImplementedError."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 2, 140, 8, generator=g, dtype=torch.float64)
    bias, t = (torch.randn(1, 2, 140, 140, generator=g, dtype=torch.float64) for _ in range(2))

    def f(bias):
        return ak.attention(q, q, q, mechanism, attn_mask=bias)

    tangent, expected = _dual_tangent(f, bias, t, lambda dual: ak.explain_dispatch(q, q, q, mechanism,
                                                                                   attn_mask=dual))
    torch.testing.assert_close(tangent, expected, rtol=1e-6, atol=1e-8)


def test_the_l1_distance_by_feature_equals_the_kernel():
    from attnkit.kernels.l1_distance import _l1_by_feature, l1_distance

    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 7, 5, generator=g, dtype=torch.float64)
    y = torch.randn(3, 9, 5, generator=g, dtype=torch.float64)
    torch.testing.assert_close(_l1_by_feature(x, y), l1_distance(x, y), rtol=1e-12, atol=1e-12)


def _per_example_masks():
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(3, 3, 2, 7, 4, generator=g, dtype=torch.float64).unbind(0)
    lengths = torch.tensor([7, 5, 2])
    mask = torch.arange(7) < lengths[:, None]  # (3, 7) True = real
    return q, k, v, mask


@pytest.mark.parametrize("mechanism", ak.MECHANISMS)
@pytest.mark.parametrize("which", ["key_mask", "query_mask", "attn_mask"])
def test_vmap_over_per_example_masks_equals_the_batched_call(mechanism, which):
    """vmap maps the masks too (per-example padding, per-sample gradients): their values cannot be read
    there, and every host check of them used to raise vmap's "data-dependent control flow" error."""
    q, k, v, mask = _per_example_masks()
    band = (torch.arange(7)[:, None] - torch.arange(7)).abs() <= 3  # (7, 7): bidirectional, per example
    hidden = torch.zeros(3, 1, 7, 7, dtype=torch.bool)
    hidden[0, 0, 1, 2] = hidden[1, 0, 4, 0] = True  # and a pair hidden here and there
    m = mask if which != "attn_mask" else mask[:, None, None, :] & band & ~hidden

    def one(q, k, v, m):
        return ak.attention(q[None], k[None], v[None], mechanism, **{which: m[None]})[0]

    expected = ak.attention(q, k, v, mechanism, **{which: m})
    torch.testing.assert_close(vmap(one)(q, k, v, m), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mechanism", ["softmax", "dnas", "sinkhorn"])
def test_vmap_over_a_float_attn_mask_and_minus_inf_scores(mechanism):
    q, k, v, mask = _per_example_masks()
    bias = torch.randn(3, 1, 7, 7, dtype=torch.float64).masked_fill(~mask[:, None, None, :], float("-inf"))
    one = lambda q, k, v, b: ak.attention(q[None], k[None], v[None], mechanism, attn_mask=b[None])[0]  # noqa: E731
    expected = ak.attention(q, k, v, mechanism, attn_mask=bias)
    torch.testing.assert_close(vmap(one)(q, k, v, bias), expected, rtol=1e-10, atol=1e-12)
    scores = ak.scores.scaled_dot(q, k) + bias  # (3, 2, 7, 7) with -inf where masked
    expected = ak.normalize(scores, mechanism)
    torch.testing.assert_close(vmap(lambda s: ak.normalize(s[None], mechanism)[0])(scores), expected)


@pytest.mark.parametrize("mechanism", ["softmax", "hnas", "coda"])
def test_per_sample_gradients_of_a_module_with_a_padding_mask(mechanism):
    torch.manual_seed(0)
    mha = ak.nn.MultiheadAttention(8, 2, mechanism=mechanism, batch_first=True, dtype=torch.float64)
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    pad = torch.arange(5) >= torch.tensor([5, 3, 1])[:, None]  # (3, 5) True = padding
    params = {n: p.detach() for n, p in mha.named_parameters()}

    def loss(params, x, pad):  # one example: self-attention, so padded queries are masked too
        x = x[None]
        out = functional_call(mha, params, (x, x, x), {"key_padding_mask": pad[None], "need_weights": False})
        return out[0].pow(2).sum()

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, pad)
    for i in range(3):
        one = torch.autograd.grad(loss(dict(mha.named_parameters()), x[i], pad[i]), list(mha.parameters()))
        for (name, g), e in zip(per_sample.items(), one):
            torch.testing.assert_close(g[i], e, rtol=1e-10, atol=1e-12, msg=name)


def test_a_float_padding_mask_inside_vmap_is_a_clear_error():
    mha = ak.nn.MultiheadAttention(8, 2, mechanism="dnas", batch_first=True, dtype=torch.float64)
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    pad = torch.zeros(3, 5, dtype=torch.float64)
    pad[1, 3:] = float("-inf")

    def one(x, pad):
        x = x[None]
        return mha(x, x, x, key_padding_mask=pad[None], need_weights=False)[0][0]

    with pytest.raises(ValueError, match="boolean key_padding_mask"):
        vmap(one)(x, pad)
    expected = mha(x, x, x, key_padding_mask=pad, need_weights=False)[0]
    torch.testing.assert_close(vmap(one)(x, pad.isinf()), expected)


def test_vmap_over_per_example_hybrid_weights():
    q, k, v, mask = _per_example_masks()
    u = torch.tensor([0.2, 0.7, 1.0], dtype=torch.float64)
    one = lambda q, k, v, u: ak.attention(q[None], k[None], v[None], "hnas", hybrid_weight=u)[0]  # noqa: E731
    expected = torch.stack([one(q[i], k[i], v[i], u[i]) for i in range(3)])
    torch.testing.assert_close(vmap(one)(q, k, v, u), expected, rtol=1e-10, atol=1e-12)


def test_inside_vmap_the_safety_checks_read_every_examples_values():
    """Skipping the checks under vmap let a causal attn_mask leak future keys through dnas, and accepted a
    hybrid weight outside [0, 1]: they now run on the plain tensor under the batching."""
    q, k, v, mask = _per_example_masks()
    causal = torch.ones(7, 7, dtype=torch.bool).tril().expand(3, 1, 7, 7)
    one = lambda q, k, v, m: ak.attention(q[None], k[None], v[None], "dnas", attn_mask=m[None])[0]  # noqa: E731
    with pytest.raises(ValueError, match="causal pattern"):
        vmap(one)(q, k, v, causal)
    bad = torch.tensor([0.5, 1.5, 0.2], dtype=torch.float64)
    hnas = lambda q, k, v, u: ak.attention(q[None], k[None], v[None], "hnas", hybrid_weight=u)[0]  # noqa: E731
    with pytest.raises(ValueError, match="outside \\[0, 1\\]"):
        vmap(hnas)(q, k, v, bad)
