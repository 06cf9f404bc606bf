"""ak.nn.MultiViewAttention (VQA multi-view fusion, Appendix B): float64 reference of the equations,
padding of the primary and secondary views, the HNAS weight and argument checks."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
import attnkit.nn as aknn
from tests._reference import ref_weights

E = 8
MECHANISMS = ["softmax", "dnas", "hnas", "sinkhorn", "coda"]


def _views(B, Lp, Ls, seed=0):
    g = torch.Generator().manual_seed(seed)
    primary = torch.randn(B, Lp, E, generator=g, dtype=torch.float64)
    secondary = [torch.randn(B, L, E, generator=g, dtype=torch.float64) for L in Ls]
    return primary, secondary


def _reference(module, primary, secondary, mechanism, query_mask=None, key_masks=None):
    """z_i = LayerNorm(x^p_i + sum_s sum_j pi^s_ij x^s_j), q = W_Q x^p + b_Q, k^s = W_K^s x^s + b_K^s."""
    B, Lp, _ = primary.shape
    H = module.num_heads
    Dq, Dv = module.attn_dim // H, E // H
    q = (primary @ module.q_proj.weight.T + module.q_proj.bias).view(B, Lp, H, Dq).transpose(1, 2)
    total = primary.clone()
    u = torch.sigmoid(module.theta.detach()) if module.theta is not None else 0.5
    for s, x in enumerate(secondary):
        proj = module.k_projs[s if len(module.k_projs) > 1 else 0]
        Ls = x.shape[1]
        k = (x @ proj.weight.T + proj.bias).view(B, Ls, H, Dq).transpose(1, 2)  # (B, H, Ls, Dq)
        key_mask = None if key_masks is None else key_masks[s]
        w = ref_weights(q, k, mechanism, key_mask=key_mask, query_mask=query_mask, u=u)  # (B, H, Lp, Ls)
        v = x.view(B, Ls, H, Dv).transpose(1, 2)  # (B, H, Ls, Dv): raw features as values
        total = total + (w @ v).transpose(1, 2).reshape(B, Lp, E)
    return torch.nn.functional.layer_norm(total, (E,), module.norm.weight, module.norm.bias, module.norm.eps)


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest.mark.parametrize("num_heads, attn_dim, share", [(1, 6, True), (2, 4, False)])
def test_matches_float64_reference(mechanism, num_heads, attn_dim, share):
    torch.manual_seed(0)
    module = aknn.MultiViewAttention(
        E, num_views=2, num_heads=num_heads, attn_dim=attn_dim, mechanism=mechanism, share_key_proj=share,
        dtype=torch.float64,
    )
    with torch.no_grad():
        module.norm.weight.uniform_(0.5, 1.5)
        module.norm.bias.uniform_(-0.5, 0.5)
        if module.theta is not None:
            module.theta.uniform_(-2.0, 2.0)
    primary, secondary = _views(2, 5, [4, 6])
    out, weights = module(primary, secondary, return_weights=True)
    torch.testing.assert_close(out, _reference(module, primary, secondary, mechanism), rtol=1e-9, atol=1e-10)
    assert [tuple(w.shape) for w in weights] == [(2, num_heads, 5, 4), (2, num_heads, 5, 6)]


@pytest.mark.parametrize(
    "mechanism", MECHANISMS + [ak.Sinkhorn(iters=6), ak.CoDA(gate="centered", center_e=True)], ids=str
)
def test_padding_equals_truncation(mechanism, backend):
    torch.manual_seed(0)
    module = aknn.MultiViewAttention(
        E, num_views=2, mechanism=mechanism, backend=backend, dtype=torch.float64
    )
    primary, secondary = _views(2, 5, [4, 6], seed=1)
    lengths = [(5, 4, 6), (3, 2, 5)]  # (Lp, Ls1, Ls2) per sample
    pad = lambda L, i: torch.arange(L)[None, :] >= torch.tensor([n[i] for n in lengths])[:, None]  # noqa: E731
    out = module(primary, secondary, query_padding_mask=pad(5, 0), key_padding_masks=[pad(4, 1), pad(6, 2)])
    for b, (lp, l1, l2) in enumerate(lengths):
        alone = module(primary[b : b + 1, :lp], [secondary[0][b : b + 1, :l1], secondary[1][b : b + 1, :l2]])
        torch.testing.assert_close(out[b : b + 1, :lp], alone, rtol=1e-9, atol=1e-10)


def test_dnas_keeps_every_box_of_every_view():
    """Lemma 1 through the module: each secondary box receives at least 1/n_k of the total weight."""
    torch.manual_seed(0)
    module = aknn.MultiViewAttention(E, num_views=2, attn_dim=E, mechanism="dnas")
    with torch.no_grad():
        module.q_proj.weight.mul_(8.0)  # sharp scores: softmax would explain boxes away
    primary = torch.randn(1, 10, E)
    secondary = [torch.randn(1, 10, E) for _ in range(2)]
    _, weights = module(primary, secondary, return_weights=True)
    for w in weights:
        assert (w.sum(dim=2) >= 1 / 10 - 1e-5).all()


def test_hnas_weight_is_collected_and_trained():
    module = aknn.MultiViewAttention(E, num_views=2, mechanism="hnas")
    torch.testing.assert_close(aknn.hybrid_weights(module), torch.tensor([[0.5]]))
    primary = torch.randn(2, 3, E)
    out = module(primary, [torch.randn(2, 4, E), torch.randn(2, 5, E)])
    (out[:, :, 0] * torch.arange(3.0)).sum().backward()
    assert (
        module.theta.grad is not None
        and torch.isfinite(module.theta.grad).all()
        and module.theta.grad.abs() > 0
    )


def test_extra_repr():
    assert "num_views=2, num_heads=1, attn_dim=8, mechanism=hnas" in repr(
        aknn.MultiViewAttention(E, mechanism="hnas")
    )


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"num_heads": 3}, "embed_dim=8 is not divisible by num_heads=3"),
        ({"mechanism": "hnas", "u0": 2.0}, "2.0"),
        ({"mechanism": "xyz"}, "xyz"),
        ({"num_views": 0}, "num_views=0"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        aknn.MultiViewAttention(E, **kwargs)


def test_bad_inputs_raise_value_error():
    module = aknn.MultiViewAttention(E, num_views=2)
    primary = torch.randn(2, 3, E)
    with pytest.raises(ValueError, match="num_views=2"):
        module(primary, [torch.randn(2, 4, E)])
    with pytest.raises(ValueError, match=r"secondary\[1\]"):
        module(primary, [torch.randn(2, 4, E), torch.randn(2, 4, E + 1)])
    with pytest.raises(ValueError, match=r"key_padding_masks\[0\]"):
        module(
            primary, [torch.randn(2, 4, E)] * 2, key_padding_masks=[torch.zeros(2, 5, dtype=torch.bool), None]
        )
