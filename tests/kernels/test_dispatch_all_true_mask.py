"""``kernels/dispatch.py``: an all-True boolean ``attn_mask`` counts as none, so the call takes the route of
an unmasked (or padded) one (README: "all-True masks count as none")."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from tests._reference import random_qkv

L = 256
ALL_TRUE = torch.ones(L, L, dtype=torch.bool)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("mechanism", ["softmax", "dnas", "hnas", "sinkhorn", "coda"])
def test_an_all_true_bool_attn_mask_takes_the_route_of_no_mask(mechanism, padded):
    # dnas with torch.ones(256, 256, dtype=torch.bool) went to blockwise, not cpp (2.5x slower at L=1024)
    q, k, v = random_qkv(2, 2, L, L, seed=0, dtype=torch.float32)
    key_mask = torch.arange(L)[None, :] < torch.tensor([L, L // 2])[:, None] if padded else None  # (2, L)
    none = ak.explain_dispatch(q, k, v, mechanism, key_mask=key_mask)
    for mask in (ALL_TRUE, ALL_TRUE.expand(2, 2, L, L)):
        assert ak.explain_dispatch(q, k, v, mechanism, key_mask=key_mask, attn_mask=mask) == none
    one_false = ALL_TRUE.clone()
    one_false[3, 5] = False
    masked = ak.explain_dispatch(q, k, v, mechanism, key_mask=key_mask, attn_mask=one_false)
    if mechanism in ("dnas", "hnas", "sinkhorn"):
        assert masked.route == "blockwise"  # a real attn_mask still takes a route that applies it


def test_an_all_true_bool_attn_mask_beside_causal_takes_sdpa_for_softmax_and_gives_its_output():
    q, k, v = random_qkv(1, 2, L, L, seed=1, dtype=torch.float32)
    plan = ak.explain_dispatch(q, k, v, "softmax", attn_mask=ALL_TRUE, causal=True)
    assert plan.route == ak.explain_dispatch(q, k, v, "softmax", causal=True).route == "sdpa"
    out = ak.attention(q, k, v, "softmax", attn_mask=ALL_TRUE, causal=True)
    torch.testing.assert_close(out, ak.attention(q, k, v, "softmax", causal=True, backend="reference"))


@pytest.mark.parametrize("mechanism", ["dnas", "sinkhorn"])
def test_an_all_true_bool_attn_mask_gives_the_unmasked_output(mechanism):
    q, k, v = random_qkv(1, 2, L, L, seed=2, dtype=torch.float32)
    out = ak.attention(q, k, v, mechanism, attn_mask=ALL_TRUE)
    torch.testing.assert_close(out, ak.attention(q, k, v, mechanism, backend="reference"))


@pytest.mark.parametrize("masks", ["all-True key and query masks", "its own causal attn_mask",
                                   "a looser attn_mask"])
def test_causal_with_a_mask_that_hides_nothing_more_takes_sdpa_and_gives_its_output(masks):
    """A collate's all-False key_padding_mask beside is_causal, and torch's own causal form (the causal
    attn_mask plus is_causal, as TransformerDecoderLayer(tgt_mask=..., tgt_is_causal=True) passes it), went
    to the blockwise route: the same output at 1.5-3.8x SDPA's time."""
    q, k, v = random_qkv(2, 2, L, L, seed=3, dtype=torch.float32)
    kwargs = {
        "all-True key and query masks": {"key_mask": torch.ones(2, L, dtype=torch.bool),
                                         "query_mask": torch.ones(2, L, dtype=torch.bool)},
        "its own causal attn_mask": {"attn_mask": torch.ones(L, L, dtype=torch.bool).tril()},
        "a looser attn_mask": {"attn_mask": torch.ones(L, L, dtype=torch.bool).tril(5)},
    }[masks]
    assert ak.explain_dispatch(q, k, v, "softmax", causal=True, **kwargs).route == "sdpa"
    out = ak.attention(q, k, v, "softmax", causal=True, **kwargs)
    torch.testing.assert_close(out, ak.attention(q, k, v, "softmax", causal=True, backend="reference"))


def test_causal_with_a_mask_that_hides_a_visible_pair_keeps_it():
    q, k, v = random_qkv(2, 2, L, L, seed=4, dtype=torch.float32)
    pair = torch.ones(L, L, dtype=torch.bool).tril()
    pair[7, 3] = False  # below the diagonal: causal alone would show it
    key_mask = torch.ones(2, L, dtype=torch.bool)
    key_mask[1, 200:] = False
    for kwargs in ({"attn_mask": pair}, {"key_mask": key_mask}):
        assert ak.explain_dispatch(q, k, v, "softmax", causal=True, **kwargs).route != "sdpa"
        out = ak.attention(q, k, v, "softmax", causal=True, **kwargs)
        reference = ak.attention(q, k, v, "softmax", causal=True, backend="reference", **kwargs)
        torch.testing.assert_close(out, reference)


@pytest.mark.parametrize("Lq, Lk, hidden", [(6, 6, "diagonal"), (6, 4, [(2, 2), (3, 3)])])
def test_causal_with_a_mask_that_hides_the_diagonal_keeps_it(Lq, Lk, hidden):
    """A strictly causal mask (the diagonal hidden too) and, with Lq > Lk, a mask hiding diagonal pairs were
    not told apart from a redundant causal mask by any test (a check off by one diagonal sent them to SDPA:
    1.47 and 0.77 off the reference)."""
    q, k, v = random_qkv(1, 2, Lq, Lk, seed=5, dtype=torch.float64)
    pair = torch.ones(Lq, Lk, dtype=torch.bool)
    if hidden == "diagonal":
        pair = pair.tril(-1)
        pair[0, 0] = True  # the first query keeps a key
    else:
        for i, j in hidden:
            pair[i, j] = False
    masks = dict(causal=True, attn_mask=pair)
    assert ak.explain_dispatch(q, k, v, "softmax", backend="efficient", **masks).route != "sdpa"
    out = ak.attention(q, k, v, "softmax", backend="efficient", **masks)
    reference = ak.attention(q, k, v, "softmax", backend="reference", **masks)
    torch.testing.assert_close(out, reference, rtol=1e-12, atol=1e-12)
