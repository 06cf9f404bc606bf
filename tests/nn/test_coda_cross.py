"""CoDA cross-attention (eqs. 7-9): A' = M B and B' = M^T A against float64 by hand, masks, baselines."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import attnkit as ak
from attnkit.nn.coda_cross import AlignCompose, CoDACrossAttention


def _pair(B=2, La=4, Lb=6, d=8):
    g = torch.Generator().manual_seed(0)
    return torch.randn(B, La, d, generator=g, dtype=torch.float64), torch.randn(
        B, Lb, d, generator=g, dtype=torch.float64
    )


def test_forward_matches_eqs_7_by_hand_in_float64():
    torch.manual_seed(0)
    layer = CoDACrossAttention(8, config=ak.CoDA(gate="scaled")).double()
    a, b = _pair()
    a_prime, b_prime, m = layer(a, b)
    ea, eb, na, nb = layer.f_e(a), layer.f_e(b), layer.f_n(a), layer.f_n(b)
    e = ea @ eb.transpose(-1, -2) / math.sqrt(8)  # (B, La, Lb)
    n = -(na[:, :, None, :] - nb[:, None, :, :]).abs().sum(-1) / math.sqrt(8)
    expected = torch.tanh(e) * 2 * torch.sigmoid(n)  # eq. (5) gate
    torch.testing.assert_close(m, expected)
    torch.testing.assert_close(a_prime, expected @ b)
    torch.testing.assert_close(b_prime, expected.transpose(-1, -2) @ a)


@pytest.mark.parametrize("mechanism", ["coda", "softmax", "none"])
def test_padding_never_changes_real_positions_and_padded_rows_are_zero(mechanism):
    torch.manual_seed(0)
    layer = CoDACrossAttention(8, mechanism=mechanism).double()
    a, b = _pair()
    a_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    b_mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    a2, b2 = a.clone(), b.clone()
    a2[0, 3] += 100.0
    b2[0, 4:] -= 50.0  # garbage in the padding
    out1 = layer(a, b, a_mask, b_mask)
    out2 = layer(a2, b2, a_mask, b_mask)
    torch.testing.assert_close(out1[0], out2[0])
    torch.testing.assert_close(out1[1], out2[1])
    assert out1[0][0, 3].abs().max() == 0 and out1[1][0, 4:].abs().max() == 0


def test_softmax_is_decomposable_attention_and_none_is_the_mean():
    torch.manual_seed(0)
    a, b = _pair()
    soft = CoDACrossAttention(8, mechanism="softmax").double()
    w_a, w_b = soft.weights(a, b, torch.ones(2, 4, dtype=torch.bool), torch.ones(2, 6, dtype=torch.bool))
    torch.testing.assert_close(w_a.sum(-1), torch.ones(2, 4, dtype=torch.float64))
    torch.testing.assert_close(w_b.sum(-2), torch.ones(2, 6, dtype=torch.float64))
    a_prime, b_prime, _ = CoDACrossAttention(8, mechanism="none").double()(a, b)
    torch.testing.assert_close(a_prime, b.mean(1, keepdim=True).expand_as(a_prime))
    torch.testing.assert_close(b_prime, a.mean(1, keepdim=True).expand_as(b_prime))


def test_align_compose_sums_real_positions_only():
    torch.manual_seed(0)
    f = AlignCompose(4, 5).double()
    x, xp = torch.randn(1, 3, 4, dtype=torch.float64), torch.randn(1, 3, 4, dtype=torch.float64)
    mask = torch.tensor([[True, True, False]])
    torch.testing.assert_close(f(xp, x, mask), f(xp[:, :2], x[:, :2], mask[:, :2]))


def test_bad_inputs_are_rejected_with_the_expected_shapes():
    layer = CoDACrossAttention(8)
    with pytest.raises(ValueError, match="must be"):
        layer(torch.randn(2, 3, 8), torch.randn(3, 4, 8))
    with pytest.raises(ValueError, match="mechanism"):
        CoDACrossAttention(8, mechanism="dnas")


def test_dtype_mismatch_is_a_value_error_naming_the_fix():
    layer = CoDACrossAttention(8)
    a64, b64 = torch.randn(2, 3, 8, dtype=torch.float64), torch.randn(2, 4, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="parameters are torch.float32"):
        layer(a64, b64)
    with pytest.raises(ValueError, match="a has dtype torch.float32 but b torch.float64"):
        CoDACrossAttention(8, mechanism="none")(torch.randn(2, 3, 8), b64)


@pytest.mark.parametrize("proj_dim", [0, -1, 2.0, True])
def test_bad_proj_dim_is_refused_at_construction(proj_dim):
    with pytest.raises(ValueError, match="proj_dim"):
        CoDACrossAttention(8, proj_dim=proj_dim)


def test_numpy_integer_proj_dim_is_taken():
    module = CoDACrossAttention(8, proj_dim=np.int64(4))
    assert module.f_e.out_features == 4 and type(module.f_e.out_features) is int


@pytest.mark.parametrize("mechanism", ["softmax", "none"])
def test_coda_config_with_another_mechanism_is_refused(mechanism):
    with pytest.raises(ValueError, match=f"mechanism='{mechanism}' wins"):
        CoDACrossAttention(8, mechanism=mechanism, config=ak.CoDA(gate="centered"))


@pytest.mark.parametrize("mechanism", ["coda", "softmax", "none"])
@pytest.mark.parametrize("fill", [float("nan"), float("inf"), 1e30])
def test_whatever_padded_positions_hold_never_matters(mechanism, fill):
    # the masks were applied after the projections and products: 0 * NaN poisoned the real rows ("none") or
    # raised an error about the scores ("coda", "softmax")
    torch.manual_seed(0)
    module = CoDACrossAttention(6, mechanism=mechanism)
    a, b = torch.randn(2, 5, 6), torch.randn(2, 4, 6)
    a_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    b_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    clean = module(a, b, a_mask, b_mask)
    a_dirty, b_dirty = a.masked_fill(~a_mask[..., None], fill), b.masked_fill(~b_mask[..., None], fill)
    dirty = module(a_dirty, b_dirty, a_mask, b_mask)
    for x, y in zip(clean, dirty):
        assert torch.equal(x, y)


@pytest.mark.parametrize(
    "mask",
    [torch.ones(2, 1, dtype=torch.bool), torch.ones(5, dtype=torch.bool), torch.ones(2, 5, dtype=torch.long)],
)
def test_align_compose_refuses_a_mask_that_is_not_bool_batch_by_length(mask):
    # a (B, 1) mask pooled every position, an (L,) mask was broadcast, an int mask scaled the sum
    x = torch.randn(2, 5, 4)
    with pytest.raises(ValueError, match=r"expected bool \(B, L\) = \(2, 5\)"):
        AlignCompose(4, 3)(x, x, mask)
    with pytest.raises(ValueError, match="hidden=0"):
        AlignCompose(4, 0)


def test_align_compose_gradients_stay_finite_whatever_padded_positions_hold():
    torch.manual_seed(0)
    compose = AlignCompose(4, 3)
    x = torch.randn(2, 5, 4)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    x = x.masked_fill(~mask[..., None], float("nan"))
    compose(x, x, mask).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in compose.parameters())
