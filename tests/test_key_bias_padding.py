"""``attnkit.masks.constant_key_bias`` / ``functional.check_constant_key_bias``: a float ``attn_mask`` that
hides a key with a finite fill (-1000 padding) is refused for the mechanisms that normalize over queries,
whose column normalization would give the key weight; graded biases and real masks are kept."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.masks import build_mask, constant_key_bias

QUERY_NORMALIZED = ["dnas", "hnas", "sinkhorn"]
L = 6
REAL = torch.tensor([True] * 4 + [False] * 2)  # (L,): the last two positions are padding


def _qkv(B=1, H=1, Lq=L, Lk=L):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, Lq, 4, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, H, Lk, 4, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v


def _outer_product_padding(fill: float) -> torch.Tensor:
    pair = REAL[:, None] & REAL[None, :]  # (L, L): real queries with real keys
    return torch.zeros(1, 1, L, L, dtype=torch.float64).masked_fill(~pair, fill)  # (1, 1, L, L)


@pytest.mark.parametrize("fill", [-1000.0, -5000.0])
@pytest.mark.parametrize("mechanism", QUERY_NORMALIZED)
def test_an_outer_product_padding_mask_with_a_finite_fill_is_refused(mechanism, fill):
    # the padded queries' rows are all `fill`: dnas gave the padded keys 0.954 of the real queries' weight
    q, k, v = _qkv()
    mask = _outer_product_padding(fill)
    with pytest.raises(ValueError, match=rf"attn_mask holds {fill:g} at key 4 for every query.*-inf"):
        ak.attention(q, k, v, mechanism, attn_mask=mask)
    with pytest.raises(ValueError, match="normalizes over queries"):
        ak.normalize(ak.scores.scaled_dot(q, k), mechanism, attn_mask=mask)
    ak.attention(q, k, v, "softmax", attn_mask=mask)  # softmax hides the keys with it: kept


@pytest.mark.parametrize("mechanism", QUERY_NORMALIZED)
def test_padding_under_a_graded_bias_is_refused(mechanism):
    # -1000 at the padded keys plus ALiBi's -0.5|i - j|: the column is not constant, and the padded keys kept
    # 0.06-0.59 of each query's weight under dnas
    q, k, v = _qkv()
    pos = torch.arange(L, dtype=torch.float64)
    alibi = -0.5 * (pos[:, None] - pos[None, :]).abs()  # (L, L)
    mask = alibi + torch.where(REAL, 0.0, -1000.0).double()[None, :]  # (L, L)
    with pytest.raises(ValueError, match=r"attn_mask holds -1002 to -1000 at key 4 for every query"):
        ak.attention(q, k, v, mechanism, attn_mask=mask)


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("mechanism", QUERY_NORMALIZED)
def test_padding_under_a_graded_bias_spanning_past_the_fill_is_refused(mechanism, side):
    # a graded bias whose far keys fall below -1000 leaves no gap between the fill and the real keys: dnas
    # gave the 8 padded keys of 256 their uniform share of the weight (0.031), as if nothing were masked
    n, slope = 256, 8.0
    q, k, v = _qkv(Lq=n, Lk=n)
    pos = torch.arange(n, dtype=torch.float64)
    padded = pos < 8 if side == "left" else pos >= n - 8  # (n,)
    mask = -slope * (pos[:, None] - pos[None, :]).abs() + torch.where(padded, -1000.0, 0.0)[None, :]  # (n, n)
    edge = 7 if side == "left" else n - 8
    with pytest.raises(ValueError, match=rf"attn_mask holds -\d+ to -1000 at key {edge} for every query"):
        ak.attention(q, k, v, mechanism, attn_mask=mask)


@pytest.mark.parametrize("mechanism", QUERY_NORMALIZED)
def test_a_module_float_padding_attn_mask_is_refused_naming_the_module_masks(mechanism):
    # torch's (B * H, L, L) form of an outer-product padding mask of -1000 leaked 0.21-0.37 through dnas
    B, H, E = 1, 2, 16
    mha = ak.nn.MultiheadAttention(E, H, mechanism=mechanism, batch_first=True).double().eval()
    x = torch.randn(B, L, E, dtype=torch.float64)
    pad = ~REAL[None, :]  # (B, L) True = ignore
    hidden = pad[:, :, None] | pad[:, None, :]  # (B, L, L)
    mask = torch.zeros(B, L, L, dtype=torch.float64).masked_fill(hidden, -1000.0).repeat_interleave(H, 0)
    with pytest.raises(ValueError, match="attn_mask holds -1000 at key 4") as info:
        mha(x, x, x, attn_mask=mask)
    message = str(info.value)
    assert "boolean key_padding_mask" in message and "key_mask" not in message.replace("key_padding_mask", "")


@pytest.mark.parametrize("mechanism", QUERY_NORMALIZED)
def test_a_module_float_key_padding_mask_is_refused_naming_key_padding_mask(mechanism):
    # the message said "attn_mask holds -1000 ... a boolean attn_mask or key_mask": the user passed
    # key_padding_mask, and the module has no key_mask
    B, H, E = 2, 2, 16
    mha = ak.nn.MultiheadAttention(E, H, mechanism=mechanism, batch_first=True).double().eval()
    x = torch.randn(B, L, E, dtype=torch.float64)
    padding = torch.zeros(B, L, dtype=torch.float64)
    padding[1, 4:] = -1000.0
    with pytest.raises(ValueError, match=r"^key_padding_mask holds -1000 at key 4 for every query") as info:
        mha(x, x, x, key_padding_mask=padding)
    message = str(info.value)
    assert "True in a boolean key_padding_mask" in message and "-inf" in message
    assert "attn_mask" not in message and "key_mask" not in message.replace("key_padding_mask", "")
    bool_padding = padding < 0  # (B, L) True = ignore: the fix the message names
    out, w = mha(x, x, x, key_padding_mask=bool_padding)
    assert float(w.detach()[1, :, 4:].abs().max()) == 0.0


@pytest.mark.parametrize("mechanism", QUERY_NORMALIZED)
def test_graded_and_small_biases_are_kept(mechanism):
    q, k, v = _qkv()
    distance = (torch.arange(L)[:, None] - torch.arange(L)[None, :]).abs().double()  # (L, L)
    ak.attention(q, k, v, mechanism, attn_mask=-0.5 * distance)  # ALiBi
    ak.attention(q, k, v, mechanism, attn_mask=-100.0 * distance)  # far below at a distance, in steps
    relative = torch.randn(1, 1, L, L, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 3
    ak.attention(q, k, v, mechanism, attn_mask=relative)  # a relative position bias
    # ALiBi across a long cache (Lq < Lk): the far keys are 100 or more below in every row, in steps of 1
    q2, k2, v2 = _qkv(Lq=8, Lk=400)
    far = (torch.arange(8)[:, None] - torch.arange(400)[None, :]).abs().double()  # (8, 400)
    ak.attention(q2, k2, v2, mechanism, attn_mask=-far)


@pytest.mark.parametrize("mechanism", QUERY_NORMALIZED)
def test_a_key_near_its_row_largest_in_one_row_is_kept(mechanism):
    q, k, v = _qkv()
    mask = torch.zeros(L, L, dtype=torch.float64)
    mask[:, 4] = -1000.0
    mask[2, 4] = -1.0  # query 2 sees key 4
    assert constant_key_bias(build_mask(1, 1, L, L, attn_mask=mask, device=torch.device("cpu"))) is None
    ak.attention(q, k, v, mechanism, attn_mask=mask)


@pytest.mark.parametrize("fill", [-1e4, float("-inf"), torch.finfo(torch.float64).min])
@pytest.mark.parametrize("mechanism", QUERY_NORMALIZED)
def test_an_outer_product_padding_mask_that_masks_equals_key_and_query_masks(mechanism, fill):
    q, k, v = _qkv()
    out = ak.attention(q, k, v, mechanism, attn_mask=_outer_product_padding(fill))
    ref = ak.attention(q, k, v, mechanism, key_mask=REAL[None], query_mask=REAL[None])
    torch.testing.assert_close(out[..., :4, :], ref[..., :4, :])


def test_a_key_that_key_mask_hides_is_not_refused():
    q, k, v = _qkv()
    mask = torch.zeros(1, 1, 1, L, dtype=torch.float64).masked_fill(~REAL, -1000.0)  # (1, 1, 1, L)
    ak.attention(q, k, v, "dnas", attn_mask=mask, key_mask=REAL[None])  # the keys are masked already
