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
