"""attnkit.hf.attention_interface: the AttentionInterface / AttentionMaskInterface entries against float64
references."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

import attnkit as ak
from attnkit.hf import attention_forward, attention_mask, register
from attnkit.hf.attention_interface import IMPLEMENTATION

pytestmark = pytest.mark.hf


def _module(mechanism, H=3, causal=False, theta=None):
    m = nn.Module()
    m.is_causal = causal
    m.attnkit_mechanism = ak.resolve_mechanism(mechanism)
    m.attnkit_self_attention = True
    if theta is not None:
        m.attnkit_theta = nn.Parameter(theta)
    return m


def _padding_mask(lengths, L):
    """transformers' key-only boolean mask (B, 1, L, L) for right padding, built by the registered
    function."""
    from transformers.masking_utils import bidirectional_mask_function

    pad = torch.zeros(len(lengths), L, dtype=torch.bool)
    for b, n in enumerate(lengths):
        pad[b, :n] = True
    mask = attention_mask(len(lengths), L, L, mask_function=bidirectional_mask_function, attention_mask=pad)
    return mask, pad


def _dnas_reference(s, valid):
    """pi_ij = softmax_j(s_ij - c_j), c_j = LSE over valid queries i; invalid pairs weigh 0 (float64)."""
    neg = torch.finfo(s.dtype).min
    c = torch.logsumexp(s.masked_fill(~valid, neg), dim=-2, keepdim=True)  # (B, H, 1, Lk)
    t = (s - c).masked_fill(~valid, neg)
    return torch.softmax(t, dim=-1) * valid


def test_registration_adds_both_registries():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    register()
    assert AttentionInterface._global_mapping[IMPLEMENTATION] is attention_forward
    assert AttentionMaskInterface._global_mapping[IMPLEMENTATION] is attention_mask


def test_mask_is_boolean_key_padding_passed_straight_through():
    mask, pad = _padding_mask((4, 2), 4)
    assert mask.dtype == torch.bool and mask.shape == (2, 4)  # (B, Lk): no (Lq, Lk) mask to rebuild per layer
    assert torch.equal(mask, pad)


def test_key_padding_and_its_4d_form_give_the_same_output():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 4, 4, dtype=torch.float64) for _ in range(3))
    mask, pad = _padding_mask((4, 2), 4)
    for name in ("softmax", "dnas"):
        out, _ = attention_forward(_module(name), q, k, v, mask, scaling=0.5)
        out4, _ = attention_forward(
            _module(name), q, k, v, pad[:, None, None, :].expand(2, 1, 4, 4), scaling=0.5
        )
        torch.testing.assert_close(out, out4)


def test_a_float_mask_of_zeros_and_finfo_min_is_the_boolean_mask():
    # transformers' eager masks: 0 = attend, finfo.min = padding; dnas then keeps padded queries out too.
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 4, 4, dtype=torch.float64) for _ in range(3))
    mask, pad = _padding_mask((4, 2), 4)
    additive = torch.zeros(2, 1, 4, 4, dtype=torch.float64).masked_fill(
        ~pad[:, None, None, :], torch.finfo(torch.float64).min
    )
    for name in ("softmax", "dnas", "sinkhorn"):
        out, _ = attention_forward(_module(name), q, k, v, mask, scaling=0.5)
        out_float, _ = attention_forward(_module(name), q, k, v, additive, scaling=0.5)
        torch.testing.assert_close(out_float, out, atol=1e-12, rtol=0)


def test_coda_reads_a_padding_mask_that_requires_grad_as_the_padding_it_is():
    """A float mask of 0 and finfo.min that requires grad is kept as a bias (for the gradient of learned
    tables); CoDA, which takes no bias, refused it as "a float score bias" though the same mask without
    requires_grad ran."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 4, 4, dtype=torch.float64) for _ in range(3))
    mask, pad = _padding_mask((4, 2), 4)
    additive = torch.zeros(2, 1, 4, 4, dtype=torch.float64).masked_fill(
        ~pad[:, None, None, :], torch.finfo(torch.float64).min
    )
    out, _ = attention_forward(_module("coda"), q, k, v, mask, scaling=0.5)
    out_grad, _ = attention_forward(_module("coda"), q, k, v, additive.requires_grad_(), scaling=0.5)
    torch.testing.assert_close(out_grad, out, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="CoDA cannot take"):  # a bias of other values still is one
        attention_forward(_module("coda"), q, k, v, (additive.detach() + 0.5).requires_grad_(), scaling=0.5)


def test_causal_mask_is_always_materialized():
    from transformers.masking_utils import causal_mask_function

    mask = attention_mask(2, 5, 5, mask_function=causal_mask_function, attention_mask=None)
    assert mask is not None and torch.equal(mask[0, 0], torch.ones(5, 5, dtype=torch.bool).tril())


def test_dnas_padded_queries_stay_out_of_column_sums():
    torch.manual_seed(0)
    B, H, L, D = 2, 3, 5, 4
    q, k, v = (torch.randn(B, H, L, D, dtype=torch.float64) for _ in range(3))
    mask, pad = _padding_mask((5, 3), L)
    out, _ = attention_forward(_module("dnas"), q, k, v, mask, scaling=0.5)
    assert out.shape == (B, L, H, D)
    valid = pad[:, None, :, None] & pad[:, None, None, :]  # (B, 1, L, L): padded queries invalid too
    expected = _dnas_reference(0.5 * q @ k.transpose(-1, -2), valid) @ v  # (B, H, L, D)
    torch.testing.assert_close(out.transpose(1, 2), expected, atol=1e-12, rtol=0)


def test_hnas_uses_per_head_sigmoid_theta():
    torch.manual_seed(1)
    B, H, L, D = 2, 3, 4, 4
    q, k, v = (torch.randn(B, H, L, D, dtype=torch.float64) for _ in range(3))
    mask, pad = _padding_mask((4, 3), L)
    theta = torch.tensor([-2.0, 0.0, 1.5], dtype=torch.float64)
    out, _ = attention_forward(_module("hnas", theta=theta), q, k, v, mask, scaling=0.5)
    valid = pad[:, None, :, None] & pad[:, None, None, :]
    s = 0.5 * q @ k.transpose(-1, -2)
    u = torch.sigmoid(theta)[None, :, None, None]
    soft = torch.softmax(s.masked_fill(~pad[:, None, None, :], float("-inf")), dim=-1)
    expected = (u * _dnas_reference(s, valid) + (1 - u) * soft) @ v
    real = pad[:, :, None, None]  # (B, L, 1, 1): padded queries of hnas are zeroed
    torch.testing.assert_close(out * real, expected.transpose(1, 2) * real, atol=1e-12, rtol=0)


def test_grouped_query_heads_are_repeated():
    torch.manual_seed(2)
    q = torch.randn(1, 4, 3, 2, dtype=torch.float64)
    k, v = torch.randn(1, 2, 3, 2, dtype=torch.float64), torch.randn(1, 2, 3, 2, dtype=torch.float64)
    out, _ = attention_forward(_module("softmax"), q, k, v, None, scaling=1.0)
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    expected = torch.softmax(q @ kk.transpose(-1, -2), dim=-1) @ vv  # (1, 4, 3, 2)
    torch.testing.assert_close(out, expected.transpose(1, 2), atol=1e-12, rtol=0)


@pytest.mark.parametrize("mechanism", ["dnas", "hnas", "sinkhorn"])
def test_causal_module_with_query_normalized_mechanism_raises(mechanism):
    q = torch.randn(1, 3, 4, 2)
    theta = torch.zeros(3) if mechanism == "hnas" else None
    with pytest.raises(ValueError, match="leak"):
        attention_forward(_module(mechanism, causal=True, theta=theta), q, q, q, None)


def test_float_additive_mask_is_accepted():
    torch.manual_seed(3)
    q = torch.randn(1, 2, 3, 4, dtype=torch.float64)
    bias = torch.tensor([0.0, 0.0, float("-inf")], dtype=torch.float64).expand(1, 1, 3, 3)
    out, _ = attention_forward(_module("softmax"), q, q, q, bias, scaling=0.5)
    expected = torch.softmax(0.5 * q @ q.transpose(-1, -2) + bias, dim=-1) @ q
    torch.testing.assert_close(out, expected.transpose(1, 2), atol=1e-12, rtol=0)


def test_a_cached_self_attention_query_is_the_last_position_of_the_key_padding():
    """With a cache the ``Lq`` queries are the last ``Lq`` keys: a left-padded row's one new query is real
    (the first ``Lq`` positions are its padding)."""
    from attnkit.hf.attention_interface import _query_mask

    key_valid = torch.tensor([[False, False, True, True], [True, True, True, True]])
    assert _query_mask(key_valid, 1).tolist() == [[True], [True]]
    assert _query_mask(key_valid, 3).tolist() == [[False, True, True], [True, True, True]]


def test_a_causal_module_called_without_a_mask_at_one_cached_query_sees_every_key():
    """Incremental decoding without a mask: one new query after the cached keys sees them all (a top-left
    causal mask would leave it key 0 alone); a whole prefix without a mask is causal."""
    torch.manual_seed(4)
    q, k, v = torch.randn(1, 2, 1, 4, dtype=torch.float64), *torch.randn(2, 1, 2, 5, 4, dtype=torch.float64)
    out, _ = attention_forward(_module("softmax", causal=True), q, k, v, None, scaling=0.5)
    expected = torch.softmax(0.5 * q @ k.transpose(-1, -2), dim=-1) @ v  # (1, 2, 1, 4)
    torch.testing.assert_close(out, expected.transpose(1, 2), atol=1e-12, rtol=0)
    q5 = torch.randn(1, 2, 5, 4, dtype=torch.float64)
    out, _ = attention_forward(_module("softmax", causal=True), q5, k, v, None, scaling=0.5)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    s = (0.5 * q5 @ k.transpose(-1, -2)).masked_fill(~causal, float("-inf"))
    torch.testing.assert_close(out, (torch.softmax(s, dim=-1) @ v).transpose(1, 2), atol=1e-12, rtol=0)


@pytest.mark.parametrize("mechanism", ["softmax", "dnas"])
def test_a_float_mask_and_a_position_bias_are_both_added_to_the_scores(mechanism):
    torch.manual_seed(5)
    q, k, v = torch.randn(3, 1, 2, 3, 4, dtype=torch.float64)
    bias = torch.tensor([[0.0, -1.0, 0.5], [0.3, 0.0, -2.0], [1.0, 0.2, 0.0]], dtype=torch.float64)
    bias = bias[None, None]  # (1, 1, 3, 3): a float mask that masks nothing
    position_bias = torch.randn(1, 2, 3, 3, dtype=torch.float64)
    out, _ = attention_forward(_module(mechanism), q, k, v, bias, scaling=0.5, position_bias=position_bias)
    s = 0.5 * q @ k.transpose(-1, -2) + bias + position_bias
    weights = ak.normalize(s, mechanism)  # (1, 2, 3, 3)
    torch.testing.assert_close(out, (weights @ v).transpose(1, 2), atol=1e-12, rtol=0)


def test_observing_converted_softmax_keeps_its_padded_query_rows():
    """An observer sees softmax's padded query rows as padding, but the module's outputs stay those of an
    unobserved call (transformers keeps those rows); only the observed weights leave them out."""
    from attnkit.functional import observe_weights

    torch.manual_seed(6)
    q, k, v = torch.randn(3, 2, 2, 4, 4, dtype=torch.float64)
    mask, pad = _padding_mask((4, 2), 4)
    full = mask[:, None, None, :].expand(2, 1, 4, 4)  # transformers' (B, 1, Lq, Lk) form of the padding
    plain, _ = attention_forward(_module("softmax"), q, k, v, full, scaling=0.5)
    seen = []
    with observe_weights(lambda weights, info, config: seen.append(weights)):
        observed, _ = attention_forward(_module("softmax"), q, k, v, full, scaling=0.5)
    torch.testing.assert_close(observed, plain, atol=1e-12, rtol=0)
    assert bool(plain[1, 2:].abs().sum() > 0)  # the padded rows hold softmax's outputs, not zeros
    assert seen and bool((seen[0][1, :, 2:] == 0).all())  # the observer's weights leave them out


def test_the_models_attention_dropout_is_applied_unbiased():
    """``dropout`` (the model's attention dropout in training) reaches the mechanism: outputs vary between
    calls and average to the output without dropout."""
    torch.manual_seed(7)
    q, k, v = torch.randn(3, 1, 1, 3, 2, dtype=torch.float64)
    plain, _ = attention_forward(_module("dnas"), q, k, v, None, scaling=1.0)
    draws = torch.stack([attention_forward(_module("dnas"), q, k, v, None, scaling=1.0, dropout=0.5)[0]
                         for _ in range(3000)])
    assert not torch.equal(draws[0], draws[1])
    z = (draws.mean(0) - plain) / (draws.std(0) / len(draws) ** 0.5)  # each entry ~ N(0, 1) if unbiased
    assert float(z.abs().max()) < 4.5


@pytest.mark.parametrize("kv_offset", [0, 2])
def test_the_key_padding_shortcut_is_taken_only_where_it_equals_transformers_mask(kv_offset):
    """The bidirectional padding mask is passed on as (B, Lk) only without a key offset: with one,
    transformers reads the padding at positions kv_offset.. (the mask shifted), which the mask as given is
    not."""
    from transformers.masking_utils import bidirectional_mask_function, sdpa_mask

    from attnkit.hf.attention_interface import attention_mask

    padding = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)  # (B, Lk)
    args = dict(batch_size=2, q_length=5, kv_length=5, kv_offset=kv_offset,
                mask_function=bidirectional_mask_function, attention_mask=padding)
    ours = attention_mask(**args)
    theirs = sdpa_mask(**args, allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
    if ours.dim() == 2:  # the shortcut: a key padding mask (B, Lk)
        assert kv_offset == 0
        ours = ours[:, None, None, :].expand(2, 1, 5, 5)
    assert torch.equal(ours, theirs)


def test_a_key_hidden_in_one_head_only_keeps_its_query_in_every_head():
    """A per-head 4-D mask hiding key 3 from head 0 only: the key (and so its query) is real, because head 1
    reads it; reading the first head alone took query 3 for padding, out of dnas's column sums."""
    torch.manual_seed(0)
    B, H, L, D = 1, 2, 5, 4
    q, k, v = (torch.randn(B, H, L, D, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(B, H, L, L, dtype=torch.bool)
    mask[:, 0, :, 3] = False  # head 0 does not read key 3; head 1 reads every key
    out, _ = attention_forward(_module("dnas", H=H), q, k, v, mask, scaling=0.5)
    every_query = torch.ones(B, 1, L, 1, dtype=torch.bool)
    expected = _dnas_reference(0.5 * q @ k.transpose(-1, -2), mask & every_query) @ v  # (B, H, L, D)
    torch.testing.assert_close(out.transpose(1, 2), expected, atol=1e-12, rtol=0)
    assert out[0, 3].abs().sum() > 0  # query 3's row is there in both heads


def test_cross_attention_keeps_every_query_whatever_the_key_padding():
    """A cross-attention module's queries are not its keys: the encoder's padding at key 3 must not take the
    decoder's query 3 out of dnas's column sums (it did when the query mask was inferred wherever
    Lk >= Lq)."""
    torch.manual_seed(0)
    B, H, L, D = 1, 2, 5, 4
    q, k, v = (torch.randn(B, H, L, D, dtype=torch.float64) for _ in range(3))
    module = _module("dnas", H=H)
    module.attnkit_self_attention = False
    keys = torch.tensor([[1, 1, 1, 0, 1]], dtype=torch.bool)  # (B, Lk): the encoder's padding
    out, _ = attention_forward(module, q, k, v, keys, scaling=0.5)
    valid = torch.ones(B, 1, L, 1, dtype=torch.bool) & keys[:, None, None, :]  # every query, real keys
    expected = _dnas_reference(0.5 * q @ k.transpose(-1, -2), valid) @ v
    torch.testing.assert_close(out.transpose(1, 2), expected, atol=1e-12, rtol=0)


def test_the_modules_backend_is_the_one_the_call_takes(monkeypatch):
    """A converted module's recorded backend (e.g. "reference" for a debugging run) reaches ak.attention; a
    call that always took "auto" would ignore it."""
    import attnkit.hf.attention_interface as interface

    seen = []
    real = interface.attention
    monkeypatch.setattr(interface, "attention", lambda *a, **kw: seen.append(kw["backend"]) or real(*a, **kw))
    q = torch.randn(1, 2, 3, 4)
    module = _module("dnas", H=2)
    attention_forward(module, q, q, q, None, scaling=0.5)
    module.attnkit_backend = "reference"
    attention_forward(module, q, q, q, None, scaling=0.5)
    assert seen == ["auto", "reference"]
