"""attnkit.hf.attention_forward with 4-D masks of batch size 1 (broadcast over the batch, as transformers and
softmax take them) and with float bias tables (BEiT's and Swin's relative position bias, passed as a float
``attention_mask``): dnas, hnas and sinkhorn raised on a query mask the user never passed."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

import attnkit as ak
import attnkit.hf as akhf
from attnkit.hf import attention_forward
from tests.hf._models import hidden, tiny_model

pytestmark = pytest.mark.hf

MECHANISMS = ("softmax", "dnas", "hnas", "sinkhorn")


def _module(mechanism, H=2):
    m = torch.nn.Module()
    m.is_causal = False
    m.attnkit_mechanism = ak.resolve_mechanism(mechanism)
    m.attnkit_self_attention = True
    if mechanism == "hnas":
        m.attnkit_theta = torch.nn.Parameter(torch.tensor([0.3, -0.7], dtype=torch.float64))
    return m


def _qkv(B=2, H=2, L=5, D=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, L, D, generator=g, dtype=torch.float64) for _ in range(3))


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_a_batch_one_4d_mask_equals_its_expansion_over_the_batch(mechanism):
    q, k, v = _qkv()
    keys = torch.tensor([True, True, True, False, False])
    boolean = keys[None, None, None, :].expand(1, 1, 5, 5)  # (1, 1, Lq, Lk)
    neg = torch.finfo(torch.float64).min
    additive = torch.zeros(1, 1, 5, 5, dtype=torch.float64).masked_fill(~boolean, neg)
    bias = torch.randn(1, 2, 5, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for mask in (boolean, additive, torch.zeros(1, 1, 5, 5, dtype=torch.float64), bias, additive + bias):
        out, _ = attention_forward(_module(mechanism), q, k, v, mask, scaling=0.5)
        batch = mask.expand(2, *mask.shape[1:])  # (B, 1|H, Lq, Lk)
        expanded, _ = attention_forward(_module(mechanism), q, k, v, batch, scaling=0.5)
        torch.testing.assert_close(out, expanded, atol=1e-12, rtol=0)


@pytest.mark.parametrize("mechanism", ("dnas", "sinkhorn"))
def test_a_bias_near_zero_gives_the_output_of_a_zero_bias(mechanism):
    """A float mask of zeros and padding is read as a boolean mask; a learned bias table that leaves zero
    (BEiT, Swin) must give a nearby output, with the padded queries still out of the column normalization."""
    q, k, v = _qkv()
    pad = torch.tensor([[True] * 5, [True, True, True, False, False]])
    padding = torch.zeros(2, 1, 5, 5, dtype=torch.float64).masked_fill(
        ~pad[:, None, None, :], torch.finfo(torch.float64).min
    )  # (B, 1, Lq, Lk)
    table = torch.randn(1, 2, 5, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    zero, _ = attention_forward(_module(mechanism), q, k, v, padding, scaling=0.5)
    near, _ = attention_forward(_module(mechanism), q, k, v, padding + 1e-9 * table, scaling=0.5)
    torch.testing.assert_close(near, zero, atol=1e-7, rtol=0)
    learned, _ = attention_forward(_module(mechanism), q, k, v, padding + table, scaling=0.5)
    assert (learned - zero).abs().max() > 1e-3  # a non-zero table is added as a bias


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_bert_with_a_batch_one_4d_mask_equals_the_expanded_mask(mechanism):
    model = akhf.convert(tiny_model("bert"), mechanism)
    ids = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    keys = torch.tensor([True] * 5 + [False] * 2)
    boolean = keys[None, None, None, :].expand(1, 1, 7, 7)  # (1, 1, Lq, Lk)
    for mask in (boolean, torch.zeros(1, 1, 7, 7)):
        out = hidden(model, ids, mask)
        torch.testing.assert_close(out, hidden(model, ids, mask.expand(2, 1, 7, 7)), atol=1e-5, rtol=0)


def _beit():
    from transformers import BeitConfig, BeitModel

    config = BeitConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                        image_size=16, patch_size=8, num_channels=3, use_relative_position_bias=True)
    return BeitModel._from_config(config, attn_implementation="eager").eval()


def _swin():
    from transformers import SwinConfig, SwinModel

    config = SwinConfig(image_size=16, patch_size=2, num_channels=3, embed_dim=8, depths=[2, 2],
                        num_heads=[2, 2], window_size=4)
    return SwinModel._from_config(config, attn_implementation="eager").eval()


@pytest.mark.parametrize("build", (_beit, _swin), ids=("beit", "swin"))
@pytest.mark.parametrize("table", ("zero", "learned"))
def test_a_vision_model_with_a_bias_table_gives_each_image_what_it_gives_alone(build, table):
    """BEiT passes its relative position bias (all zeros when built) as a float ``attention_mask`` of batch
    size 1; Swin runs batch x windows with a batch-1 bias."""
    torch.manual_seed(0)
    base = build()
    with torch.no_grad():
        for name, p in base.named_parameters():
            if "relative_position_bias_table" in name:
                p.zero_() if table == "zero" else p.normal_(0, 1.0)
    model = akhf.convert(copy.deepcopy(base), "dnas")
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        both = model(pixel_values=pixels).last_hidden_state
        for b in range(2):
            alone = model(pixel_values=pixels[b : b + 1]).last_hidden_state
            torch.testing.assert_close(both[b : b + 1], alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize("build", (_beit, _swin), ids=("beit", "swin"))
def test_a_bias_table_built_at_zero_gets_the_gradient_of_the_unconverted_model(build):
    """An all-zero float mask was read as a padding mask (a bool tensor): BEiT's and the unshifted Swin
    blocks' relative position bias tables, zero when built from a config, got no gradient after conversion
    (softmax included) and stayed 0 for the whole training run."""
    torch.manual_seed(0)
    base = build().double()  # eval(): no stochastic depth, whose draws would differ between the two models
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = []
    for model in (copy.deepcopy(base), akhf.convert(copy.deepcopy(base), "softmax")):
        model(pixel_values=pixels).last_hidden_state.pow(2).mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if "relative_position_bias_table" in n})
    assert grads[0]
    for name, eager in grads[0].items():
        assert eager is not None and eager.abs().max() > 0
        converted = grads[1][name]
        assert converted is not None, f"{name} got no gradient"
        # transformers' eager softmax runs in float32 even for float64 inputs
        torch.testing.assert_close(converted, eager, atol=1e-6 * float(eager.abs().max()), rtol=1e-4)
