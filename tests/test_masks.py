"""``attnkit.masks``: validation of q/k/v and the combination of masks into ``MaskInfo``."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.masks import MASKED_BIAS, MaskInfo, build_mask, causal_leak_error, causal_pattern, check_qkv
from tests._reference import full_valid

B, H, Lq, Lk = 2, 3, 4, 5


def _expand(valid):
    return torch.ones(B, H, Lq, Lk, dtype=torch.bool) if valid is None else valid.expand(B, H, Lq, Lk)


def test_no_masks_give_no_valid_pattern():
    info = build_mask(B, H, Lq, Lk, device=torch.device("cpu"))
    assert isinstance(info, MaskInfo)
    assert info.valid is None and info.bias is None and not info.causal


@pytest.mark.parametrize("causal", [False, True])
def test_combined_valid_equals_every_mask_allowing_the_pair(causal):
    g = torch.Generator().manual_seed(0)
    km = torch.rand(B, Lk, generator=g) < 0.7
    qm = torch.rand(B, Lq, generator=g) < 0.7
    am = torch.rand(1, H, Lq, Lk, generator=g) < 0.7
    info = build_mask(
        B, H, Lq, Lk, key_mask=km, query_mask=qm, attn_mask=am, causal=causal, device=torch.device("cpu")
    )
    expected = full_valid(B, H, Lq, Lk, key_mask=km, query_mask=qm, attn_mask=am, causal=causal)
    assert torch.equal(_expand(info.valid), expected)
    assert info.key_mask is km and info.query_mask is qm and info.attn_mask is am and info.causal is causal


def test_causal_is_top_left_aligned_for_rectangular_shapes():
    info = build_mask(1, 1, 3, 5, causal=True, device=torch.device("cpu"))
    expected = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]], dtype=torch.bool)
    assert torch.equal(info.valid[0, 0], expected)


def test_float_attn_mask_becomes_finite_bias_and_validity():
    am = torch.tensor([[0.5, float("-inf"), -2.0, 0.0, 1.0]] * Lq)
    info = build_mask(B, H, Lq, Lk, attn_mask=am, device=torch.device("cpu"))
    assert torch.isfinite(info.bias).all()
    assert torch.equal(info.bias.expand(B, H, Lq, Lk)[1, 2, 3], torch.tensor([0.5, 0.0, -2.0, 0.0, 1.0]))
    assert torch.equal(_expand(info.valid)[0, 0, 0], torch.tensor([True, False, True, True, True]))


def test_float_attn_mask_refused_when_bias_not_allowed():
    with pytest.raises(ValueError, match="multiplicative"):
        build_mask(B, H, Lq, Lk, attn_mask=torch.zeros(Lq, Lk), device=torch.device("cpu"), allow_bias=False)


@pytest.mark.parametrize(
    "shape",
    [(Lq, Lk), (1, Lk), (Lq, 1), (H, Lq, Lk), (1, 1, Lk), (B, 1, Lq, Lk), (1, H, 1, Lk), (B, H, Lq, Lk)],
)
def test_attn_mask_broadcastable_shapes_are_accepted(shape):
    am = torch.rand(shape, generator=torch.Generator().manual_seed(1)) < 0.5
    info = build_mask(B, H, Lq, Lk, attn_mask=am, device=torch.device("cpu"))
    assert torch.equal(_expand(info.valid), am.expand(B, H, Lq, Lk))


META = torch.device("meta")
CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (
            {"key_mask": torch.ones(B, Lk + 1, dtype=torch.bool)},
            r"key_mask has shape \(2, 6\), expected \(B, Lk\) = \(2, 5\)",
        ),
        ({"key_mask": torch.ones(Lk, dtype=torch.bool)}, r"key_mask has shape \(5,\)"),
        ({"key_mask": torch.ones(B, Lk)}, r"key_mask has dtype torch.float32; expected torch.bool"),
        ({"key_mask": torch.ones(B, Lk, dtype=torch.bool, device=META)}, "key_mask is on meta"),
        ({"key_mask": [[1] * Lk] * B}, "key_mask must be a boolean torch.Tensor"),
        (
            {"query_mask": torch.ones(B, Lk, dtype=torch.bool)},
            r"query_mask has shape \(2, 5\), expected \(B, Lq\) = \(2, 4\)",
        ),
        ({"query_mask": torch.ones(B, Lq, dtype=torch.uint8)}, "query_mask has dtype torch.uint8"),
        ({"query_mask": torch.ones(B, Lq, dtype=torch.bool, device=META)}, "query_mask is on meta"),
        ({"attn_mask": torch.ones(Lq + 1, Lk, dtype=torch.bool)}, r"attn_mask has shape \(5, 5\)"),
        (
            {"attn_mask": torch.ones(B + 1, H, Lq, Lk, dtype=torch.bool)},
            r"attn_mask has shape \(3, 3, 4, 5\)",
        ),
        (
            {"attn_mask": torch.ones(1, 1, 1, Lq, Lk, dtype=torch.bool)},
            r"attn_mask has shape \(1, 1, 1, 4, 5\)",
        ),
        ({"attn_mask": torch.ones(Lq, Lk, dtype=torch.int64)}, "attn_mask has dtype torch.int64"),
        ({"attn_mask": torch.ones(Lq, Lk, dtype=torch.bool, device=META)}, "attn_mask is on meta"),
        ({"attn_mask": [[True] * Lk] * Lq}, "attn_mask must be a torch.Tensor"),
        ({"attn_mask": torch.full((Lq, Lk), float("nan"))}, "NaN"),
        ({"attn_mask": torch.full((Lq, Lk), float("inf"))}, r"\+inf"),
        ({"causal": "yes"}, "causal must be True or False"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_bad_masks_raise_value_error_naming_the_problem(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_mask(B, H, Lq, Lk, device=CPU, **kwargs)


def test_check_qkv_accepts_a_different_value_dim():
    check_qkv(torch.randn(B, H, Lq, 8), torch.randn(B, H, Lk, 8), torch.randn(B, H, Lk, 3))


def test_check_qkv_may_allow_different_head_dims():
    check_qkv(
        torch.randn(B, H, Lq, 8), torch.randn(B, H, Lk, 6), torch.randn(B, H, Lk, 3), same_head_dim=False
    )
    with pytest.raises(ValueError, match="head dims differ"):
        check_qkv(torch.randn(B, H, Lq, 8), torch.randn(B, H, Lk, 6), torch.randn(B, H, Lk, 3))


def test_check_qkv_rejects_mixed_devices():
    with pytest.raises(ValueError, match="one device"):
        check_qkv(torch.randn(B, H, Lq, 4), torch.randn(B, H, Lk, 4, device=META), torch.randn(B, H, Lk, 4))


def test_causal_leak_error_names_the_mechanism_and_the_fix():
    err = causal_leak_error("dnas")
    assert isinstance(err, ValueError)
    assert "'dnas'" in str(err) and "leak" in str(err) and "softmax" in str(err)


@pytest.mark.parametrize("blocked", [float("-inf"), -1e9, -1e4, torch.finfo(torch.float32).min])
def test_float_mask_entries_at_or_below_masked_bias_may_not_attend(blocked):
    am = torch.tensor([[0.5, blocked, -2.0, -9999.0, 1.0]] * Lq)
    info = build_mask(B, H, Lq, Lk, attn_mask=am, device=torch.device("cpu"))
    assert blocked <= MASKED_BIAS < -9999.0
    assert torch.equal(_expand(info.valid)[1, 2, 3], torch.tensor([True, False, True, True, True]))
    assert torch.equal(info.bias.expand(B, H, Lq, Lk)[0, 0, 0], torch.tensor([0.5, 0.0, -2.0, -9999.0, 1.0]))


def _pattern(pair, Lq_=4, Lk_=4):
    return causal_pattern(build_mask(2, 1, Lq_, Lk_, attn_mask=pair, device=torch.device("cpu")))


def test_causal_pattern_finds_causal_masks_with_padding_windows_and_bottom_right_alignment():
    tril = torch.ones(4, 4, dtype=torch.bool).tril()
    lengths = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    padded = tril & lengths[:, None, None, :]  # (2, 1, 4, 4)
    window = tril & ~torch.ones(4, 4, dtype=torch.bool).tril(-2)  # sees itself and the key before
    assert _pattern(tril) and _pattern(padded) and _pattern(window)
    assert _pattern(torch.ones(2, 5, dtype=torch.bool).tril(3), 2, 5)  # the last 2 of 5 positions as queries
    assert _pattern(torch.zeros(4, 4).masked_fill(~tril, float("-inf")))  # torch's float causal mask
    # strictly causal (query i sees keys j < i): query 2 sees keys 0 and 1, which later queries see too
    assert _pattern(torch.ones(4, 4, dtype=torch.bool).tril(-1))


def test_causal_pattern_spares_masks_through_which_nothing_can_leak():
    only_key_0 = torch.zeros(4, 4, dtype=torch.bool)
    only_key_0[:, 0] = True
    sees_a_later_key = torch.ones(4, 4, dtype=torch.bool).tril()
    sees_a_later_key[1, 3] = True
    assert not _pattern(torch.eye(4, dtype=torch.bool))  # each query sees only itself
    assert not _pattern(only_key_0)  # no query sees itself and an earlier key
    assert not _pattern(sees_a_later_key)
    assert not _pattern(torch.ones(1, 4, dtype=torch.bool).tril(0)[:, :4])  # one row broadcast
    assert not _pattern(torch.ones(1, 4, dtype=torch.bool), 1, 4)  # a single query


def test_a_key_padding_pattern_is_not_causal_in_rectangular_cross_attention():
    """Every query sees the same 7 of 10 keys: aligned bottom-right (offset 6) no query sees a later key,
    yet nothing can leak; it was refused, and accepted once an unpadded example joined the batch."""
    keys = torch.arange(10) < 7
    assert not _pattern(keys.expand(4, 10), 4, 10)
    both = torch.stack([keys, torch.ones(10, dtype=torch.bool)])[:, None, None, :].expand(2, 1, 4, 10)
    assert not _pattern(both, 4, 10)
    assert _pattern(torch.ones(4, 10, dtype=torch.bool).tril(6), 4, 10)  # a causal pattern, bottom-right
    queries = torch.tensor([True, True, True, False])  # and a padded query, whose row sees nothing
    assert not _pattern(queries[:, None] & keys, 4, 10)


def test_a_causal_example_is_found_beside_a_bidirectional_one():
    """A causal mask batched with a prefix-LM one was accepted (the batch had a query seeing a later key),
    and the causal example's earlier outputs moved by 0.68 with its last query."""
    causal = torch.ones(4, 4, dtype=torch.bool).tril()
    prefix = causal.clone()
    prefix[:2, :2] = True  # the first two positions see each other
    assert _pattern(torch.stack([causal, prefix])[:, None])
    assert not _pattern(torch.stack([torch.ones(4, 4, dtype=torch.bool)] * 2)[:, None])
    # right to left (a backward LM): query i sees the keys after it, whose columns later-in-that-order
    # queries share; it leaked 0.37 through dnas (accepted as "not causal" before)
    assert _pattern(torch.stack([causal.T, torch.ones(4, 4, dtype=torch.bool)])[:, None])


def _prefix_lm(L: int, P: int) -> torch.Tensor:
    mask = torch.ones(L, L, dtype=torch.bool).tril()
    mask[:P, :P] = True  # the prefix sees itself both ways
    return mask


def test_a_prefix_lm_pattern_is_causal_also_with_padding_and_as_a_float_mask():
    """A bidirectional prefix and a causal suffix (T5, UniLM, GLM) was accepted: dnas outputs at positions
    0-4 moved by up to 0.33 when only the query at position 5 changed."""
    prefix = _prefix_lm(6, 3)
    assert _pattern(prefix, 6, 6)
    assert _pattern(_prefix_lm(6, 4), 6, 6)  # two generated positions
    # one, which the prefix shares keys with (the second look found it accepted by a version that took a
    # position no other query sees for padding: the first decoding step of a prefix LM leaked 0.48)
    assert _pattern(_prefix_lm(6, 5), 6, 6)
    assert _pattern(torch.zeros(6, 6).masked_fill(~prefix, float("-inf")), 6, 6)
    keys = torch.arange(6) < 5  # the last position is padding; its row sees the real keys (Hugging Face)
    assert _pattern(prefix & keys, 6, 6)
    assert _pattern((prefix & keys) & keys[:, None], 6, 6)  # and with its row hidden too


def test_bidirectional_patterns_with_padding_windows_blocks_or_registers_are_not_prefix_lm():
    L = 8
    keys = torch.arange(L) < 5  # 3 padded positions whose rows see the real keys (Hugging Face's 4-d mask)
    window = (torch.arange(L)[:, None] - torch.arange(L)[None, :]).abs() <= 2
    blocks = torch.block_diag(torch.ones(5, 5), torch.ones(2, 2), torch.ones(1, 1)).bool()  # packed sequences
    registers = torch.ones(L, L, dtype=torch.bool)
    registers[:2] = False
    registers[0, 0] = registers[1, 1] = True  # two register tokens that see only themselves
    two_pads = torch.ones(L, L, dtype=torch.bool)
    two_pads[:-2, -2:] = False  # two padded positions whose rows see every key (rows unmasked against NaN)
    for mask in (keys.expand(L, L), window & keys, window, blocks, registers, torch.eye(L, dtype=torch.bool),
                 two_pads):
        assert not _pattern(mask, L, L), mask.int()


def test_an_expanded_causal_mask_is_found_and_a_bidirectional_one_is_not():
    causal = torch.ones(256, 256, dtype=torch.bool).tril().expand(8, 4, 256, 256)  # read example by example
    assert causal_pattern(build_mask(8, 4, 256, 256, attn_mask=causal, device=torch.device("cpu")))
    both = torch.ones(8, 4, 256, 256, dtype=torch.bool)
    assert not causal_pattern(build_mask(8, 4, 256, 256, attn_mask=both, device=torch.device("cpu")))


@pytest.mark.parametrize("masked", [-1000.0, -9999.0, -100.0])
def test_a_causal_float_mask_of_finite_large_negatives_is_refused_for_query_normalized_mechanisms(masked):
    # -1000 above the strict diagonal hides the future from softmax as -inf does, and leaked it through dnas
    q, k, v = (torch.randn(1, 1, 6, 4, dtype=torch.float64) for _ in range(3))
    future = torch.ones(6, 6, dtype=torch.bool).triu(1)
    bias = torch.zeros(6, 6, dtype=torch.float64).masked_fill(future, masked)
    with pytest.raises(ValueError, match="causal pattern"):
        ak.attention(q, k, v, "dnas", attn_mask=bias)
    ak.attention(q, k, v, "softmax", attn_mask=bias)
    with pytest.raises(ValueError, match="causal pattern"):  # right to left: an order all the same
        ak.attention(q, k, v, "dnas", attn_mask=bias.T.contiguous())
    soft = torch.full((6, 6), -50.0, dtype=torch.float64).triu(1)  # a soft bias, not a mask: kept
    ak.attention(q, k, v, "dnas", attn_mask=soft)


def test_graded_biases_far_below_zero_are_not_read_as_a_causal_mask():
    # ALiBi at long distances reaches below -100 without meaning "may not attend": with Lq < Lk its pattern
    # looked causal aligned bottom-right and every call was refused
    q, k, v = torch.randn(1, 1, 8, 4), torch.randn(1, 1, 400, 4), torch.randn(1, 1, 400, 4)
    distance = (torch.arange(8)[:, None] - torch.arange(400)[None, :]).abs().float()
    ak.attention(q, k, v, "dnas", attn_mask=-distance)  # accepted
    future = torch.ones(8, 400, dtype=torch.bool).triu(393)  # bottom-right causal, as a KV cache's mask
    with pytest.raises(ValueError, match="causal pattern"):
        ak.attention(q, k, v, "dnas", attn_mask=torch.zeros(8, 400).masked_fill(future, torch.finfo().min))
    # a causal fill of -1000 with a graded bias on top (ALiBi in a decoder) is a causal mask all the same
    q, k, v = (torch.randn(1, 1, 6, 4) for _ in range(3))
    distance = (torch.arange(6)[:, None] - torch.arange(6)[None, :]).abs().float()
    causal = torch.zeros(6, 6).masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), -1000.0)
    with pytest.raises(ValueError, match="causal pattern"):
        ak.attention(q, k, v, "dnas", attn_mask=causal - 0.5 * distance)


QUERY_NORMALIZED = ["dnas", "hnas", "sinkhorn"]


@pytest.mark.parametrize("fill", [-1000.0, -5000.0])
@pytest.mark.parametrize("mechanism", QUERY_NORMALIZED)
def test_a_bottom_right_causal_float_mask_with_a_finite_fill_is_refused_for_query_normalized_mechanisms(
    mechanism, fill
):
    # a KV cache's chunked prefill (Lq < Lk, the last Lq positions as queries) with a fill above -1e4 leaked
    # the later queries into the earlier outputs: the soft rule was applied to the top-left alignment only
    q, k, v = torch.randn(1, 1, 4, 4), torch.randn(1, 1, 8, 4), torch.randn(1, 1, 8, 4)
    future = torch.ones(4, 8, dtype=torch.bool).triu(8 - 4 + 1)
    bias = torch.zeros(4, 8).masked_fill(future, fill)
    assert causal_pattern(build_mask(1, 1, 4, 8, attn_mask=bias, device=torch.device("cpu")))
    with pytest.raises(ValueError, match="causal pattern"):
        ak.attention(q, k, v, mechanism, attn_mask=bias)
    ak.attention(q, k, v, "softmax", attn_mask=bias)  # softmax does not leak: kept


@pytest.mark.parametrize("fill", [-1000.0, -5000.0, -9999.0])
@pytest.mark.parametrize("shape", ["(B,1,1,Lk)", "(Lq,Lk)"])
@pytest.mark.parametrize("mechanism", QUERY_NORMALIZED)
def test_a_per_key_bias_that_the_column_normalization_cancels_is_refused(mechanism, shape, fill):
    # -1000 at padded keys, the same for every query: dnas gave the 2 padded keys 1.949 of 6 rows' weight
    q, k, v = (torch.randn(1, 1, 6, 4) for _ in range(3))
    keep = torch.tensor([True, True, True, True, False, False])
    bias = torch.zeros(1, 1, 1, 6).masked_fill(~keep, fill)
    if shape == "(Lq,Lk)":
        bias = bias[0, 0].expand(6, 6).clone()  # the same bias in every row
    with pytest.raises(ValueError, match=rf"{fill:g} at key 4 for every query.*-inf.*key_mask"):
        ak.attention(q, k, v, mechanism, attn_mask=bias)
    with pytest.raises(ValueError, match="normalizes over queries"):
        ak.normalize(ak.scores.scaled_dot(q, k), mechanism, attn_mask=bias)
    ak.attention(q, k, v, "softmax", attn_mask=bias)  # softmax keeps it as the bias it is
    ak.attention(q, k, v, ak.Sinkhorn(iters=0), attn_mask=bias)  # softmax too


@pytest.mark.parametrize("mechanism", QUERY_NORMALIZED)
def test_biases_that_vary_over_queries_or_are_small_are_kept_for_query_normalized_mechanisms(mechanism):
    q, k, v = (torch.randn(1, 1, 6, 4, dtype=torch.float64) for _ in range(3))
    distance = (torch.arange(6)[:, None] - torch.arange(6)[None, :]).abs().double()
    ak.attention(q, k, v, mechanism, attn_mask=-100.0 * distance)  # ALiBi-like, far below at a distance
    small = torch.zeros(1, 1, 1, 6, dtype=torch.float64).masked_fill(torch.arange(6) >= 4, -50.0)
    out = ak.attention(q, k, v, "dnas", attn_mask=small)  # a per-key bias of |b| < 100: a no-op for dnas
    torch.testing.assert_close(out, ak.attention(q, k, v, "dnas"))


def test_a_batch_size_mismatch_names_the_fix():
    q, k = torch.randn(2, 1, 3, 4), torch.randn(1, 1, 3, 4)
    with pytest.raises(ValueError, match=r"B=2, k has B=1, v has B=1; .*k\.expand\(2, -1, -1, -1\)"):
        check_qkv(q, k, k)
    with pytest.raises(ValueError, match="batch sizes differ.*one key/value sequence per query sequence"):
        check_qkv(torch.randn(3, 1, 3, 4), q, q)


def _block_causal(L: int, chunk: int) -> torch.Tensor:
    blocks = torch.ones(L // chunk, L // chunk, dtype=torch.bool).tril()
    return blocks.repeat_interleave(chunk, 0).repeat_interleave(chunk, 1)  # (L, L)


@pytest.mark.parametrize("mechanism", ["dnas", "hnas", "sinkhorn"])
def test_block_causal_permuted_and_right_to_left_orders_are_refused_where_they_leak(mechanism):
    """Chunks that see themselves and the chunks before (streaming, semi-autoregressive decoders), an XLNet
    permutation order and a right-to-left order were accepted: editing token 5 moved chunk 0's dnas outputs by
    0.51 (softmax's by 0)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 1, 6, 8) for _ in range(3))
    block = _block_causal(6, 2)
    q2 = q.clone()
    q2[..., 5, :] += 3.0
    moved = (ak.attention(q2, k, v, "softmax", attn_mask=block)
             - ak.attention(q, k, v, "softmax", attn_mask=block))
    assert moved[..., :2, :].abs().max() == 0  # softmax: chunk 0 does not see token 5, nothing leaks
    rank = torch.empty(6, dtype=torch.long)
    rank[torch.tensor([2, 0, 4, 1, 5, 3])] = torch.arange(6)
    permuted = rank[None, :] <= rank[:, None]  # query i sees key j iff j comes no later in the order
    right_to_left = torch.ones(6, 6, dtype=torch.bool).triu()
    for pattern in (block, block.float().log(), permuted, right_to_left, _block_causal(12, 3)):
        n = pattern.shape[-1]
        with pytest.raises(ValueError, match="causal pattern"):
            ak.attention(*(torch.randn(1, 1, n, 8) for _ in range(3)), mechanism, attn_mask=pattern)
        ak.attention(*(torch.randn(1, 1, n, 8) for _ in range(3)), "softmax", attn_mask=pattern)
    # padding merged into a block-causal mask (Hugging Face's 4-D form) is judged on the real tokens
    padded = _block_causal(8, 2) & torch.tensor([True] * 6 + [False] * 2)
    with pytest.raises(ValueError, match="causal pattern"):
        ak.attention(*(torch.randn(1, 1, 8, 8) for _ in range(3)), mechanism, attn_mask=padded)


def test_orders_of_two_key_sets_and_hidden_pairs_are_not_read_as_orders():
    """What the order rule leaves alone: a bidirectional block and a block that sees it and itself (global
    or register tokens), one pair hidden in a bidirectional mask, a window, two blocks of packed sequences."""
    two_blocks = _block_causal(6, 3)
    hidden_pair = torch.ones(6, 6, dtype=torch.bool)
    hidden_pair[0, 1] = False
    i = torch.arange(6)
    window = (i[:, None] - i[None, :]).abs() <= 1
    packed = torch.block_diag(torch.ones(3, 3), torch.ones(3, 3)).bool()
    for pattern in (two_blocks, hidden_pair, window, packed):
        assert not _pattern(pattern, 6, 6), pattern.int()
    # packed sequences whose padded rows see every key (Hugging Face's unmasking of empty rows against NaN):
    # refused by a check of the second look, reverted
    seg = torch.tensor([1, 1, 2, 2, 2, 3, 3, 3, 3, 0, 0, 0])
    unmasked = (seg[:, None] == seg[None, :]) & (seg[None, :] > 0)
    unmasked[~unmasked.any(-1)] = True
    assert not _pattern(unmasked, 12, 12), unmasked.int()
