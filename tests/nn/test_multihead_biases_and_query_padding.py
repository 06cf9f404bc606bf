"""ak.nn.MultiheadAttention: every projection bias in its place (against torch's module), the causal mask
under add_bias_kv / add_zero_attn, and which query rows the module reads as padding (a query-normalized
mechanism leaves padded queries out of its column sums; real queries must stay in)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import attnkit as ak
import attnkit.nn as aknn
from attnkit.functional import observe_weights

E, H = 8, 2


def _randomize(module: torch.nn.Module) -> None:
    """Every parameter drawn anew: biases that start at zero (in_proj_bias, out_proj.bias) hide a swapped
    bias."""
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()


def _by_hand(module: aknn.MultiheadAttention, x: Tensor, kv: Tensor, mechanism: str, **masks) -> Tensor:
    """The module's output recomputed from its weights with ``ak.attention`` and no query mask:
    ``x (B, Lq, E)``, ``kv (B, Lk, E)`` -> ``(B, Lq, E)``."""
    B, Lq, _ = x.shape
    Lk = kv.shape[1]
    w_q, w_k, w_v = module.in_proj_weight.chunk(3)
    b_q, b_k, b_v = module.in_proj_bias.chunk(3)
    q = F.linear(x, w_q, b_q).view(B, Lq, H, E // H).transpose(1, 2)  # (B, H, Lq, D)
    k = F.linear(kv, w_k, b_k).view(B, Lk, H, E // H).transpose(1, 2)  # (B, H, Lk, D)
    v = F.linear(kv, w_v, b_v).view(B, Lk, H, E // H).transpose(1, 2)  # (B, H, Lk, D)
    out = ak.attention(q, k, v, mechanism, **masks)  # (B, H, Lq, D)
    return module.out_proj(out.transpose(1, 2).reshape(B, Lq, E))  # (B, Lq, E)



@pytest.mark.parametrize("bias_kv, zero_attn, other_dims", list(itertools.product([False, True], repeat=3)))
def test_random_biases_match_torch(bias_kv, zero_attn, other_dims):
    """A value projection that took the key's bias (b_k for b_v) matched torch only while in_proj_bias was
    zero, as it is at construction: every bias is random here."""
    torch.manual_seed(0)
    dims = dict(kdim=6, vdim=7) if other_dims else {}
    options = dict(add_bias_kv=bias_kv, add_zero_attn=zero_attn, batch_first=True, **dims)
    reference = torch.nn.MultiheadAttention(E, H, **options)
    _randomize(reference)
    module = aknn.MultiheadAttention(E, H, **options)
    module.load_state_dict(reference.state_dict())
    q = torch.randn(2, 4, E)
    k, v = torch.randn(2, 5, dims.get("kdim", E)), torch.randn(2, 5, dims.get("vdim", E))
    expected, expected_weights = reference(q, k, v)
    out, weights = module(q, k, v)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("appended", [dict(add_bias_kv=True), dict(add_zero_attn=True),
                                      dict(add_bias_kv=True, add_zero_attn=True)])
def test_is_causal_with_an_appended_key_hides_every_later_key(appended):
    """With is_causal=True, an appended key and no attn_mask, a causal mask built as triu(2) let query i see
    key i + 1 (weight 0.2 measured) and token 2's output move when token 3 changed."""
    torch.manual_seed(0)
    module = aknn.MultiheadAttention(E, H, batch_first=True, **appended)
    _randomize(module)
    L = 5
    x = torch.randn(1, L, E)
    out, weights = module(x, x, x, is_causal=True)  # weights (1, L, L + appended keys)
    later = torch.ones(L, L, dtype=torch.bool).triu(1)  # (L, L) True = a later real key
    assert weights[0, :, :L][later].abs().max() == 0
    changed = x.clone()
    changed[:, 3] += 1.0  # token 3 only
    out2, _ = module(changed, changed, changed, is_causal=True)
    torch.testing.assert_close(out2[:, :3], out[:, :3], rtol=0, atol=0)
    assert (out2[:, 3] - out[:, 3]).abs().max() > 1e-3  # the change reaches token 3 itself


def _dnas_module() -> aknn.MultiheadAttention:
    torch.manual_seed(0)
    module = aknn.MultiheadAttention(E, H, mechanism="dnas", batch_first=True).eval()
    _randomize(module)
    return module


def test_dnas_cross_attention_keeps_its_query_rows_with_a_padded_key():
    """In cross-attention (Lq == Lk) a padded key is no padded query: the queries are another sequence.
    Reading it as one zeroed query 3's output (|out| 0 instead of 0.32)."""
    module = _dnas_module()
    q, kv = torch.randn(1, 4, E), torch.randn(1, 4, E)
    pad = torch.tensor([[False, False, False, True]])  # (B, Lk) True = padded key
    out, _ = module(q, kv, kv, key_padding_mask=pad)
    torch.testing.assert_close(out, _by_hand(module, q, kv, "dnas", key_mask=~pad), rtol=1e-5, atol=1e-5)
    assert out[0, 3].abs().max() > 1e-2


def test_dnas_per_head_mask_hiding_a_key_in_one_head_keeps_that_query():
    """A (B*H, L, L) mask that hides key 3 from every query of head 0 only is no padding (head 1 sees key 3):
    reading hidden-in-any-head as padding zeroed query 3's output."""
    module = _dnas_module()
    x = torch.randn(1, 4, E)
    mask = torch.zeros(H, 4, 4, dtype=torch.bool)  # (B*H, Lq, Lk) True = not allowed
    mask[0, :, 3] = True
    out, _ = module(x, x, x, attn_mask=mask)
    expected = _by_hand(module, x, x, "dnas", attn_mask=~mask.view(1, H, 4, 4))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert out[0, 3].abs().max() > 1e-2


def test_dnas_float_key_padding_mask_of_minus_one_is_a_bias_not_padding():
    """A float key_padding_mask entry of -1 is an additive bias (padding is -inf, or at most MASKED_BIAS):
    reading every negative entry as padding zeroed query 3's output."""
    module = _dnas_module()
    x = torch.randn(1, 4, E)
    bias = torch.tensor([[0.0, 0.0, 0.0, -1.0]])  # (B, Lk)
    out, _ = module(x, x, x, key_padding_mask=bias)
    expected = _by_hand(module, x, x, "dnas", attn_mask=bias[:, None, None, :])  # (B, 1, 1, Lk)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert out[0, 3].abs().max() > 1e-2


def test_softmax_outputs_do_not_change_inside_observe_weights():
    """Inside observe_weights, softmax self-attention infers its padded queries for the observers only:
    handing them to the attention call as a query mask zeroed the padded rows of the output, so observing a
    model changed what it computed."""
    torch.manual_seed(0)
    module = aknn.MultiheadAttention(E, H, batch_first=True).eval()
    _randomize(module)
    x = torch.randn(2, 4, E)
    pad = torch.tensor([[False, False, False, True], [False, False, False, False]])  # (B, L)
    plain, _ = module(x, x, x, key_padding_mask=pad)
    seen = []
    with observe_weights(lambda weights, mask_info, config: seen.append(weights)):
        observed, _ = module(x, x, x, key_padding_mask=pad)
    assert seen and seen[0][0, :, 3].abs().max() == 0  # the observer sees query 3 as padding
    torch.testing.assert_close(observed, plain, rtol=0, atol=0)
    assert observed[0, 3].abs().max() > 1e-2  # torch's module keeps the padded query's row
