"""ak.nn.MultiheadAttention self-attention inside torch.func transforms: two views of one tensor passed as
query and key are self-attention there too, so the query padding is inferred from key_padding_mask as in
eager mode (nn/module_utils.py ``same_tensor``)."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call, grad, jacrev, vmap

import attnkit as ak
from attnkit.nn.module_utils import same_tensor

E, H, L = 4, 2, 4
PAD = torch.tensor([False, False, True, True])  # 2 real tokens, 2 padded


def _module(mechanism, batch_first=True):
    torch.manual_seed(0)
    return ak.nn.MultiheadAttention(E, H, batch_first=batch_first, mechanism=mechanism,
                                    dtype=torch.float64).eval()


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("mechanism", ["softmax", "dnas", "hnas", "sinkhorn", "coda"])
def test_self_attention_inside_vmap_and_jacrev_matches_eager(mechanism, batch_first):
    """dnas moved the real tokens' outputs by 0.21 under vmap (hnas 0.022, sinkhorn 0.030): the two views
    were taken for cross-attention, whose padded queries enter the column normalization."""
    m = _module(mechanism, batch_first)
    x = torch.randn(L, E, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def f(xi):  # (L, E) -> (L, E); query, key and value are views of the same elements
        def view():  # (1, L, E) / (L, 1, E): a new view at each call
            return xi[None] if batch_first else xi[:, None]

        out = m(view(), view(), view(), key_padding_mask=PAD[None], need_weights=False)[0]
        return out[0] if batch_first else out[:, 0]

    eager = f(x)
    torch.testing.assert_close(vmap(f)(x[None])[0][:2], eager[:2], rtol=0, atol=1e-12)
    xr = x.clone().requires_grad_()
    f(xr)[:2].sum().backward()
    torch.testing.assert_close(jacrev(lambda xi: f(xi)[:2].sum())(x), xr.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("mechanism", ["dnas", "hnas", "sinkhorn"])
def test_per_sample_grads_of_self_attention_match_autograd(mechanism):
    m = _module(mechanism)
    x = torch.randn(3, L, E, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    pad = torch.tensor([[0, 0, 0, 0], [0, 0, 1, 1], [0, 0, 0, 1]], dtype=torch.bool)
    params = {k: v.detach() for k, v in m.named_parameters()}

    def loss(p, xi, pi):
        out = functional_call(m, p, (xi[None], xi[None], xi[None]),
                              dict(key_padding_mask=pi[None], need_weights=False))[0]
        return (out * torch.arange(E, dtype=out.dtype)).sum()

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, pad)
    for b in range(3):
        leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
        loss(leaves, x[b], pad[b]).backward()
        for name, leaf in leaves.items():
            torch.testing.assert_close(per_sample[name][b], leaf.grad, rtol=0, atol=1e-12)


def test_same_tensor_sees_through_functorch_wrappers_and_tells_other_tensors_apart():
    x = torch.randn(2, 3, 4)
    seen = {}

    def f(xi, other):
        seen["views"] = same_tensor(xi[None], xi[None])
        seen["transposed"] = same_tensor(xi.transpose(0, 1), xi.transpose(0, 1))
        seen["copy"] = same_tensor(xi, xi + 0)
        seen["mapped vs closure"] = same_tensor(xi, x[0])
        seen["other input"] = same_tensor(xi, other)
        return xi.sum()

    vmap(f)(x, x.clone())
    assert seen == {"views": True, "transposed": True, "copy": False, "mapped vs closure": False,
                    "other input": False}
    grad(lambda xi: f(xi, xi.detach().clone()))(x[0])
    assert seen["views"] and seen["transposed"] and not seen["copy"] and not seen["other input"]


def test_views_differing_only_in_a_size_one_dimensions_stride_are_one_tensor():
    """``x.view(x.shape)`` of a transposed batch of one has another stride in the batch dimension (size 1,
    so no other element): it was not recognised as the query, and the padded queries entered DNAS's column
    sums (the real tokens' output off by 4e-3 from the same tokens alone)."""
    import attnkit as ak

    torch.manual_seed(0)
    m = ak.nn.MultiheadAttention(4, 1, mechanism="dnas", dtype=torch.float64)
    x = torch.randn(1, 6, 4, dtype=torch.float64).transpose(0, 1)  # (L, B=1, E), strides (4, 24, 1)
    y = x.view(x.shape)  # the same elements, strides (4, 4, 1)
    assert same_tensor(x, y) and not same_tensor(x, x[:, :, :3].contiguous())
    z = torch.zeros(2, 2)
    assert not same_tensor(z, z.t())  # one storage, one shape, other elements
    pad = torch.tensor([[False, False, False, True, True, True]])
    out, _ = m(x, y, y, key_padding_mask=pad)
    alone, _ = m(x[:3], x[:3], x[:3])
    torch.testing.assert_close(out[:3], alone, rtol=0, atol=1e-12)
