"""The causal-pattern check (``attnkit.masks.causal_pattern``) judges each example on its real block: the
verdict does not depend on whether the padding comes as ``key_mask`` / ``query_mask`` or merged into
``attn_mask`` (as Hugging Face builds 4-D masks, or ``MultiheadAttention`` merges a float
``key_padding_mask``), and causal masks with padding are refused either way."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.masks import build_mask, causal_pattern

QUERY_NORMALIZED = ["dnas", "hnas", "sinkhorn"]
CPU = torch.device("cpu")


def _qkv(B, Lq, Lk, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 1, Lq, 4, generator=g), torch.randn(B, 1, Lk, 4, generator=g), \
        torch.randn(B, 1, Lk, 4, generator=g)


def test_random_bidirectional_masks_get_the_same_verdict_with_padding_merged_or_separate():
    """With one short example, 0 of 300 random masks were refused with key_mask / query_mask and 11 with
    the same padding merged into the 4-D attn_mask."""
    gen = torch.Generator().manual_seed(0)
    B, L = 2, 6
    km = torch.ones(B, L, dtype=torch.bool)
    km[1, 3:] = False
    for _ in range(300):
        am = torch.rand(L, L, generator=gen) > 0.25
        am.fill_diagonal_(True)
        separate = causal_pattern(
            build_mask(B, 1, L, L, attn_mask=am, key_mask=km, query_mask=km, device=CPU))
        merged = causal_pattern(build_mask(
            B, 1, L, L, attn_mask=am[None, None] & km[:, None, None, :] & km[:, None, :, None], device=CPU))
        keys_only = causal_pattern(build_mask(B, 1, L, L, attn_mask=am, key_mask=km, device=CPU))
        keys_merged = causal_pattern(build_mask(B, 1, L, L, attn_mask=am[None, None] & km[:, None, None, :],
                                                device=CPU))
        assert separate == merged and keys_only == keys_merged, am.int()


@pytest.mark.parametrize("mechanism", QUERY_NORMALIZED)
def test_a_hidden_pair_with_key_padding_merged_into_attn_mask_is_not_causal(mechanism):
    # self-attention: token 0 may not see token 1, but sees tokens 2 and 3 (example 0); example 1 has 2 tokens
    q, k, v = _qkv(2, 4, 4)
    km = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    pair = torch.ones(4, 4, dtype=torch.bool)
    pair[0, 1] = False
    merged = pair[None, None] & km[:, None, None, :]  # (B, 1, L, L), as Hugging Face builds it
    out = ak.attention(q, k, v, mechanism, attn_mask=merged)
    torch.testing.assert_close(out, ak.attention(q, k, v, mechanism, attn_mask=pair, key_mask=km))
    # cross-attention (Lq < Lk): query 0 may not see source token 2; example 1 has 3 source tokens
    q, k, v = _qkv(2, 4, 8)
    km = torch.ones(2, 8, dtype=torch.bool)
    km[1, 3:] = False
    pair = torch.ones(4, 8, dtype=torch.bool)
    pair[0, 2] = False
    ak.attention(q, k, v, mechanism, attn_mask=pair[None, None] & km[:, None, None, :])


def test_a_float_key_padding_mask_with_a_bias_is_accepted_as_a_boolean_one_is():
    torch.manual_seed(0)
    m = ak.nn.MultiheadAttention(4, 1, batch_first=True, mechanism="dnas")
    x, mem = torch.randn(2, 4, 4), torch.randn(2, 8, 4)
    pad = torch.zeros(2, 8, dtype=torch.bool)
    pad[1, 3:] = True  # example 1: 3 source tokens
    am = torch.zeros(4, 8, dtype=torch.bool)
    am[0, 2] = True  # query 0 may not attend source token 2
    m(x, mem, mem, key_padding_mask=pad, attn_mask=am)
    m(x, mem, mem, key_padding_mask=torch.full((2, 8), 0.5).masked_fill(pad, float("-inf")), attn_mask=am)


@pytest.mark.parametrize("mechanism", QUERY_NORMALIZED)
def test_normalize_with_key_mask_and_a_masked_score_is_not_causal(mechanism):
    s = torch.randn(2, 1, 3, 4, generator=torch.Generator().manual_seed(0))
    s[:, :, 1, 0] = float("-inf")  # query 1 may not see key 0; query 0 sees key 1 after it
    km = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    w = ak.normalize(s, mechanism, key_mask=km)
    merged = s.masked_fill(~km[:, None, None, :], float("-inf"))  # the padding as -inf scores
    torch.testing.assert_close(w, ak.normalize(merged, mechanism))


def _causal_cases():
    tril = torch.ones(4, 4, dtype=torch.bool).tril()
    right = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    left = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1]], dtype=torch.bool)
    bottom_right = torch.ones(4, 8, dtype=torch.bool).tril(4)  # the last 4 of 8 positions as queries
    keys_left = torch.tensor([[1] * 8, [0, 0] + [1] * 6], dtype=torch.bool)
    keys_right = torch.tensor([[1] * 8, [1] * 6 + [0, 0]], dtype=torch.bool)
    return {  # (attn_mask, key_mask, query_mask)
        "right padding": (tril, right, None),
        "right padding, queries too": (tril, right, right),
        "left padding": (tril, left, left),
        "strictly causal, padded": (torch.ones(4, 4, dtype=torch.bool).tril(-1), right, None),
        "bottom-right, left-padded keys": (bottom_right, keys_left, None),
        "bottom-right, right-padded keys": (bottom_right, keys_right, None),
    }


@pytest.mark.parametrize("case", list(_causal_cases()))
@pytest.mark.parametrize("merged", [False, True], ids=["separate", "merged"])
def test_causal_masks_with_padding_are_refused_however_the_padding_is_spelled(case, merged):
    am, km, qm = _causal_cases()[case]
    Lq, Lk = am.shape
    q, k, v = _qkv(2, Lq, Lk)
    if merged:
        am = am[None, None] & km[:, None, None, :]
        if qm is not None:
            am = am & qm[:, None, :, None]
        kwargs = dict(attn_mask=am)
    else:
        kwargs = dict(attn_mask=am, key_mask=km, query_mask=qm)
    with pytest.raises(ValueError, match="causal pattern"):
        ak.attention(q, k, v, "dnas", **kwargs)
    ak.attention(q, k, v, "softmax", **kwargs)
