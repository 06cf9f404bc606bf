"""torch.func transforms (grad, vmap, jacrev): inside them ``ak.attention`` takes the materialized path, whose
PyTorch operations the transforms support (the efficient kernels' autograd functions do not)."""

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
