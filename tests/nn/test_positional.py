"""Positional encodings: the sinusoid closed form, offsets, layouts, learned tables and length checks."""

from __future__ import annotations

import math

import pytest
import torch

import attnkit.nn as aknn


@pytest.mark.parametrize("d_model", [6, 7])
def test_sinusoidal_matches_closed_form(d_model):
    module = aknn.SinusoidalPositionalEncoding(d_model, max_len=12)
    out = module(torch.zeros(1, 12, d_model))[0]
    expected = torch.zeros(12, d_model)
    for pos in range(12):
        for i in range(d_model):
            angle = pos / 10000 ** ((i - i % 2) / d_model)
            expected[pos, i] = math.sin(angle) if i % 2 == 0 else math.cos(angle)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def test_start_offset_continues_positions():
    module = aknn.SinusoidalPositionalEncoding(8, max_len=10)
    full = module(torch.zeros(2, 6, 8))
    tail = module(torch.zeros(2, 2, 8), start=4)
    torch.testing.assert_close(tail, full[:, 4:6])


def test_layouts_agree():
    module = aknn.LearnedPositionalEncoding(4, max_len=5)
    seq_first = aknn.LearnedPositionalEncoding(4, max_len=5, batch_first=False)
    seq_first.load_state_dict(module.state_dict())
    x = torch.randn(3, 5, 4)
    torch.testing.assert_close(seq_first(x.transpose(0, 1)).transpose(0, 1), module(x))
    torch.testing.assert_close(module(x[0]), module(x)[0])  # unbatched (L, d)


def test_learned_table_is_trained():
    module = aknn.LearnedPositionalEncoding(4, max_len=5)
    assert [name for name, _ in module.named_parameters()] == ["weight"]
    module(torch.randn(2, 3, 4)).sum().backward()
    assert module.weight.grad[:3].abs().sum() > 0 and module.weight.grad[3:].abs().sum() == 0


def test_sinusoidal_table_is_not_in_state_dict():
    assert len(aknn.SinusoidalPositionalEncoding(4).state_dict()) == 0


@pytest.mark.parametrize("cls", [aknn.SinusoidalPositionalEncoding, aknn.LearnedPositionalEncoding])
def test_too_long_input_raises_naming_max_len(cls):
    module = cls(4, max_len=5)
    with pytest.raises(ValueError, match="max_len=5"):
        module(torch.zeros(1, 6, 4))
    with pytest.raises(ValueError, match=r"\(B, L, 4\)"):
        module(torch.zeros(1, 3, 5))
    with pytest.raises(ValueError, match="max_len=0"):
        cls(4, max_len=0)


def test_the_sinusoidal_table_keeps_float64_accuracy_in_float64_models():
    """The table was rounded to float32 when built: a float64 model's positions erred by 3e-8."""
    pe = aknn.SinusoidalPositionalEncoding(8, max_len=64).double()
    pos, i = 50, 3  # PE(pos, 2i) = sin(pos / 10000^(2i/d))
    assert abs(pe.pe[pos, 2 * i].item() - math.sin(pos / 10000 ** (2 * i / 8))) < 1e-15
    x = torch.zeros(1, 3, 8)
    assert pe.float()(x).dtype == torch.float32
