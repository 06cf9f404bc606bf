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


def test_float64_rows_are_computed_at_the_positions_asked_for_and_nothing_is_kept():
    """Every float64 call rebuilt the whole table (2.7 ms per call at d_model 512, 69 ms at max_len 8192); a
    cached copy then travelled in pickles and stayed on the old device."""
    pe = aknn.SinusoidalPositionalEncoding(8, max_len=64)
    before = dict(pe.__dict__)
    rows = pe.rows(torch.tensor([[5, 50]]), torch.float64)
    assert rows.shape == (1, 2, 8) and rows.dtype == torch.float64
    assert abs(rows[0, 1, 6].item() - math.sin(50 / 10000 ** (6 / 8))) < 1e-15
    pe(torch.zeros(1, 3, 8, dtype=torch.float64))
    assert pe.__dict__.keys() == before.keys() and set(pe.state_dict()) == set()


def test_the_sinusoidal_table_keeps_float64_accuracy_in_float64_models():
    """The table was rounded to float32 when built: a float64 model's positions erred by 3e-8. Its buffer is
    float32 (as the module's other tensors: a float64 buffer cannot move to Apple's MPS device)."""
    pe = aknn.SinusoidalPositionalEncoding(8, max_len=64)
    assert pe.pe.dtype == torch.float32
    pos, i = 50, 3  # PE(pos, 2i) = sin(pos / 10000^(2i/d))
    out = pe.double()(torch.zeros(1, 51, 8, dtype=torch.float64))
    assert abs(out[0, pos, 2 * i].item() - math.sin(pos / 10000 ** (2 * i / 8))) < 1e-15
    gathered = pe(torch.zeros(1, 1, 8, dtype=torch.float64), positions=torch.tensor([[pos]]))
    assert abs(gathered[0, 0, 2 * i].item() - math.sin(pos / 10000 ** (2 * i / 8))) < 1e-15
    x = torch.zeros(1, 3, 8)
    assert pe.float()(x).dtype == torch.float32
    torch.testing.assert_close(pe(x), out[:, :3].float(), rtol=0, atol=6e-8)


@pytest.mark.parametrize("cls", [aknn.SinusoidalPositionalEncoding, aknn.LearnedPositionalEncoding])
@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
def test_a_nested_batch_numbers_each_sequence_as_the_padded_batch_does(cls, layout):
    """A nested batch (torch.nested) raised torch's internal "NestedTensorImpl doesn't support sizes"."""
    torch.manual_seed(0)
    pe = cls(4, max_len=8)
    seqs = [torch.randn(3, 4, requires_grad=True), torch.randn(5, 4, requires_grad=True)]
    out = pe(torch.nested.as_nested_tensor(seqs, layout=layout), start=1)
    assert out.is_nested
    for got, seq in zip(out.unbind(), seqs):
        torch.testing.assert_close(got, pe(seq[None], start=1)[0])
    sum(part.sum() for part in out.unbind()).backward()
    assert all(seq.grad is not None for seq in seqs)
    x = torch.nested.as_nested_tensor([s.detach() for s in seqs], layout=layout)
    assert (pe(x) + x).is_nested  # a jagged result kept x's offsets: adding them raised torch's error
    with pytest.raises(ValueError, match="leave positions out"):
        pe(torch.nested.as_nested_tensor(seqs, layout=layout), positions=torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="max_len >= 9"):
        pe(torch.nested.as_nested_tensor(seqs, layout=layout), start=4)
    with pytest.raises(ValueError, match="batch_first=True"):
        cls(4, max_len=8, batch_first=False)(torch.nested.as_nested_tensor(seqs, layout=layout))


def test_positions_for_an_unbatched_x_name_the_missing_batch_dimension():
    """The message said to build the module with batch_first=True, which it already was."""
    pe = aknn.SinusoidalPositionalEncoding(8)
    with pytest.raises(ValueError, match=r"add the batch dimension \(x\[None\], positions\[None\]\)"):
        pe(torch.zeros(3, 8), positions=torch.arange(3))
