"""Every ``attnkit.nn`` module's ``reset_parameters`` covers all its parameters: a module built on the meta
device, then ``to_empty`` (memory as found) and ``reset_parameters`` (torch's deferred initialization)
holds no leftover value."""

from __future__ import annotations

import pytest
import torch

import attnkit as ak
from attnkit.nn.coda_cross import AlignCompose, CoDACrossAttention

def assert_reset_leaves_no_leftover_memory(build, name: str) -> None:
    """Build on the meta device, ``to_empty``, fill every float tensor with NaN, ``reset_parameters``: every
    float tensor of the state dict must be finite."""
    with torch.device("meta"):
        module = build()
    module = module.to_empty(device="cpu")
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if tensor.is_floating_point():
                tensor.fill_(float("nan"))
    module.reset_parameters()
    for key, tensor in module.state_dict().items():
        if tensor.is_floating_point():
            assert torch.isfinite(tensor).all(), f"{name}: {key} kept its leftover values"


BUILDERS = {
    "multihead": lambda: ak.nn.MultiheadAttention(8, 2),
    "multihead_kdim_bias_kv_hnas": lambda: ak.nn.MultiheadAttention(8, 2, kdim=4, vdim=6, add_bias_kv=True,
                                                                    mechanism="hnas"),
    "encoder_layer": lambda: ak.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16),
    "decoder_layer": lambda: ak.nn.TransformerDecoderLayer(8, 2, dim_feedforward=16),
    "encoder": lambda: ak.nn.TransformerEncoder(ak.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16), 2,
                                                norm=torch.nn.LayerNorm(8)),
    "decoder": lambda: ak.nn.TransformerDecoder(ak.nn.TransformerDecoderLayer(8, 2, dim_feedforward=16), 2),
    "transformer": lambda: ak.nn.Transformer(8, 2, 1, 1, 16, positional="learned"),
    "multiview": lambda: ak.nn.MultiViewAttention(8, num_views=2, num_heads=2, mechanism="hnas"),
    "additive": lambda: ak.nn.AdditiveAttention(8, 6),
    "bilinear": lambda: ak.nn.BilinearAttention(8, 6),
    "dot_hnas": lambda: ak.nn.DotAttention(8, mechanism="hnas"),
    "gmm": lambda: ak.nn.GMMLocationAttention(8, 3),
    "mixed": lambda: ak.nn.MixedAttention(8, 6),
    "hard": lambda: ak.nn.HardAttention(8, 6),
    "draw_read": lambda: ak.nn.DRAWRead(8, 2, 6, 6),
    "sinusoidal": lambda: ak.nn.SinusoidalPositionalEncoding(8, max_len=16),
    "learned_positions": lambda: ak.nn.LearnedPositionalEncoding(8, max_len=16),
    "coda_cross": lambda: CoDACrossAttention(8),
    "align_compose": lambda: AlignCompose(8, 6),
}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_reset_parameters_after_to_empty_leaves_no_leftover_memory(name):
    """MultiheadAttention's reset left out_proj.weight as it was (torch's does too): NaN outputs after
    to_empty; the layers, stacks and CoDA cross-attention modules had no reset_parameters."""
    assert_reset_leaves_no_leftover_memory(BUILDERS[name], name)


def test_seeded_multihead_construction_still_draws_torchs_numbers():
    torch.manual_seed(0)
    ours = ak.nn.MultiheadAttention(8, 2, mechanism="softmax")
    torch.manual_seed(0)
    theirs = torch.nn.MultiheadAttention(8, 2)
    for key, value in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value), key
